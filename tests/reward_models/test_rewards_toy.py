"""brightness and colorfulness against hand-computed values; the shared Scorer contract."""

import math

import pytest
import torch
from PIL import Image

from reward_models import build_scorer
from reward_models.images import ImageBatch


def solid(rgb, h=4, w=6):
    return torch.tensor(rgb, dtype=torch.float32).view(1, 3, 1, 1).expand(1, 3, h, w).contiguous()


def test_brightness_is_rec601_luma():
    scorer = build_scorer("brightness")
    x = torch.cat([solid((1, 0, 0)), solid((0, 1, 0)), solid((0, 0, 1)), solid((1, 1, 1)), solid((0.5, 0.5, 0.5))])
    out = scorer(x)["brightness"]
    assert out.dtype == torch.float32 and out.shape == (5,)
    assert torch.allclose(out, torch.tensor([0.299, 0.587, 0.114, 1.0, 0.5]), atol=1e-6)
    # two-pixel image: the mean of the two lumas
    two = torch.tensor([[[[1.0, 0.0]], [[0.0, 0.0]], [[0.0, 1.0]]]])
    assert scorer(two)["brightness"].item() == pytest.approx((0.299 + 0.114) / 2, abs=1e-6)


def test_colorfulness_matches_hasler_suesstrunk_by_hand():
    # pixels (255,0,0) and (0,0,255): rg = [255, 0], yb = [127.5, -255]
    x = torch.tensor([[[[1.0, 0.0]], [[0.0, 0.0]], [[0.0, 1.0]]]])
    rg, yb = [255.0, 0.0], [127.5, -255.0]
    mean = lambda v: sum(v) / len(v)  # noqa: E731
    sd = lambda v: math.sqrt(sum((a - mean(v)) ** 2 for a in v) / len(v))  # noqa: E731
    expected = math.sqrt(sd(rg) ** 2 + sd(yb) ** 2) + 0.3 * math.sqrt(mean(rg) ** 2 + mean(yb) ** 2)
    got = build_scorer("colorfulness")(x)["colorfulness"].item()
    assert got == pytest.approx(expected, rel=1e-5)
    grey = build_scorer("colorfulness")(solid((0.3, 0.3, 0.3)))["colorfulness"].item()
    assert grey == pytest.approx(0.0, abs=1e-4)


@pytest.mark.parametrize("name", ["brightness", "colorfulness"])
def test_batching_pil_and_tensor_agree(name, images):
    whole = build_scorer(name, batch_size=100)(images)[name]
    chunked = build_scorer(name, batch_size=2)(images)[name]
    from_pil = build_scorer(name)(ImageBatch(images).pil())[name]
    assert torch.allclose(whole, chunked, atol=1e-6)
    assert torch.allclose(whole, from_pil, atol=1e-4)


def test_mixed_size_pil_list():
    ims = [Image.new("RGB", (4, 4), (255, 255, 255)), Image.new("RGB", (8, 2), (0, 0, 0))]
    assert build_scorer("brightness")(ims)["brightness"].tolist() == pytest.approx([1.0, 0.0], abs=1e-6)


def test_nan_pixels_give_nan_rows_and_are_counted(images):
    scorer = build_scorer("brightness")
    clean = scorer(images)["brightness"]
    x = images.clone()
    x[2, 1, 5, 5] = float("nan")
    out = scorer(x)["brightness"]
    assert torch.isnan(out[2]) and not torch.isnan(out[[0, 1, 3, 4]]).any()
    assert torch.equal(out[[0, 1, 3, 4]], clean[[0, 1, 3, 4]])
    assert scorer.counters["nan"] == 1 and scorer.counters["images"] == 10


@pytest.mark.parametrize("name", ["brightness", "colorfulness"])
def test_gradient_reaches_pixels(name, images):
    x = images.clone().requires_grad_(True)
    build_scorer(name)(x)[name].sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all() and x.grad.abs().sum() > 0
    if name == "brightness":  # d mean(luma) / d pixel = weight / (H*W)
        hw = x.shape[2] * x.shape[3]
        assert torch.allclose(x.grad[0, :, 0, 0], torch.tensor([0.299, 0.587, 0.114]) / hw)


def test_grey_image_gradient_is_finite():
    x = solid((0.5, 0.5, 0.5)).requires_grad_(True)
    build_scorer("colorfulness")(x)["colorfulness"].sum().backward()
    assert torch.isfinite(x.grad).all()


def test_input_checks(images):
    scorer = build_scorer("brightness")
    with pytest.raises(ValueError, match="5 images but 2 prompts"):
        scorer(images, ["a", "b"])
    with pytest.raises(TypeError, match="not one string"):
        scorer(images, "a prompt")
    with pytest.raises(ValueError, match="3 entries for 5 images"):
        scorer(images, metadata={"x": [1, 2, 3]})
    assert scorer(images[:0])["brightness"].shape == (0,)
