"""Image-editing rewards on embeddings and pixels: does the edit follow its instruction, and what of the source does it keep.

Every scorer here reads the edit's source image(s) from metadata["source_images"] (SOURCE_KEY): for each edited image
a list of source images, each a uint8 tensor [3,H,W], a float tensor [3,H,W] in [0,1] or a PIL image (a [K,3,H,W]
stack counts as K images). `source_index` (default 0) picks the image the edit was made from; the others are extra
references that multi-image edit models take. An entry that is None or empty, or has no image at source_index, is NaN
(could not score) and counted in counters["missing_source"]. A missing "source_images" key is a one-line ValueError.
Before any comparison the source is resized to the edit's size (bicubic, antialiased, clamped to [0,1]; the aspect
ratio is not kept). Gradients reach the edited images, never the sources.

clip_directional: CLIP directional similarity, as InstructPix2Pix computes it (Brooks et al. 2023,
    metrics/clip_similarity.py; the direction idea is StyleGAN-NADA's, Gal et al. 2022):
        cos(E_img(edit) - E_img(source), E_txt(target caption) - E_txt(source caption))
    with E the L2-normalised projected CLIP embeddings (default CLIP-L/14, the backbone IP2P uses). Captions come from
    metadata[target_caption_key] (default "target_caption") and metadata[source_caption_key] (default
    "source_caption"). Fallback, per image, when a key is absent or its entry is None: the target caption is the
    prompt (the instruction: weaker than an output caption, as "make it snowy" describes a change, not the result),
    the source caption is `default_source_caption` (default "": the text direction then runs from the empty
    caption to the target); each fallback is counted (counters["target_caption_fallbacks"] /
    ["source_caption_fallbacks"]). A direction shorter than `min_direction` (default 1e-3; the embeddings have
    norm 1) scores 0 and is counted in counters["zero_direction"]: an unchanged edit, or equal captions. Its
    cosine would be the angle of numerical noise (float32 embeddings of one image differ by ~1e-7 between batch
    sizes; lower precision may differ more: raise min_direction there). A real edit moves the embedding far more:
    a CLIP-I of 0.95 between edit and source is a direction of length sqrt(2 - 2 * 0.95) ~ 0.32.
    Extra outputs: <key>/image_similarity = cos(E_img(edit), E_img(source)) (IP2P's sim_image, "CLIP-I") and
    <key>/target_similarity = cos(E_img(edit), E_txt(target caption)) (IP2P's sim_1).
edit_preservation: how much of the source the edit keeps, by `kind`:
    pixel   1 - mean |edit - source| over pixels and channels, in [0, 1] (the L1 distance MagicBrush and Emu Edit
            report, Zhang et al. 2023 / Sheynin et al. 2024, turned into a similarity); no model, differentiable;
    clip    cos(E_clip(edit), E_clip(source)) (CLIP-I in MagicBrush / Emu Edit; default CLIP-L/14);
    dinov2  cos(DINOv2 CLS(edit), DINOv2 CLS(source)) (their DINO score; default dinov2-base, 518x518, as the
            image_similarity scorer loads it).
The remote multimodal judges of edits are in reward_models.edit_judge.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from PIL import Image

from .base import Scorer
from .encoders import Backbone, BackboneSettings, ClipBackbone, EmbeddingScorer
from .images import ImageBatch, as_image_list, pil_to_tensor
from .registry import register, with_settings

SOURCE_KEY = "source_images"
SOURCE_CAPTION_KEY = "source_caption"
TARGET_CAPTION_KEY = "target_caption"
PRESERVATION_KINDS = ("pixel", "clip", "dinov2")
MIN_DIRECTION = 1e-3  # shorter image or text directions (unit-embedding units) are numerical noise: score 0


# --- source images ---------------------------------------------------------------------------------------------


def source_list(value) -> list:
    """The source images of one edit as a flat list (PIL images and [3,H,W] tensors)."""
    try:
        return as_image_list(value)
    except (TypeError, ValueError) as err:
        raise type(err)(f"metadata '{SOURCE_KEY}': {err}") from None


def as_float_image(image) -> torch.Tensor:
    """A source image (PIL, uint8 or float [3,H,W]) as a float [3,H,W] tensor in [0,1], detached."""
    if isinstance(image, Image.Image):
        return pil_to_tensor(image)
    if image.ndim != 3 or image.shape[0] != 3:
        raise ValueError(f"metadata '{SOURCE_KEY}': a source image must be [3,H,W], got {tuple(image.shape)}")
    if image.dtype == torch.uint8:
        return image.detach().float() / 255.0
    if not image.is_floating_point():
        raise TypeError(f"metadata '{SOURCE_KEY}': source images must be uint8 or float in [0,1], got {image.dtype}")
    return image.detach().float()


def resize_to(image: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """Float [3,h,w] -> [3,H,W]: bicubic with antialiasing (PIL's kernel), clamped to [0,1]; a no-op at that size."""
    if tuple(image.shape[-2:]) == tuple(size):
        return image
    resized = F.interpolate(image[None], size=tuple(size), mode="bicubic", align_corners=False, antialias=True)
    return resized[0].clamp(0, 1)


def edit_sizes(images: ImageBatch) -> list[tuple[int, int]]:
    """(height, width) of each edited image."""
    if images.uniform:
        h, w = images.tensor().shape[-2:]
        return [(int(h), int(w))] * len(images)
    return [(im.height, im.width) for im in images.pil()]


def matched_sources(images: ImageBatch, entries: list, index: int) -> list[torch.Tensor | None]:
    """For each edit, its source at `index` resized to the edit's size (float [3,H,W] on the edits' device), or
    None when the entry has no image there or a non-finite one."""
    out: list[torch.Tensor | None] = []
    for entry, size in zip(entries, edit_sizes(images)):
        items = source_list(entry)
        if not -len(items) <= index < len(items):
            out.append(None)
            continue
        item = items[index]
        image = as_float_image(item.to(images.device) if isinstance(item, torch.Tensor) else item).to(images.device)
        out.append(resize_to(image, size) if bool(torch.isfinite(image).all()) else None)
    return out


class SourceImages:
    """What the edit scorers share: the metadata key, the source index and the count of missing sources."""

    metadata_keys = (SOURCE_KEY,)
    source_index: int = 0
    counters: dict

    def sources(self, images: ImageBatch, metadata: dict[str, list]) -> list[torch.Tensor | None]:
        found = matched_sources(images, metadata[SOURCE_KEY], self.source_index)
        self.counters["missing_source"] += sum(s is None for s in found)
        return found


def embed_sources(backbone: Backbone, sources: list[torch.Tensor | None], batch_size: int, like: torch.Tensor):
    """Normalised embeddings [B, D] of the sources (zeros where None), without grad, in chunks of batch_size."""
    out = torch.zeros_like(like, dtype=torch.float32).detach()
    rows = [i for i, s in enumerate(sources) if s is not None]
    with torch.no_grad():
        for start in range(0, len(rows), batch_size):
            part = rows[start : start + batch_size]
            images = [sources[i] for i in part]
            batch = (
                ImageBatch(torch.stack(images))
                if len({tuple(s.shape) for s in images}) == 1
                else ImageBatch([ImageBatch(s[None]).pil()[0] for s in images])
            )
            out[part] = backbone.image_features(batch).to(out.device)
    return out


def _missing_to_nan(values: torch.Tensor, sources: list) -> torch.Tensor:
    ok = torch.tensor([s is not None for s in sources], device=values.device)
    return torch.where(ok, values, torch.full_like(values, float("nan")))


# --- clip_directional ------------------------------------------------------------------------------------------


class ClipDirectional(SourceImages, EmbeddingScorer):
    """cos(E_img(edit) - E_img(source), E_txt(target caption) - E_txt(source caption)) on CLIP."""

    name = "clip_directional"
    requires_prompts = True  # the instruction: the target caption when none is given

    def __init__(
        self,
        backbone: ClipBackbone,
        *,
        source_caption_key: str | None = SOURCE_CAPTION_KEY,
        target_caption_key: str | None = TARGET_CAPTION_KEY,
        default_source_caption: str = "",
        source_index: int = 0,
        min_direction: float = MIN_DIRECTION,
        batch_size: int = 32,
        key: str | None = None,
    ):
        if not min_direction >= 0:
            raise ValueError(f"min_direction must be >= 0, got {min_direction}")
        super().__init__(backbone, batch_size=batch_size, key=key)
        self.min_direction = float(min_direction)
        self.source_caption_key, self.target_caption_key = source_caption_key, target_caption_key
        self.default_source_caption, self.source_index = str(default_source_caption), int(source_index)

    def _captions(self, metadata: dict[str, list], key: str | None, fallback: list[str], what: str) -> list[str]:
        given = metadata.get(key) if key else None
        out = []
        for i, default in enumerate(fallback):
            value = None if given is None else given[i]
            if value is None:
                self.counters[f"{what}_caption_fallbacks"] += 1
                value = default
            elif not isinstance(value, str):
                raise TypeError(f"scorer '{self.name}': metadata '{key}' must hold strings, got {type(value).__name__}")
            out.append(value)
        return out

    def captions(self, prompts: list[str], metadata: dict[str, list]) -> tuple[list[str], list[str]]:
        """(source captions, target captions) with the documented fallbacks."""
        source = self._captions(
            metadata, self.source_caption_key, [self.default_source_caption] * len(prompts), "source"
        )
        return source, self._captions(metadata, self.target_caption_key, list(prompts), "target")

    def score_batch(self, images, prompts, metadata):
        sources = self.sources(images, metadata)
        source_captions, target_captions = self.captions(prompts, metadata)
        edit = self.backbone.image_features(images)
        src = embed_sources(self.backbone, sources, self.batch_size, edit).to(edit.device)
        text_src = self.backbone.text_features(source_captions).to(edit.device)
        text_tgt = self.backbone.text_features(target_captions).to(edit.device)
        d_image, d_text = edit - src, text_tgt - text_src
        short = (d_image.detach().norm(dim=-1) < self.min_direction) | (d_text.norm(dim=-1) < self.min_direction)
        found = torch.tensor([s is not None for s in sources], device=short.device)
        self.counters["zero_direction"] += int((short & found).sum())
        direction = (F.normalize(d_image, dim=-1) * F.normalize(d_text, dim=-1)).sum(-1)
        direction = torch.where(short, torch.zeros_like(direction), direction)
        return {
            self.key: _missing_to_nan(direction, sources),
            f"{self.key}/image_similarity": _missing_to_nan((edit * src).sum(-1), sources),
            f"{self.key}/target_similarity": (edit * text_tgt).sum(-1),
        }


# --- edit_preservation -----------------------------------------------------------------------------------------


class PixelPreservation(SourceImages, Scorer):
    """1 - mean |edit - source| over pixels and channels (both in [0,1])."""

    name = "edit_preservation"
    differentiable = True
    kind = "pixel"

    def __init__(self, *, source_index: int = 0, batch_size: int = 32, key: str | None = None):
        super().__init__(batch_size=batch_size, key=key)
        self.source_index = int(source_index)

    def score_batch(self, images, prompts, metadata):
        sources = self.sources(images, metadata)
        edits = list(images.tensor().unbind(0)) if images.uniform else images.tensors()
        scores = [
            e.new_tensor(float("nan"))
            if s is None
            else 1.0 - (e.float() - s.to(device=e.device, dtype=torch.float32)).abs().mean()
            for e, s in zip(edits, sources)
        ]
        return {self.key: torch.stack(scores)}


class EmbeddingPreservation(SourceImages, EmbeddingScorer):
    """cos(features(edit), features(source)) on a CLIP or DINOv2 backbone."""

    name = "edit_preservation"

    def __init__(self, backbone: Backbone, *, kind: str, source_index: int = 0, batch_size: int = 32, key=None):
        super().__init__(backbone, batch_size=batch_size, key=key)
        self.kind, self.source_index = kind, int(source_index)

    def score_batch(self, images, prompts, metadata):
        sources = self.sources(images, metadata)
        edit = self.backbone.image_features(images)
        src = embed_sources(self.backbone, sources, self.batch_size, edit).to(edit.device)
        return {self.key: _missing_to_nan((edit * src).sum(-1), sources)}


# --- registry --------------------------------------------------------------------------------------------------


@register("clip_directional")
@with_settings(BackboneSettings)
def build_clip_directional(
    *,
    source_caption_key: str | None = SOURCE_CAPTION_KEY,
    target_caption_key: str | None = TARGET_CAPTION_KEY,
    default_source_caption: str = "",
    source_index: int = 0,
    min_direction: float = MIN_DIRECTION,
    batch_size: int = 32,
    key: str | None = None,
    **backbone,
) -> ClipDirectional:
    """CLIP directional similarity of an edit (InstructPix2Pix): cos(E_img(edit) - E_img(source), E_txt(target
    caption) - E_txt(source caption)); sources in metadata 'source_images', captions in the metadata keys named
    (target falls back to the prompt, source to default_source_caption)."""
    return ClipDirectional(
        BackboneSettings(**backbone).load_clip(),
        source_caption_key=source_caption_key,
        target_caption_key=target_caption_key,
        default_source_caption=default_source_caption,
        source_index=source_index,
        min_direction=min_direction,
        batch_size=batch_size,
        key=key,
    )


@register("edit_preservation")
@with_settings(BackboneSettings, model=None)
def build_edit_preservation(
    *,
    kind: str = "pixel",
    source_index: int = 0,
    image_size: int | None = None,
    batch_size: int = 32,
    key: str | None = None,
    **load,
) -> Scorer:
    """How much of its source (metadata 'source_images') an edit keeps: kind pixel (1 - mean |edit - source|),
    clip (CLIP-I cosine) or dinov2 (DINO cosine)."""
    if kind not in PRESERVATION_KINDS:
        raise ValueError(f"edit_preservation kind must be one of {PRESERVATION_KINDS}, got {kind!r}")
    if kind == "pixel":
        defaults = BackboneSettings(model=None)
        ignored = [
            f.name
            for f in dataclasses.fields(BackboneSettings)
            if f.name not in ("tiny", "local_files_only") and load[f.name] != getattr(defaults, f.name)
        ] + (["image_size"] if image_size is not None else [])
        if ignored:
            raise ValueError(
                f"edit_preservation kind='pixel' uses no model; {ignored} apply to kind 'clip' or 'dinov2'"
            )
        return PixelPreservation(source_index=source_index, batch_size=batch_size, key=key)
    from .similarity import build_image_similarity  # its backbone loading and checks, one way for both scorers

    backbone = build_image_similarity(backbone="clip" if kind == "clip" else "dinov2", image_size=image_size, **load)
    return EmbeddingPreservation(
        backbone.backbone, kind=kind, source_index=source_index, batch_size=batch_size, key=key
    )
