"""Edit rewards (clip_directional, edit_preservation) on a tiny random CLIP / DINOv2: the formulas against a float64
re-derivation, caption fallbacks, source handling (sizes, kinds of image, index, missing), errors, composition."""

import copy

import pytest
import torch
import torch.nn.functional as F

from flowgrpo.cli import main
from reward_models import build_scorer, get_entry
from reward_models.edit_scores import ClipDirectional, EmbeddingPreservation
from reward_models.encoders import pooled
from reward_models.images import ImageBatch
from reward_models.preprocess import preprocess_tensor

from rewards_helpers import quantised_images

INSTRUCTIONS = ["make it red", "add a hat", "turn it into a watercolor"]


def uint8_images(n, h, w, seed):
    return [(x * 255).round().to(torch.uint8) for x in quantised_images(n, h, w, seed=seed)]


@pytest.fixture
def edits():
    return quantised_images(3, 40, 56, seed=1)


@pytest.fixture
def sources():
    """One source per edit, of another size than the edits, as uint8, PIL and float."""
    u8 = uint8_images(3, 24, 20, seed=2)
    return [[u8[0]], [ImageBatch(u8[1][None].float() / 255).pil()[0]], [u8[2].float() / 255]]


@pytest.fixture(scope="module")
def clip64(tiny_clip):
    return copy.deepcopy(tiny_clip.model).double()


def resized64(source, size):
    """The source as float64 [3,H,W] at `size`: bicubic, antialiased, clamped."""
    x = source.double() / 255 if source.dtype == torch.uint8 else source.double()
    x = F.interpolate(x[None], size=size, mode="bicubic", align_corners=False, antialias=True)[0]
    return x.clamp(0, 1)


def unit(v):
    return v / v.norm(dim=-1, keepdim=True)


def image_embeds64(model, spec, x):
    with torch.no_grad():
        return unit(pooled(model.get_image_features(pixel_values=preprocess_tensor(x.double(), spec))).double())


def text_embeds64(model, tokenizer, texts):
    tokens = tokenizer(texts, padding=True, truncation=True, return_tensors="pt")
    with torch.no_grad():
        out = model.get_text_features(input_ids=tokens["input_ids"], attention_mask=tokens["attention_mask"])
    return unit(pooled(out).double())


def as_uint8(source):
    return source if isinstance(source, torch.Tensor) else (ImageBatch([source]).tensor()[0] * 255).round().byte()


def cos64(a, b):
    return (a * b).sum(-1) / (a.norm(dim=-1) * b.norm(dim=-1))


# -- clip_directional ------------------------------------------------------------------------------------------


def test_clip_directional_is_the_instructpix2pix_formula(tiny_clip, clip64, edits, sources):
    src_caps, tgt_caps = ["a cat", "a dog", "a house"], ["a red cat", "a dog in a hat", "a watercolor house"]
    meta = {"source_images": sources, "source_caption": src_caps, "target_caption": tgt_caps}
    out = ClipDirectional(tiny_clip)(edits, INSTRUCTIONS, meta)
    src64 = torch.stack([resized64(as_uint8(s[0]), (40, 56)) for s in sources])
    e_edit, e_src = image_embeds64(clip64, tiny_clip.spec, edits), image_embeds64(clip64, tiny_clip.spec, src64)
    t_src, t_tgt = (text_embeds64(clip64, tiny_clip.tokenizer, c) for c in (src_caps, tgt_caps))
    expected = cos64(e_edit - e_src, t_tgt - t_src)
    assert out["clip_directional"].dtype == torch.float32
    assert torch.allclose(out["clip_directional"].double(), expected, atol=1e-4)
    assert torch.allclose(out["clip_directional/image_similarity"].double(), cos64(e_edit, e_src), atol=1e-5)
    assert torch.allclose(out["clip_directional/target_similarity"].double(), cos64(e_edit, t_tgt), atol=1e-5)
    # the source is resized to the edit before embedding: embedding it at its own size gives other numbers
    own = image_embeds64(clip64, tiny_clip.spec, torch.stack([s.double() / 255 for s in uint8_images(3, 24, 20, 2)]))
    assert not torch.allclose(cos64(e_edit - own, t_tgt - t_src), expected, atol=1e-3)


