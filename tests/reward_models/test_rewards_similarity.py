"""image_similarity with tiny CLIP and DINOv2: identity, max over references, NaN, batching, grads."""

import pytest
import torch

from reward_models import build_scorer
from reward_models.images import ImageBatch
from reward_models.preprocess import IMAGENET_MEAN, IMAGENET_STD

from rewards_helpers import quantised_images


@pytest.fixture(scope="module", params=["clip", "dinov2"])
def scorer(request):
    return build_scorer("image_similarity", backbone=request.param, tiny=True, device="cpu")


def test_self_reference_scores_one_and_missing_is_nan(scorer, images):
    refs = [images[0], None, [], images[3], ImageBatch(images[4:5]).pil()[0]]
    out = scorer(images, metadata={"reference_images": refs})["image_similarity"]
    assert out[[0, 3, 4]].tolist() == pytest.approx([1.0, 1.0, 1.0], abs=1e-5)
    assert torch.isnan(out[1]) and torch.isnan(out[2])


def test_max_over_references(scorer, images):
    others = quantised_images(2, 24, 24, seed=1)  # another size than the generated images
    single = [scorer(images[:1], metadata={"reference_images": [others[i]]})["image_similarity"] for i in range(2)]
    both = scorer(images[:1], metadata={"reference_images": [others]})["image_similarity"]
    assert both.item() == pytest.approx(max(s.item() for s in single), abs=1e-5)
    mixed = scorer(images[:1], metadata={"reference_images": [[others[0], ImageBatch(others[1:]).pil()[0]]]})
    assert mixed["image_similarity"].item() == pytest.approx(both.item(), abs=1e-5)


def test_batching_equals_unbatched(scorer, images):
    refs = {"reference_images": list(images.flip(0))}
    whole = scorer(images, metadata=refs)["image_similarity"]
    old = scorer.batch_size
    scorer.batch_size = 2
    try:
        chunked = scorer(images, metadata=refs)["image_similarity"]
    finally:
        scorer.batch_size = old
    assert torch.allclose(whole, chunked, atol=1e-5)


def test_metadata_is_required(scorer, images):
    with pytest.raises(ValueError, match="reference_images"):
        scorer(images)


def test_gradient_reaches_pixels_not_references(scorer):
    x = quantised_images(2, 32, 32).requires_grad_(True)
    ref = quantised_images(2, 32, 32, seed=3).requires_grad_(True)
    scorer(x, metadata={"reference_images": list(ref)})["image_similarity"].sum().backward()
    assert x.grad.abs().sum() > 0 and ref.grad is None


def test_dinov2_preprocessing_and_dtype(images):
    s = build_scorer("image_similarity", backbone="dinov2", tiny=True, device="cpu", image_size=24)
    assert s.backbone.spec.mean == IMAGENET_MEAN and s.backbone.spec.std == IMAGENET_STD
    assert s.backbone.spec.size == (24, 24) and s.backbone.spec.crop is None
    bf16 = build_scorer("image_similarity", backbone="dinov2", tiny=True, device="cpu", dtype="bfloat16")
    out = bf16(images, metadata={"reference_images": list(images.flip(0))})["image_similarity"]
    fp32 = build_scorer("image_similarity", backbone="dinov2", tiny=True, device="cpu")(
        images, metadata={"reference_images": list(images.flip(0))}
    )["image_similarity"]
    assert out.dtype == torch.float32 and torch.allclose(out, fp32, atol=0.05)


def test_setting_errors():
    with pytest.raises(ValueError, match="backbone must be"):
        build_scorer("image_similarity", backbone="siglip", tiny=True)
    with pytest.raises(ValueError, match="only the tensor"):
        build_scorer("image_similarity", backbone="dinov2", tiny=True, preprocess="pil")
    with pytest.raises(ValueError, match="image_size applies"):
        build_scorer("image_similarity", backbone="clip", tiny=True, image_size=64)
