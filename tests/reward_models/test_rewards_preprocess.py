"""Preprocessing: published constants, sizes, tensor/PIL parity, differentiability."""

import pytest
import torch
import torch.nn.functional as F

from reward_models import preprocess as pp
from reward_models.preprocess import clip_image_processor_class
from reward_models.images import ImageBatch


def test_constants_are_the_published_values():
    # The published preprocessing constants (OpenAI CLIP; ImageNet for DINOv2).
    assert pp.OPENAI_CLIP_MEAN == (0.48145466, 0.4578275, 0.40821073)
    assert pp.OPENAI_CLIP_STD == (0.26862954, 0.26130258, 0.27577711)
    assert pp.IMAGENET_MEAN == (0.485, 0.456, 0.406)
    assert pp.IMAGENET_STD == (0.229, 0.224, 0.225)
    assert pp.CLIP_SPEC.shortest_edge == 224 and pp.CLIP_SPEC.crop == (224, 224)
    assert pp.DINOV2_SPEC.size == (518, 518) and pp.DINOV2_SPEC.crop is None


def test_default_clip_processor_matches_the_spec():
    # transformers' CLIP processor defaults (bicubic, 224 shortest edge, 224 crop, OpenAI stats)
    assert pp.spec_from_processor(clip_image_processor_class()()) == pp.CLIP_SPEC


def test_resize_and_crop_sizes_follow_transformers():
    assert pp.resized_size(480, 640, pp.CLIP_SPEC) == (224, 298)  # int(224 * 640 / 480)
    assert pp.resized_size(640, 480, pp.CLIP_SPEC) == (298, 224)
    assert pp.resized_size(100, 300, pp.DINOV2_SPEC) == (518, 518)
    x = torch.arange(5 * 6).float().view(1, 1, 5, 6)
    assert pp.center_crop(x, (2, 3))[0, 0].tolist() == [[7, 8, 9], [13, 14, 15]]  # top 1, left 1 (floored)
    with pytest.raises(ValueError, match="larger"):
        pp.center_crop(x, (6, 6))
    out = pp.preprocess_tensor(torch.rand(2, 3, 480, 640), pp.CLIP_SPEC)
    assert out.shape == (2, 3, 224, 224)


def test_tensor_path_matches_the_pil_processor():
    # A smooth 480x640 image: the difference is uint8 rounding, about one grey level.
    torch.manual_seed(0)
    x = F.interpolate(torch.rand(2, 3, 12, 16), size=(480, 640), mode="bilinear").clamp(0, 1)
    x = (x * 255).round() / 255
    ours = pp.preprocess_tensor(x, pp.CLIP_SPEC)
    reference = clip_image_processor_class()()(images=ImageBatch(x).pil(), return_tensors="pt")["pixel_values"]
    assert ours.shape == reference.shape
    diff = (ours - reference).abs()
    one_level = 1 / 255 / min(pp.OPENAI_CLIP_STD)
    assert diff.mean() < 0.5 * one_level and diff.max() < 1.5 * one_level


def test_tensor_path_is_differentiable():
    x = torch.rand(1, 3, 48, 64, requires_grad=True)
    pp.preprocess_tensor(x, pp.CLIP_SPEC).square().sum().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0


def test_pil_mode_refuses_gradients(tiny_clip):
    from reward_models.encoders import ClipBackbone

    backbone = ClipBackbone(tiny_clip.model, tiny_clip.tokenizer, tiny_clip.processor, device="cpu", preprocess="pil")
    with pytest.raises(ValueError, match="not differentiable"):
        backbone.pixel_values(ImageBatch(torch.rand(1, 3, 32, 32, requires_grad=True)))
    with pytest.raises(ValueError, match="preprocess must be"):
        ClipBackbone(tiny_clip.model, tiny_clip.tokenizer, tiny_clip.processor, preprocess="torchvision")