def test_caption_fallbacks_and_swapped_captions(tiny_clip, edits, sources):
    scorer = ClipDirectional(tiny_clip)
    bare = scorer(edits, INSTRUCTIONS, {"source_images": sources})["clip_directional"]
    assert scorer.counters["target_caption_fallbacks"] == 3 and scorer.counters["source_caption_fallbacks"] == 3
    explicit = {"source_images": sources, "source_caption": [""] * 3, "target_caption": INSTRUCTIONS}
    assert torch.allclose(bare, ClipDirectional(tiny_clip)(edits, INSTRUCTIONS, explicit)["clip_directional"])
    # None entries fall back per image; other keys are honoured
    partial = {"source_images": sources, "caption_before": ["a cat", None, "a house"], "target_caption": [None] * 3}
    custom = ClipDirectional(tiny_clip, source_caption_key="caption_before", default_source_caption="a photo")
    got = custom(edits, INSTRUCTIONS, partial)["clip_directional"]
    want = ClipDirectional(tiny_clip)(
        edits,
        INSTRUCTIONS,
        {"source_images": sources, "source_caption": ["a cat", "a photo", "a house"], "target_caption": INSTRUCTIONS},
    )["clip_directional"]
    assert torch.allclose(got, want) and custom.counters["source_caption_fallbacks"] == 1
    # swapping the captions reverses the text direction: the score changes sign
    swapped = {"source_images": sources, "source_caption": INSTRUCTIONS, "target_caption": [""] * 3}
    assert torch.allclose(
        ClipDirectional(tiny_clip)(edits, INSTRUCTIONS, swapped)["clip_directional"], -bare, atol=1e-6
    )
    with pytest.raises(TypeError, match="target_caption"):
        scorer(edits, INSTRUCTIONS, {"source_images": sources, "target_caption": [1, 2, 3]})


def test_unchanged_edit_scores_zero_and_missing_source_is_nan(tiny_clip, edits):
    scorer = ClipDirectional(tiny_clip)
    meta = {"source_images": [[edits[0]], None, []], "source_caption": ["a"] * 3, "target_caption": ["b"] * 3}
    out = scorer(edits, INSTRUCTIONS, meta)
    assert out["clip_directional"][0] == 0.0 and out["clip_directional/image_similarity"][0] == pytest.approx(1.0)
    assert (
        torch.isnan(out["clip_directional"][1:]).all()
        and torch.isnan(out["clip_directional/image_similarity"][1:]).all()
    )
    assert torch.isfinite(out["clip_directional/target_similarity"]).all()
    assert scorer.counters["missing_source"] == 2 and scorer.counters["zero_direction"] == 1
    assert scorer.counters["nan"] == 2


def test_source_index_picks_the_edited_image(tiny_clip, edits, sources):
    extra = uint8_images(3, 16, 16, seed=5)
    multi = {"source_images": [[extra[i], s[0]] for i, s in enumerate(sources)]}
    picked = ClipDirectional(tiny_clip, source_index=1)(edits, INSTRUCTIONS, multi)["clip_directional"]
    single = ClipDirectional(tiny_clip)(edits, INSTRUCTIONS, {"source_images": sources})["clip_directional"]
    first = ClipDirectional(tiny_clip)(edits, INSTRUCTIONS, multi)["clip_directional"]
    assert torch.allclose(picked, single, atol=1e-6) and not torch.allclose(first, single, atol=1e-3)
    out_of_range = ClipDirectional(tiny_clip, source_index=2)
    assert torch.isnan(out_of_range(edits, INSTRUCTIONS, multi)["clip_directional"]).all()


def test_gradient_reaches_edits_not_sources(tiny_clip):
    x = quantised_images(2, 32, 32).requires_grad_(True)
    src = quantised_images(2, 32, 32, seed=3).requires_grad_(True)
    meta = {"source_images": [[src[0]], [src[1]]]}
    ClipDirectional(tiny_clip)(x, ["a", "b"], meta)["clip_directional"].sum().backward()
    assert x.grad.abs().sum() > 0 and src.grad is None
    y = quantised_images(2, 32, 32).requires_grad_(True)
    build_scorer("edit_preservation")(y, metadata=meta)["edit_preservation"].sum().backward()
    assert y.grad.abs().sum() > 0


# -- edit_preservation -----------------------------------------------------------------------------------------


def test_pixel_preservation_is_one_minus_l1(edits, sources):
    out = build_scorer("edit_preservation")(edits, metadata={"source_images": sources})["edit_preservation"]
    src64 = torch.stack([resized64(as_uint8(s[0]), (40, 56)) for s in sources])
    expected = 1 - (edits.double() - src64).abs().flatten(1).mean(1)
    assert torch.allclose(out.double(), expected, atol=1e-6)
    same = build_scorer("edit_preservation")(edits, metadata={"source_images": list(edits)})["edit_preservation"]
    assert torch.equal(same, torch.ones(3))
    pil = ImageBatch(edits).pil()  # PIL edits of different sizes go one by one
    ragged = [pil[0], pil[1].resize((30, 20))]
    got = build_scorer("edit_preservation")(ragged, metadata={"source_images": sources[:2]})["edit_preservation"]
    assert got[0] == pytest.approx(out[0].item(), abs=1e-6) and got[1] != pytest.approx(out[1].item(), abs=1e-3)


