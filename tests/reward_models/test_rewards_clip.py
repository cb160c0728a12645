"""clip_score and pickscore on a tiny random CLIP: formulas, batching, dtype, NaN, gradients, loading."""

import pytest
import torch

from reward_models import build_scorer
from reward_models.clip_scores import ClipScore, PickScore
from reward_models.encoders import ClipBackbone
from reward_models.images import ImageBatch
from reward_models.pairwise import PointwiseAsPairwise

from rewards_helpers import PROMPTS, quantised_images


def reference_logits(backbone, images, prompts):
    """diag of CLIPModel's own logits_per_image = exp(logit_scale) * cos, on the same pixels."""
    pixels = backbone.pixel_values(ImageBatch(images))
    tokens = backbone.tokenizer(prompts, padding=True, truncation=True, return_tensors="pt")
    with torch.no_grad():
        out = backbone.model(
            input_ids=tokens["input_ids"], attention_mask=tokens["attention_mask"], pixel_values=pixels
        )
    return out.logits_per_image.diag(), backbone.model.logit_scale.exp().item()


def test_pickscore_is_logit_scale_times_cosine(tiny_clip, images):
    scores = PickScore(tiny_clip)(images, PROMPTS)
    assert set(scores) == {"pickscore"} and scores["pickscore"].dtype == torch.float32
    expected, _ = reference_logits(tiny_clip, images, PROMPTS)
    assert torch.allclose(scores["pickscore"], expected, atol=1e-5)


@pytest.mark.parametrize("variant", ["cosine", "hessel", "torchmetrics"])
def test_clip_score_variants(tiny_clip, images, variant):
    logits, scale = reference_logits(tiny_clip, images, PROMPTS)
    cos = logits / scale
    expected = {"cosine": cos, "hessel": 2.5 * cos.clamp_min(0), "torchmetrics": (100 * cos).clamp_min(0)}[variant]
    got = ClipScore(tiny_clip, variant=variant)(images, PROMPTS)["clip_score"]
    assert torch.allclose(got, expected, atol=1e-5)


def test_clip_score_prefix_and_bad_variant(tiny_clip, images):
    plain = ClipScore(tiny_clip)(images, ["A photo depicts " + p for p in PROMPTS])["clip_score"]
    prefixed = ClipScore(tiny_clip, prompt_prefix="A photo depicts ")(images, PROMPTS)["clip_score"]
    assert torch.allclose(plain, prefixed)
    with pytest.raises(ValueError, match="variant"):
        ClipScore(tiny_clip, variant="x100")


@pytest.mark.parametrize("cls", [ClipScore, PickScore])
def test_batching_equals_unbatched(tiny_clip, images, cls):
    one = cls(tiny_clip, batch_size=1)(images, PROMPTS)[cls.name]
    all_at_once = cls(tiny_clip, batch_size=64)(images, PROMPTS)[cls.name]
    assert torch.allclose(one, all_at_once, atol=1e-5)


def test_bfloat16_backbone_gives_float32_close_scores(images):
    fp32 = build_scorer("pickscore", tiny=True, device="cpu")(images, PROMPTS)["pickscore"]
    bf16_scorer = build_scorer("pickscore", tiny=True, device="cpu", dtype="bfloat16")
    assert bf16_scorer.backbone.model.dtype == torch.bfloat16
    bf16 = bf16_scorer(images, PROMPTS)["pickscore"]
    assert bf16.dtype == torch.float32
    scale = bf16_scorer.backbone.logit_scale().item()
    assert scale == pytest.approx(torch.tensor(2.6592).exp().item(), rel=1e-6)  # kept in float32
    assert torch.allclose(bf16, fp32, atol=0.05 * scale)  # cosine within 0.05


def test_nan_image_gives_nan_row_only(tiny_clip, images):
    clean = PickScore(tiny_clip)(images, PROMPTS)["pickscore"]
    x = images.clone()
    x[4] = float("nan")
    out = PickScore(tiny_clip, batch_size=2)(x, PROMPTS)["pickscore"]
    assert torch.isnan(out[4]) and torch.allclose(out[:4], clean[:4], atol=1e-5)


def test_prompts_are_required(tiny_clip, images):
    with pytest.raises(ValueError, match="needs one prompt per image"):
        PickScore(tiny_clip)(images)


@pytest.mark.parametrize("cls", [ClipScore, PickScore])
def test_gradient_reaches_pixels(tiny_clip, cls):
    x = quantised_images(2, 48, 64).requires_grad_(True)  # non-square: resize + crop on the path
    cls(tiny_clip)(x, ["a cat", "a dog"])[cls.name].sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all() and x.grad.abs().sum() > 0
    assert not any(p.requires_grad for p in tiny_clip.model.parameters())  # the reward stays frozen


def test_no_graph_without_grad(tiny_clip, images):
    assert not PickScore(tiny_clip)(images, PROMPTS)["pickscore"].requires_grad


def test_pil_reference_path_is_close_to_tensor_path(tiny_clip, images):
    pil_backbone = ClipBackbone(
        tiny_clip.model, tiny_clip.tokenizer, tiny_clip.processor, device="cpu", preprocess="pil"
    )
    via_tensor = ClipScore(tiny_clip)(images, PROMPTS)["clip_score"]
    via_pil = ClipScore(pil_backbone)(ImageBatch(images).pil(), PROMPTS)["clip_score"]
    assert torch.allclose(via_tensor, via_pil, atol=0.02)


def test_from_pretrained_local_directory(tmp_path, images):
    # The real loading path, offline: save the tiny model as a checkpoint directory, load it back.
    tiny = PickScore.tiny()
    assert isinstance(tiny, PickScore) and tiny.backbone.device.type == "cpu"
    tiny.backbone.save_pretrained(tmp_path)
    loaded = PickScore.from_pretrained(str(tmp_path), processor=str(tmp_path), local_files_only=True, device="cpu")
    assert loaded.backbone.spec == tiny.backbone.spec
    assert torch.allclose(loaded(images, PROMPTS)["pickscore"], tiny(images, PROMPTS)["pickscore"], atol=1e-5)
    same = build_scorer({"name": "clip_score", "model": str(tmp_path), "local_files_only": True, "device": "cpu"})
    assert torch.allclose(
        same(images, PROMPTS)["clip_score"] * tiny.backbone.logit_scale(), tiny(images, PROMPTS)["pickscore"], atol=1e-4
    )


def test_missing_local_checkpoint_fails_fast(tmp_path):
    with pytest.raises(OSError):
        ClipScore.from_pretrained(str(tmp_path / "absent"), local_files_only=True, device="cpu")


def test_pickscore_pairwise_is_the_models_softmax(tiny_clip, images):
    a, b = images, images.flip(0)
    scorer = PickScore(tiny_clip)
    s_a, s_b = scorer(a, PROMPTS)["pickscore"], scorer(b, PROMPTS)["pickscore"]
    p = PointwiseAsPairwise(scorer)(a, b, PROMPTS)
    softmax = torch.softmax(torch.stack([s_a, s_b], 1), 1)[:, 0]
    assert torch.allclose(p, softmax, atol=1e-6)
