"""DDPO JPEG rewards: value by hand, ordering, sign, settings."""

import io

import numpy as np
import pytest
import torch
from PIL import Image

from reward_models import build_scorer


def test_size_in_kb_at_quality_95_by_hand(images):
    out = build_scorer("jpeg_incompressibility")(images)["jpeg_incompressibility"]
    for i in range(len(images)):
        u8 = (images[i] * 255).round().clamp(0, 255).byte().permute(1, 2, 0).numpy()
        buf = io.BytesIO()
        Image.fromarray(np.ascontiguousarray(u8)).save(buf, format="JPEG", quality=95)
        assert out[i].item() == pytest.approx(len(buf.getvalue()) / 1000, abs=1e-6)


def test_flat_image_is_more_compressible_than_noise():
    flat = torch.full((1, 3, 64, 64), 0.4)
    noise = torch.rand(1, 3, 64, 64)
    x = torch.cat([flat, noise])
    comp = build_scorer("jpeg_compressibility")(x)["jpeg_compressibility"]
    incomp = build_scorer("jpeg_incompressibility")(x)["jpeg_incompressibility"]
    assert comp[0] > comp[1] and incomp[1] > incomp[0]
    assert torch.equal(comp, -incomp)
    assert (incomp > 0).all()


def test_quality_setting():
    noise = torch.rand(1, 3, 64, 64)
    low = build_scorer("jpeg_incompressibility", quality=50)(noise)["jpeg_incompressibility"]
    high = build_scorer("jpeg_incompressibility")(noise)["jpeg_incompressibility"]
    assert low < high
    with pytest.raises(ValueError, match="quality"):
        build_scorer("jpeg_compressibility", quality=0)


def test_nan_image_is_nan_not_a_size(images):
    x = images.clone()
    x[0, 0, 0, 0] = float("nan")
    out = build_scorer("jpeg_compressibility", batch_size=2)(x)["jpeg_compressibility"]
    assert torch.isnan(out[0]) and torch.isfinite(out[1:]).all()
