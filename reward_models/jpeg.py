"""DDPO's JPEG rewards: the size of the image saved as JPEG at quality 95, in kB (1 kB = 1000 B).

jpeg_compressibility = -kB (smaller files are better), jpeg_incompressibility = +kB. Flow-GRPO
divides by 500; use the MultiReward weight for that. Sizes depend on the Pillow/libjpeg build, so
pin Pillow for exact numbers. Not differentiable.
"""

from __future__ import annotations

import io

import torch
from PIL import Image

from .base import Scorer
from .registry import register

JPEG_QUALITY = 95  # DDPO


def jpeg_kb(image: Image.Image, quality: int = JPEG_QUALITY) -> float:
    buf = io.BytesIO()
    image.save(buf, format="JPEG", quality=quality)
    return buf.tell() / 1000.0


class JpegScorer(Scorer):
    """sign * JPEG size in kB at the given quality."""

    def __init__(
        self, name: str, sign: float, *, quality: int = JPEG_QUALITY, batch_size: int = 64, key: str | None = None
    ):
        if not 1 <= int(quality) <= 100:
            raise ValueError(f"JPEG quality must be in 1..100, got {quality}")
        self.name, self.sign, self.quality = name, float(sign), int(quality)
        super().__init__(batch_size=batch_size, key=key)

    def score_batch(self, images, prompts, metadata):
        # The uint8 round trip (ImageBatch.pil) is the DDPO hand-off; it is cached per batch.
        sizes = [jpeg_kb(im, self.quality) for im in images.pil()]
        return {self.key: self.sign * torch.tensor(sizes, dtype=torch.float32)}


@register("jpeg_compressibility")
def build_jpeg_compressibility(
    *, quality: int = JPEG_QUALITY, batch_size: int = 64, key: str | None = None
) -> JpegScorer:
    """Minus the JPEG size in kB at quality 95 (DDPO)."""
    return JpegScorer("jpeg_compressibility", -1.0, quality=quality, batch_size=batch_size, key=key)


@register("jpeg_incompressibility")
def build_jpeg_incompressibility(
    *, quality: int = JPEG_QUALITY, batch_size: int = 64, key: str | None = None
) -> JpegScorer:
    """Plus the JPEG size in kB at quality 95 (DDPO)."""
    return JpegScorer("jpeg_incompressibility", 1.0, quality=quality, batch_size=batch_size, key=key)
