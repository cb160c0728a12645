"""image_similarity: cosine similarity of an image's features to its reference image(s).

References come in metadata["reference_images"], one entry per image: a PIL image, a float tensor
[3,H,W] or [K,3,H,W] in [0,1], or a list of those; the score is the maximum cosine over the
entry's references (Flow-GRPO's editing reward is the one-reference case, Adv-GRPO's the max).
An empty entry (None or []) gives NaN. Features: CLIP projected image embeddings (default
CLIP-L/14) or DINOv2 pooled CLS (default dinov2-base, images resized to 518x518, ImageNet stats).
Gradients flow through the generated images, never the references.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from .encoders import CLIP_L14, BackboneSettings, ClipBackbone, Dinov2Backbone, EmbeddingScorer
from .images import ImageBatch, as_image_list
from .registry import register, with_settings

DINOV2_BASE = "facebook/dinov2-base"
REFERENCE_KEY = "reference_images"
BACKBONES = ("clip", "dinov2")


class ImageSimilarity(EmbeddingScorer):
    """max over references of cos(features(image), features(reference))."""

    name = "image_similarity"
    metadata_keys = (REFERENCE_KEY,)
    backbone: ClipBackbone | Dinov2Backbone

    def _embed(self, images: list) -> torch.Tensor:
        # References are plain images too: embed them in chunks of batch_size, without grad.
        chunks = []
        with torch.no_grad():
            for s in range(0, len(images), self.batch_size):
                part = images[s : s + self.batch_size]
                batch = (
                    ImageBatch(torch.stack(part))
                    if all(isinstance(p, torch.Tensor) for p in part) and len({tuple(p.shape) for p in part}) == 1
                    else ImageBatch(_as_pil(part))
                )
                chunks.append(self.backbone.image_features(batch))
        return torch.cat(chunks)

    def score_batch(self, images, prompts, metadata):
        generated = self.backbone.image_features(images)
        refs = [as_image_list(v) for v in metadata[REFERENCE_KEY]]
        flat = [r for rs in refs for r in rs]
        ref_feats = self._embed(flat) if flat else generated.new_zeros(0, generated.shape[1])
        scores, start = [], 0
        for i, rs in enumerate(refs):
            if not rs:
                scores.append(generated.new_tensor(float("nan")))
                continue
            sims = ref_feats[start : start + len(rs)] @ generated[i]
            scores.append(sims.max())
            start += len(rs)
        return {self.key: torch.stack(scores)}


def _as_pil(images: list) -> list:
    """Mixed references (PIL and tensors of different sizes) -> PIL, via the uint8 round trip."""
    out = []
    for im in images:
        out.extend(ImageBatch(im[None]).pil() if isinstance(im, torch.Tensor) else [im])
    return out


@register("image_similarity")
@with_settings(BackboneSettings, model=None)
def build_image_similarity(
    *, backbone: str = "clip", image_size: int | None = None, batch_size: int = 32, key: str | None = None, **load
) -> ImageSimilarity:
    """Max cosine similarity to reference images (metadata 'reference_images'), CLIP or DINOv2."""
    settings = BackboneSettings(**load)
    if backbone == "clip":
        if image_size is not None:
            raise ValueError("image_size applies to backbone='dinov2'; CLIP uses its processor's sizes")
        net = replace(settings, model=settings.model or CLIP_L14).load_clip()
    elif backbone == "dinov2":
        if settings.preprocess != "tensor" or settings.processor is not None:
            raise ValueError("backbone='dinov2' has only the tensor preprocessing (Adv-GRPO recipe)")
        kw = dict(image_size=image_size, device=settings.device, dtype=settings.dtype)
        net = (
            Dinov2Backbone.tiny(**kw)
            if settings.tiny
            else Dinov2Backbone.from_pretrained(
                settings.model or DINOV2_BASE, local_files_only=settings.local_files_only, **kw
            )
        )
    else:
        raise ValueError(f"backbone must be one of {BACKBONES}, got {backbone!r}")
    return ImageSimilarity(net, batch_size=batch_size, key=key)
