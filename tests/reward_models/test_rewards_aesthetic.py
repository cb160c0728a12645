"""LAION aesthetic predictor: the published head, safetensors loading, the score formula."""

import pytest
import torch
import torch.nn.functional as F

from reward_models import build_scorer
from reward_models.aesthetic import AestheticHead, AestheticScorer, convert_aesthetic_pth
from reward_models.images import ImageBatch

from rewards_helpers import quantised_images


def test_head_layout_is_the_published_one():
    head = AestheticHead()  # CLIP-L/14: 768-d
    assert sum(p.numel() for p in head.parameters()) == 927_969
    shapes = {k: tuple(v.shape) for k, v in head.state_dict().items()}
    assert shapes == {
        "layers.0.weight": (1024, 768),
        "layers.0.bias": (1024,),
        "layers.2.weight": (128, 1024),
        "layers.2.bias": (128,),
        "layers.4.weight": (64, 128),
        "layers.4.bias": (64,),
        "layers.6.weight": (16, 64),
        "layers.6.bias": (16,),
        "layers.7.weight": (1, 16),
        "layers.7.bias": (1,),
    }
    dropouts = [m.p for m in head.layers if isinstance(m, torch.nn.Dropout)]
    assert dropouts == [0.2, 0.2, 0.1]
    assert not any(isinstance(m, (torch.nn.ReLU, torch.nn.GELU)) for m in head.layers)  # no activations


def test_safetensors_round_trip_is_strict(tmp_path):
    from safetensors.torch import save_file

    head = AestheticHead(input_dim=16)
    head.save(tmp_path / "head.safetensors")
    loaded = AestheticHead.from_file(tmp_path / "head.safetensors")
    x = torch.randn(3, 16)
    assert torch.equal(head.eval()(x), loaded(x))
    state = dict(head.state_dict(), extra=torch.zeros(1))
    save_file(state, str(tmp_path / "bad.safetensors"))
    with pytest.raises(RuntimeError, match="extra"):
        AestheticHead.from_file(tmp_path / "bad.safetensors")
    save_file({"w": torch.zeros(1)}, str(tmp_path / "other.safetensors"))
    with pytest.raises(ValueError, match="not an aesthetic head"):
        AestheticHead.from_file(tmp_path / "other.safetensors")


def test_convert_released_pth(tmp_path):
    head = AestheticHead(input_dim=16)
    torch.save(head.state_dict(), tmp_path / "head.pth")  # the released format (tensors only)
    convert_aesthetic_pth(tmp_path / "head.pth", tmp_path / "head.safetensors")
    loaded = AestheticHead.from_file(tmp_path / "head.safetensors")
    assert all(torch.equal(a, b) for a, b in zip(head.state_dict().values(), loaded.state_dict().values()))


def test_score_is_head_of_normalised_clip_embedding(tiny_clip, images, tmp_path):
    head = AestheticHead(input_dim=tiny_clip.embed_dim)
    head.save(tmp_path / "head.safetensors")
    scorer = build_scorer("aesthetic", tiny=True, head=str(tmp_path / "head.safetensors"), device="cpu")
    with torch.no_grad():
        feats = tiny_clip.model.get_image_features(pixel_values=tiny_clip.pixel_values(ImageBatch(images)))
        feats = feats if isinstance(feats, torch.Tensor) else feats.pooler_output
        expected = head.eval()(F.normalize(feats, dim=-1)).squeeze(-1)
    out = scorer(images)
    assert set(out) == {"aesthetic"} and torch.allclose(out["aesthetic"], expected, atol=1e-5)
    chunked = build_scorer("aesthetic", tiny=True, head=str(tmp_path / "head.safetensors"), device="cpu", batch_size=2)(
        images
    )["aesthetic"]
    assert torch.allclose(chunked, expected, atol=1e-5)


def test_bfloat16_backbone_keeps_a_float32_head(images):
    fp32 = build_scorer("aesthetic", tiny=True, device="cpu")(images)["aesthetic"]
    scorer = build_scorer("aesthetic", tiny=True, device="cpu", dtype="bf16")
    assert scorer.head.layers[0].weight.dtype == torch.float32
    out = scorer(images)["aesthetic"]
    assert out.dtype == torch.float32 and torch.allclose(out, fp32, atol=0.02)


def test_errors_are_clear(tiny_clip):
    with pytest.raises(ValueError, match="needs head="):
        build_scorer("aesthetic")  # raised before any download is attempted
    with pytest.raises(ValueError, match="expects 768-d"):
        AestheticScorer(tiny_clip, AestheticHead())


def test_gradient_and_nan(images):
    scorer = build_scorer("aesthetic", tiny=True, device="cpu")
    x = quantised_images(2, 40, 40).requires_grad_(True)
    scorer(x)["aesthetic"].sum().backward()
    assert x.grad.abs().sum() > 0
    y = images.clone()
    y[0, 0, 0, 0] = float("inf")
    out = scorer(y)["aesthetic"]
    assert torch.isnan(out[0]) and torch.isfinite(out[1:]).all()
