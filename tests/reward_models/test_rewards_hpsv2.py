"""hpsv2 on a tiny open_clip: published constants, preprocessing, the cosine recipe, loading, dtype."""

import pytest
import torch

from reward_models import build_scorer, get_entry
from reward_models import hpsv2 as hps
from reward_models.images import ImageBatch

from rewards_helpers import PROMPTS, quantised_images


@pytest.fixture(scope="module")
def tiny_hps():
    return hps.HPSv2.tiny()


def test_constants_are_the_published_values():
    # the HPSv2 release: OpenAI CLIP stats, 224 px, longer side resized
    # (bicubic) then black padding, OpenCLIP ViT-H/14, files of the xswu/HPSv2 repo.
    assert hps.OPENAI_CLIP_MEAN == (0.48145466, 0.4578275, 0.40821073)
    assert hps.OPENAI_CLIP_STD == (0.26862954, 0.26130258, 0.27577711)
    assert (hps.HPS_IMAGE_SIZE, hps.HPS_INTERPOLATION, hps.HPS_RESIZE_MODE) == (224, "bicubic", "longest")
    assert hps.HPS_FILL == 0
    assert hps.HPS_FILES == {"v2.0": "HPS_v2_compressed.pt", "v2.1": "HPS_v2.1_compressed.pt"}
    assert get_entry("hpsv2").kind == "pointwise"
    settings = get_entry("hpsv2").settings
    assert (settings["model"], settings["version"], settings["arch"]) == ("xswu/HPSv2", "v2.1", "ViT-H-14")
    open_clip = hps.import_open_clip()
    cfg = open_clip.get_model_config(hps.HPS_ARCH)
    assert cfg["embed_dim"] == 1024 and cfg["vision_cfg"]["image_size"] == 224
    assert (cfg["vision_cfg"]["width"], cfg["vision_cfg"]["layers"], cfg["vision_cfg"]["patch_size"]) == (1280, 32, 14)
    assert cfg["text_cfg"]["context_length"] == 77
    tokens = hps.open_clip_tokenizer(hps.HPS_ARCH)(["a cat"])
    assert tokens.shape == (1, 77) and tokens[0, :4].tolist() == [49406, 320, 2368, 49407]  # real CLIP BPE


def test_reference_transform_is_resize_longest_bicubic_then_pad():
    from torchvision.transforms import InterpolationMode, Normalize

    steps = hps.hps_reference_transform().transforms
    resize, pad, norm = steps[0], steps[1], steps[-1]
    assert type(resize).__name__ == "ResizeKeepRatio" and resize.longest == 1.0
    assert resize.size == (224, 224) and resize.interpolation == InterpolationMode.BICUBIC
    assert type(pad).__name__ == "CenterCropOrPad" and pad.fill == 0 and tuple(pad.size) == (224, 224)
    assert isinstance(norm, Normalize)
    assert tuple(norm.mean) == hps.OPENAI_CLIP_MEAN and tuple(norm.std) == hps.OPENAI_CLIP_STD


def test_tensor_preprocessing_matches_the_reference_transform():
    assert hps.longest_side_size(100, 200, 224) == (112, 224)
    assert hps.longest_side_size(480, 320, 224) == (224, 149)  # round(320 / (480 / 224))
    torch.manual_seed(0)
    smooth = torch.nn.functional.interpolate(torch.rand(2, 3, 6, 10), size=(60, 100), mode="bilinear")
    x = (smooth.clamp(0, 1) * 255).round() / 255
    ours = hps.hps_preprocess_tensor(x)
    reference = torch.stack([hps.hps_reference_transform()(im) for im in ImageBatch(x).pil()])
    assert ours.shape == reference.shape == (2, 3, 224, 224)
    one_level = 1 / 255 / min(hps.OPENAI_CLIP_STD)
    diff = (ours - reference).abs()
    assert diff.mean() < 0.5 * one_level and diff.max() < 3 * one_level
    # 60x100 -> 134x224: 45 black rows above, 45 below, normalised like the reference's fill 0
    black = -torch.tensor(hps.OPENAI_CLIP_MEAN) / torch.tensor(hps.OPENAI_CLIP_STD)
    for rows in (slice(0, 45), slice(224 - 45, 224)):
        assert torch.allclose(ours[0, :, rows], black[:, None, None].expand(3, 45, 224), atol=1e-6)
        assert torch.allclose(reference[0, :, rows], ours[0, :, rows], atol=1e-6)
    assert not torch.allclose(ours[0, :, 45], black[:, None].expand(3, 224))


def test_score_is_the_cosine_of_the_models_normalised_features(tiny_hps, images):
    # The published recipe: model(image, text) -> normalised features; score = their dot product.
    backbone = tiny_hps.backbone
    pixels = torch.stack([hps.hps_reference_transform(backbone.image_size)(im) for im in ImageBatch(images).pil()])
    with torch.no_grad():
        out = backbone.model(pixels, backbone.tokenizer(PROMPTS))
    expected = (out["image_features"] @ out["text_features"].T).diag()
    pil = hps.HPSv2(hps.OpenClipBackbone(backbone.model, backbone.tokenizer, device="cpu", preprocess="pil"))
    got = pil(images, PROMPTS)["hpsv2"]
    assert set(pil(images, PROMPTS)) == {"hpsv2"} and got.dtype == torch.float32
    assert torch.allclose(got, expected, atol=1e-5)
    assert got.abs().max() <= 1 + 1e-6 and got.std() > 0  # a cosine, and it depends on the inputs
    via_tensor = tiny_hps(images, PROMPTS)["hpsv2"]
    assert torch.allclose(via_tensor, expected, atol=0.02)


