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

from .encoders import CLIP_L14  # noqa: F401  (the default CLIP; importable from here as before)
from .encoders import BackboneSettings, ClipBackbone, EmbeddingScorer
from .registry import register, with_settings

PICKSCORE_V1 = "yuvalkirstain/PickScore_v1"
CLIP_H14_LAION = "laion/CLIP-ViT-H-14-laion2B-s32B-b79K"

CLIPSCORE_VARIANTS = {
    "cosine": lambda cos: cos,
    "hessel": lambda cos: 2.5 * cos.clamp_min(0),
    "torchmetrics": lambda cos: (100 * cos).clamp_min(0),
}


class ClipScore(EmbeddingScorer):
    """CLIP text-image cosine with a named published scaling."""

    name = "clip_score"
    requires_prompts = True

    def __init__(self, backbone: ClipBackbone, *, variant: str = "cosine", prompt_prefix: str = "", **kwargs):
        if variant not in CLIPSCORE_VARIANTS:
            raise ValueError(f"clip_score variant must be one of {sorted(CLIPSCORE_VARIANTS)}, got {variant!r}")
        super().__init__(backbone, **kwargs)
        self.variant, self.prompt_prefix = variant, prompt_prefix

    def score_batch(self, images, prompts, metadata):
        cos = self.text_image_cosine(images, [self.prompt_prefix + p for p in prompts])
        return {self.key: CLIPSCORE_VARIANTS[self.variant](cos)}


class PickScore(EmbeddingScorer):
    """exp(logit_scale) * cos(image, text) on PickScore_v1."""

    name = "pickscore"
    requires_prompts = True

    def score_batch(self, images, prompts, metadata):
        cos = self.text_image_cosine(images, prompts)
        return {self.key: self.backbone.logit_scale() * cos}


@register("clip_score")
@with_settings(BackboneSettings)
def build_clip_score(
    *, variant: str = "cosine", prompt_prefix: str = "", batch_size: int = 32, key: str | None = None, **backbone
) -> ClipScore:
    """CLIP text-image cosine (variants: cosine, hessel, torchmetrics)."""
    clip = BackboneSettings(**backbone).load_clip()
    return ClipScore(clip, variant=variant, prompt_prefix=prompt_prefix, batch_size=batch_size, key=key)


@register("pickscore")
@with_settings(BackboneSettings, model=PICKSCORE_V1, processor=CLIP_H14_LAION)
def build_pickscore(*, batch_size: int = 32, key: str | None = None, **backbone) -> PickScore:
    """PickScore v1: exp(logit_scale) * cos on CLIP-H/14."""
    return PickScore(BackboneSettings(**backbone).load_clip(), batch_size=batch_size, key=key)
