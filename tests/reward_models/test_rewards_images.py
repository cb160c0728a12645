"""ImageBatch: accepted inputs, the uint8 rounding rule, NaN masks."""

import numpy as np
import pytest
import torch
from PIL import Image

from reward_models.images import ImageBatch, as_image_list, pil_to_tensor


def test_uint8_rule_is_round_then_clamp():
    values = torch.tensor([-0.1, 0.0019, 0.0021, 0.5, 1.2])  # x*255: -25.5, 0.48, 0.54, 127.5, 306
    x = values.view(1, 1, 1, 5).expand(1, 3, 1, 5).contiguous()
    pixels = np.asarray(ImageBatch(x).pil()[0])[0, :, 0]
    assert pixels.tolist() == [0, 0, 1, 128, 255]  # 127.5 rounds half to even, as torch and numpy do


def test_pil_and_tensor_round_trip(images):
    batch = ImageBatch(images)
    again = ImageBatch(batch.pil())
    assert torch.equal(again.tensor(), images)
    assert len(again) == 5 and again.uniform


def test_pil_modes_become_rgb():
    grey = Image.new("L", (4, 3), 200)
    rgba = Image.new("RGBA", (4, 3), (10, 20, 30, 0))
    t = ImageBatch([grey, rgba]).tensor()
    assert t.shape == (2, 3, 3, 4)
    assert torch.allclose(t[0], torch.full((3, 3, 4), 200 / 255))
    assert torch.allclose(t[1, :, 0, 0], torch.tensor([10, 20, 30]) / 255)


def test_mixed_sizes_are_a_list():
    batch = ImageBatch([Image.new("RGB", (4, 4)), Image.new("RGB", (6, 2))])
    assert not batch.uniform
    with pytest.raises(ValueError, match="differ in size"):
        batch.tensor()
    assert [tuple(t.shape) for t in batch.tensors()] == [(3, 4, 4), (3, 2, 6)]


def test_bad_inputs_are_rejected():
    with pytest.raises(ValueError, match=r"\[B,3,H,W\]"):
        ImageBatch(torch.rand(3, 8, 8))
    with pytest.raises(TypeError, match="float"):
        ImageBatch(torch.zeros(1, 3, 8, 8, dtype=torch.int32))
    with pytest.raises(TypeError):
        ImageBatch("image.png")
    u8 = torch.full((1, 3, 2, 2), 255, dtype=torch.uint8)
    assert torch.equal(ImageBatch(u8).tensor(), torch.ones(1, 3, 2, 2))


def test_non_finite_images_are_masked_and_sanitised(images):
    x = images.clone()
    x[1, 0, 3, 3] = float("nan")
    x[3, 2, 0, 0] = float("inf")
    batch = ImageBatch(x)
    assert batch.finite().tolist() == [True, False, True, False, True]
    clean = batch.sanitized().tensor()
    assert torch.isfinite(clean).all() and torch.equal(clean[0], x[0])


def test_slices_share_conversions(images):
    batch = ImageBatch(images)
    first = batch[0:2].pil()  # a micro-batch converts the whole batch once
    pil = batch.pil()
    assert first[0] is pil[0] and batch[1:3].pil() == pil[1:3]
    assert pil_to_tensor(pil[2]).equal(images[2])


def test_reference_lists_flatten():
    t = torch.rand(2, 3, 4, 4)
    assert len(as_image_list([t, t[0], Image.new("RGB", (2, 2))])) == 4
    assert as_image_list(None) == []
