"""Toy rewards for demos and tests: cheap, exact, differentiable, no weights.

brightness:   mean Rec.601 luma, Y = 0.299 R + 0.587 G + 0.114 B, of pixels in [0,1] -> [0,1].
colorfulness: Hasler & Suesstrunk (2003) M = sqrt(sd_rg^2 + sd_yb^2) + 0.3 sqrt(mu_rg^2 + mu_yb^2),
              rg = R - G, yb = (R + G)/2 - B, population statistics over the pixels, on the
              paper's 0-255 scale so its thresholds apply (15 slightly, 33 moderately, 45
              averagely, 59 quite, 82 highly, 109 extremely colourful). Signed rg/yb as in the
              paper; some popular implementations take |R - G|, which gives other numbers.
"""

from __future__ import annotations

import torch

from .base import Scorer
from .registry import register

REC601 = (0.299, 0.587, 0.114)


def _per_image(images, fn) -> torch.Tensor:
    # One batched op when sizes agree; PIL lists of mixed sizes go image by image.
    if images.uniform:
        return fn(images.tensor().clamp(0, 1))
    return torch.cat([fn(t.clamp(0, 1)[None]) for t in images.tensors()])


def luma(x: torch.Tensor) -> torch.Tensor:
    """[B,3,H,W] -> [B,H,W] Rec.601 luma."""
    w = torch.tensor(REC601, dtype=x.dtype, device=x.device)
    return torch.einsum("bchw,c->bhw", x, w)


def brightness(x: torch.Tensor) -> torch.Tensor:
    return luma(x).flatten(1).mean(1)


def colorfulness(x: torch.Tensor) -> torch.Tensor:
    x = x * 255.0
    r, g, b = x[:, 0].flatten(1), x[:, 1].flatten(1), x[:, 2].flatten(1)
    rg, yb = r - g, 0.5 * (r + g) - b
    var = rg.var(1, unbiased=False) + yb.var(1, unbiased=False)
    mean_sq = rg.mean(1) ** 2 + yb.mean(1) ** 2
    # clamp_min: sqrt has an infinite slope at 0 (a grey image); the clamp keeps gradients finite.
    return var.clamp_min(1e-12).sqrt() + 0.3 * mean_sq.clamp_min(1e-12).sqrt()


class BrightnessScorer(Scorer):
    """Mean Rec.601 luma in [0,1]."""

    name = "brightness"
    differentiable = True

    def score_batch(self, images, prompts, metadata):
        return {self.key: _per_image(images, brightness)}


class ColorfulnessScorer(Scorer):
    """Hasler-Suesstrunk colourfulness on the 0-255 scale."""

    name = "colorfulness"
    differentiable = True

    def score_batch(self, images, prompts, metadata):
        return {self.key: _per_image(images, colorfulness)}


@register("brightness")
def build_brightness(*, batch_size: int = 256, key: str | None = None) -> BrightnessScorer:
    """Mean Rec.601 luma of pixels in [0,1] (toy reward)."""
    return BrightnessScorer(batch_size=batch_size, key=key)


@register("colorfulness")
def build_colorfulness(*, batch_size: int = 256, key: str | None = None) -> ColorfulnessScorer:
    """Hasler-Suesstrunk colourfulness, 0-255 scale (toy reward)."""
    return ColorfulnessScorer(batch_size=batch_size, key=key)