def test_batching_equals_unbatched(tiny_hps, images):
    one = hps.HPSv2(tiny_hps.backbone, batch_size=1)(images, PROMPTS)["hpsv2"]
    many = hps.HPSv2(tiny_hps.backbone, batch_size=64)(images, PROMPTS)["hpsv2"]
    assert torch.allclose(one, many, atol=1e-5)
    mixed = [im for im in ImageBatch(images).pil()[:2]] + [ImageBatch(quantised_images(1, 30, 70)).pil()[0]]
    per_size = tiny_hps(mixed, PROMPTS[:3])["hpsv2"]  # PIL images of different sizes
    assert per_size.shape == (3,) and torch.isfinite(per_size).all()


def test_bfloat16_weights_give_float32_close_scores(images):
    fp32 = build_scorer("hpsv2", tiny=True, device="cpu")(images, PROMPTS)["hpsv2"]
    scorer = build_scorer("hpsv2", tiny=True, device="cpu", dtype="bf16")
    assert next(scorer.backbone.model.parameters()).dtype == torch.bfloat16
    bf16 = scorer(images, PROMPTS)["hpsv2"]
    assert bf16.dtype == torch.float32 and torch.allclose(bf16, fp32, atol=0.05)
    scorer.to(dtype="float32")
    assert torch.allclose(scorer(images, PROMPTS)["hpsv2"], fp32, atol=1e-2)  # bf16-rounded weights


def test_nan_rows_and_prompts(tiny_hps, images):
    clean = tiny_hps(images, PROMPTS)["hpsv2"]
    x = images.clone()
    x[1] = float("nan")
    out = hps.HPSv2(tiny_hps.backbone, batch_size=2)(x, PROMPTS)["hpsv2"]
    assert torch.isnan(out[1]) and torch.allclose(out[[0, 2, 3, 4]], clean[[0, 2, 3, 4]], atol=1e-5)
    with pytest.raises(ValueError, match="needs one prompt per image"):
        tiny_hps(images)


def test_gradient_reaches_pixels_on_the_tensor_path_only(tiny_hps):
    y = quantised_images(2, 48, 64).requires_grad_(True)  # non-square: resize + pad on the path
    tiny_hps(y, ["a cat", "a dog"])["hpsv2"].sum().backward()
    assert torch.isfinite(y.grad).all() and y.grad.abs().sum() > 0
    assert not any(p.requires_grad for p in tiny_hps.backbone.model.parameters())
    pil = hps.HPSv2(hps.OpenClipBackbone(tiny_hps.backbone.model, tiny_hps.backbone.tokenizer, preprocess="pil"))
    with pytest.raises(ValueError, match="not differentiable"):
        pil(y, ["a cat", "a dog"])


def test_loads_released_checkpoint_layouts(tiny_hps, images, tmp_path):
    # The real loading path on the tiny architecture: HPS files are {'state_dict': ...} .pt files.
    arch = hps.register_tiny_open_clip()
    expected = tiny_hps(images, PROMPTS)["hpsv2"]
    state = tiny_hps.backbone.state_dict()
    folder = tmp_path / "hps"
    folder.mkdir()
    torch.save({"state_dict": state, "epoch": 1}, folder / "HPS_v2.1_compressed.pt")
    torch.save({f"module.{k}": v.half() for k, v in state.items()}, folder / "HPS_v2_compressed.pt")
    hps.convert_hps_checkpoint(folder / "HPS_v2.1_compressed.pt", tmp_path / "hps.safetensors")
    for model, version, atol in [
        (str(folder), "v2.1", 1e-6),
        (str(folder / "HPS_v2.1_compressed.pt"), "v2.1", 1e-6),
        (str(tmp_path / "hps.safetensors"), "v2.1", 1e-6),
        (str(folder), "v2.0", 2e-3),
    ]:
        scorer = build_scorer("hpsv2", model=model, version=version, arch=arch, device="cpu")
        assert torch.allclose(scorer(images, PROMPTS)["hpsv2"], expected, atol=atol), (model, version)


def test_loading_errors_are_clear(tiny_hps, tmp_path):
    arch = hps.register_tiny_open_clip()
    with pytest.raises(ValueError, match="version must be one of"):
        build_scorer("hpsv2", version="v3")
    with pytest.raises(FileNotFoundError, match="HPS_v2_compressed.pt"):
        build_scorer("hpsv2", model=str(tmp_path), version="v2.0", arch=arch)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        build_scorer("hpsv2", model=str(tmp_path / "absent.pt"), arch=arch)
    with pytest.raises(OSError):  # hub id, offline: fails fast from the local cache, no download
        build_scorer("hpsv2", model="xswu/HPSv2", local_files_only=True, arch=arch)
    state = tiny_hps.backbone.state_dict()
    torch.save({"state_dict": {k: v for k, v in state.items() if k != "logit_scale"}}, tmp_path / "partial.pt")
    with pytest.raises(ValueError, match="missing.*logit_scale"):
        build_scorer("hpsv2", model=str(tmp_path / "partial.pt"), arch=arch)
    torch.save({"state_dict": state, "hook": ImageBatch}, tmp_path / "code.pt")  # a pickled class
    with pytest.raises(Exception, match="[Ww]eights only load failed"):
        hps.read_state_dict(tmp_path / "code.pt")