def test_embedding_preservation_is_the_image_cosine(tiny_clip, clip64, edits, sources):
    scorer = EmbeddingPreservation(tiny_clip, kind="clip", batch_size=2)
    out = scorer(edits, metadata={"source_images": sources})["edit_preservation"]
    src64 = torch.stack([resized64(as_uint8(s[0]), (40, 56)) for s in sources])
    expected = cos64(image_embeds64(clip64, tiny_clip.spec, edits), image_embeds64(clip64, tiny_clip.spec, src64))
    assert torch.allclose(out.double(), expected, atol=1e-5)
    dino = build_scorer("edit_preservation", kind="dinov2", tiny=True, device="cpu")
    got = dino(edits, metadata={"source_images": [[edits[0]], sources[1], None]})["edit_preservation"]
    assert got[0] == pytest.approx(1.0, abs=1e-5) and got[1] < 0.999 and torch.isnan(got[2])
    assert dino.counters["missing_source"] == 1


def test_preservation_settings_are_checked():
    with pytest.raises(ValueError, match="kind must be one of"):
        build_scorer("edit_preservation", kind="lpips")
    with pytest.raises(ValueError, match=r"uses no model; \['model'\]"):
        build_scorer("edit_preservation", model="openai/clip-vit-base-patch32")
    with pytest.raises(ValueError, match="image_size"):
        build_scorer("edit_preservation", image_size=224)
    assert build_scorer("edit_preservation", kind="clip", tiny=True, device="cpu").kind == "clip"


@pytest.mark.parametrize(
    "name,settings",
    [
        ("clip_directional", {"tiny": True, "device": "cpu"}),
        ("edit_preservation", {}),
        ("edit_judge", {"url": "http://127.0.0.1:9"}),
    ],
)
def test_missing_source_images_is_a_one_line_error(name, settings, edits):
    scorer = build_scorer(name, **settings)
    with pytest.raises(ValueError) as info:
        scorer(edits, INSTRUCTIONS, {"reference_images": list(edits)})
    assert f"scorer '{name}' needs metadata ['source_images']" in str(info.value) and "\n" not in str(info.value)


def test_bad_source_images_are_named(edits):
    scorer = build_scorer("edit_preservation")
    with pytest.raises(ValueError, match="source_images.*must be"):
        scorer(edits[:1], metadata={"source_images": [[torch.zeros(3, 8, 8, 2)]]})
    with pytest.raises(TypeError, match="source_images"):
        scorer(edits[:1], metadata={"source_images": [["a path"]]})


# -- composition and the registry ------------------------------------------------------------------------------


def test_edit_rewards_compose_with_other_scorers(edits, sources):
    multi = build_scorer(
        "multi",
        rewards=[
            {"name": "clip_directional", "tiny": True, "device": "cpu", "weight": 2.0},
            {"name": "edit_preservation", "weight": 0.5},
            {"name": "brightness", "weight": 1.0},
        ],
    )
    assert multi.metadata_keys == ("source_images",) and multi.requires_prompts
    out = multi(edits, INSTRUCTIONS, {"source_images": sources})
    want = 2 * out["clip_directional"] + 0.5 * out["edit_preservation"] + out["brightness"]
    assert torch.allclose(out["total"], want)
    pair = build_scorer("pointwise_as_pairwise", scorer={"name": "edit_preservation"}, temperature=0.1)
    assert pair.metadata_keys == ("source_images",)
    src = [[e] for e in edits]
    p = pair(edits, edits.flip(0), metadata={"source_images": src})
    s = build_scorer("edit_preservation")
    s_a = s(edits, metadata={"source_images": src})["edit_preservation"]
    s_b = s(edits.flip(0), metadata={"source_images": src})["edit_preservation"]
    assert torch.allclose(p, torch.sigmoid((s_a - s_b) / 0.1)) and p[0] > 0.5


def test_registered_and_listed(capsys):
    for name, kind in [
        ("clip_directional", "pointwise"),
        ("edit_preservation", "pointwise"),
        ("edit_judge", "pointwise"),
        ("edit_judge_pairwise", "pairwise"),
    ]:
        entry = get_entry(name)
        assert entry.kind == kind and entry.doc
    assert main(["list", "scorers"]) == 0
    out = capsys.readouterr().out
    for text in ("clip_directional", "source_caption_key='source_caption'", "kind='pixel'", "edit_judge_pairwise"):
        assert text in out, text
    assert "InstructPix2Pix" in next(line for line in out.splitlines() if line.startswith("  clip_directional "))
