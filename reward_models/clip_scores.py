"""Text-image scores on a CLIP backbone: CLIPScore and PickScore.

clip_score: cos(image, text) of the projected CLIP embeddings (default CLIP-L/14), with one of the
  published scalings named by `variant`:
    cosine        raw cosine in [-1, 1] (best for RL: no flat region)
    hessel        2.5 * max(cos, 0), Hessel et al. 2021 (CLIP-S; they prefix captions with
                  "A photo depicts" [verify] -- set prompt_prefix to reproduce)
    torchmetrics  max(100 * cos, 0), torchmetrics CLIPScore
  Flow-GRPO's clip_score is 100 * cos / 30: variant cosine with weight 100/30.
pickscore: exp(logit_scale) * cos(image, text) with the PickScore_v1 CLIP-H/14 and the laion CLIP-H
  processor (model card recipe); typical values 18-24 [verify]. Flow-GRPO divides by 26 and
  DanceGRPO uses the bare cosine: both are constant rescalings, i.e. a MultiReward weight.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .base import Pretrained, Scorer
from .encoders import ClipBackbone, load_clip
from .registry import register

CLIP_L14 = "openai/clip-vit-large-patch14"
PICKSCORE_V1 = "yuvalkirstain/PickScore_v1"
CLIP_H14_LAION = "laion/CLIP-ViT-H-14-laion2B-s32B-b79K"

CLIPSCORE_VARIANTS = {
    "cosine": lambda cos: cos,
    "hessel": lambda cos: 2.5 * cos.clamp_min(0),
    "torchmetrics": lambda cos: (100 * cos).clamp_min(0),
}


def text_image_cosine(backbone: ClipBackbone, images, prompts: list[str]) -> torch.Tensor:
    """cos(image_i, text_i) [B] in float32 (bf16 embeddings are upcast before normalising)."""
    image = F.normalize(backbone.image_embeds(images).float(), dim=-1)
    text = F.normalize(backbone.text_embeds(prompts).float(), dim=-1)
    return (image * text).sum(-1)


class _ClipTextImage(Pretrained, Scorer):
    requires_prompts = True
    differentiable = True

    def __init__(self, backbone: ClipBackbone, *, batch_size: int = 32, key: str | None = None):
        super().__init__(batch_size=batch_size, key=key)
        self.backbone = backbone

    def to(self, device=None, dtype=None):
        self.backbone.to(device, dtype)
        return self


class ClipScore(_ClipTextImage):
    """CLIP text-image cosine with a named published scaling."""

    name = "clip_score"

    def __init__(self, backbone: ClipBackbone, *, variant: str = "cosine", prompt_prefix: str = "", **kwargs):
        if variant not in CLIPSCORE_VARIANTS:
            raise ValueError(f"clip_score variant must be one of {sorted(CLIPSCORE_VARIANTS)}, got {variant!r}")
        super().__init__(backbone, **kwargs)
        self.variant, self.prompt_prefix = variant, prompt_prefix

    def score_batch(self, images, prompts, metadata):
        cos = text_image_cosine(self.backbone, images, [self.prompt_prefix + p for p in prompts])
        return {self.key: CLIPSCORE_VARIANTS[self.variant](cos)}


class PickScore(_ClipTextImage):
    """exp(logit_scale) * cos(image, text) on PickScore_v1."""

    name = "pickscore"

    def score_batch(self, images, prompts, metadata):
        cos = text_image_cosine(self.backbone, images, prompts)
        return {self.key: self.backbone.logit_scale() * cos}


@register("clip_score")
def build_clip_score(
    *,
    model: str = CLIP_L14,
    processor: str | None = None,
    variant: str = "cosine",
    prompt_prefix: str = "",
    tiny: bool = False,
    device: str = "auto",
    dtype: str = "float32",
    preprocess: str = "tensor",
    batch_size: int = 32,
    local_files_only: bool = False,
    key: str | None = None,
) -> ClipScore:
    """CLIP text-image cosine (variants: cosine, hessel, torchmetrics)."""
    backbone = load_clip(
        model,
        processor=processor,
        tiny=tiny,
        local_files_only=local_files_only,
        device=device,
        dtype=dtype,
        preprocess=preprocess,
    )
    return ClipScore(backbone, variant=variant, prompt_prefix=prompt_prefix, batch_size=batch_size, key=key)


@register("pickscore")
def build_pickscore(
    *,
    model: str = PICKSCORE_V1,
    processor: str | None = CLIP_H14_LAION,
    tiny: bool = False,
    device: str = "auto",
    dtype: str = "float32",
    preprocess: str = "tensor",
    batch_size: int = 32,
    local_files_only: bool = False,
    key: str | None = None,
) -> PickScore:
    """PickScore v1: exp(logit_scale) * cos on CLIP-H/14."""
    backbone = load_clip(
        model,
        processor=processor,
        tiny=tiny,
        local_files_only=local_files_only,
        device=device,
        dtype=dtype,
        preprocess=preprocess,
    )
    return PickScore(backbone, batch_size=batch_size, key=key)
