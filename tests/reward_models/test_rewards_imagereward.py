"""imagereward on a tiny BLIP: constants, the official checkpoint layout, an independent reference
forward of BLIP's ViT + MED encoder + MLP written from the published architecture, loading paths."""

import math

import pytest
import torch
import torch.nn.functional as F

from reward_models import build_scorer, get_entry
from reward_models import imagereward as ir
from reward_models import imagereward_model as irm
from reward_models.images import ImageBatch

from rewards_helpers import PROMPTS, quantised_images


@pytest.fixture(scope="module")
def tiny_ir():
    return ir.ImageReward.tiny()


# --- the official layout, written out independently of reward_models.imagereward_model -----------


def to_official(state):
    """Our keys -> ImageReward.pt keys (BLIP's ViT, MED, the MLP), plus BLIP's unused extras."""
    out = {}
    for key, value in state.items():
        if key.startswith("head."):
            new = "mlp." + key[len("head.") :]
        elif key.startswith("text."):
            new = "blip.text_encoder." + key[len("text.") :]
        else:
            rest = key[len("vision.") :]
            top = {
                "embeddings.class_embedding": "cls_token",
                "embeddings.position_embedding": "pos_embed",
                "embeddings.patch_embedding.weight": "patch_embed.proj.weight",
                "embeddings.patch_embedding.bias": "patch_embed.proj.bias",
                "post_layernorm.weight": "norm.weight",
                "post_layernorm.bias": "norm.bias",
            }
            if rest in top:
                new = "blip.visual_encoder." + top[rest]
            else:
                _, _, i, *tail = rest.split(".")
                tail = ".".join(tail)
                for ours, theirs in [
                    ("layer_norm1.", "norm1."),
                    ("self_attn.qkv.", "attn.qkv."),
                    ("self_attn.projection.", "attn.proj."),
                    ("layer_norm2.", "norm2."),
                    ("mlp.", "mlp."),
                ]:
                    if tail.startswith(ours):
                        tail = theirs + tail[len(ours) :]
                        break
                new = f"blip.visual_encoder.blocks.{i}.{tail}"
        out[new] = value.clone()
    width, text_width = out["blip.visual_encoder.cls_token"].shape[-1], out["mlp.layers.0.weight"].shape[1]
    positions = out["blip.text_encoder.embeddings.position_embeddings.weight"].shape[0]
    out.update(
        {
            "blip.vision_proj.weight": torch.randn(8, width),
            "blip.vision_proj.bias": torch.zeros(8),
            "blip.text_proj.weight": torch.randn(8, text_width),
            "blip.text_proj.bias": torch.zeros(8),
            "blip.text_encoder.embeddings.position_ids": torch.arange(positions)[None],
        }
    )
    return out


def ln(x, w, prefix, eps):
    return F.layer_norm(x, x.shape[-1:], w[prefix + "weight"], w[prefix + "bias"], eps)


def linear(x, w, prefix):
    return F.linear(x, w[prefix + "weight"], w[prefix + "bias"])


def attention(q, k, v, heads, mask=None):
    b, n, c = q.shape
    q, k, v = (t.reshape(b, t.shape[1], heads, c // heads).transpose(1, 2) for t in (q, k, v))
    scores = q @ k.transpose(-1, -2) / math.sqrt(c // heads)
    if mask is not None:
        scores = scores + (1.0 - mask[:, None, None, :].float()) * -10000.0  # BERT's extended mask
    return (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, n, c)


def reference_score(w, pixels, input_ids, attention_mask, vision_heads, text_heads):
    """BLIP ViT (timm-style pre-norm blocks, LN eps 1e-6, final norm) -> MED BERT encoder with
    cross-attention in every layer (post-norm, eps 1e-12) -> [CLS] -> MLP -> (x - mean) / std."""
    v = "blip.visual_encoder."
    x = (
        F.conv2d(
            pixels,
            w[v + "patch_embed.proj.weight"],
            w[v + "patch_embed.proj.bias"],
            stride=w[v + "patch_embed.proj.weight"].shape[-1],
        )
        .flatten(2)
        .transpose(1, 2)
    )
    x = torch.cat([w[v + "cls_token"].expand(len(x), -1, -1), x], 1) + w[v + "pos_embed"]
    depth = 1 + max(int(k.split(".")[3]) for k in w if k.startswith(v + "blocks."))
    for i in range(depth):
        p = f"{v}blocks.{i}."
        h = ln(x, w, p + "norm1.", 1e-6)
        q, k, vv = linear(h, w, p + "attn.qkv.").chunk(3, dim=-1)
        x = x + linear(attention(q, k, vv, vision_heads), w, p + "attn.proj.")
        x = x + linear(F.gelu(linear(ln(x, w, p + "norm2.", 1e-6), w, p + "mlp.fc1.")), w, p + "mlp.fc2.")
    image = ln(x, w, v + "norm.", 1e-6)

    t = "blip.text_encoder."
    pos = w[t + "embeddings.position_embeddings.weight"][: input_ids.shape[1]]
    h = ln(w[t + "embeddings.word_embeddings.weight"][input_ids] + pos, w, t + "embeddings.LayerNorm.", 1e-12)
    layers = 1 + max(int(k.split(".")[4]) for k in w if k.startswith(t + "encoder.layer."))
    for i in range(layers):
        p = f"{t}encoder.layer.{i}."
        for part, kv, mask in (("attention.", h, attention_mask), ("crossattention.", image, None)):
            ctx = attention(
                linear(h, w, p + part + "self.query."),
                linear(kv, w, p + part + "self.key."),
                linear(kv, w, p + part + "self.value."),
                text_heads,
                mask,
            )
            h = ln(linear(ctx, w, p + part + "output.dense.") + h, w, p + part + "output.LayerNorm.", 1e-12)
        ffn = linear(F.gelu(linear(h, w, p + "intermediate.dense.")), w, p + "output.dense.")
        h = ln(ffn + h, w, p + "output.LayerNorm.", 1e-12)
    z = h[:, 0].float()
    for n in (0, 2, 4, 6, 7):  # dropouts between, no activations
        z = linear(z, w, f"mlp.layers.{n}.")
    return (z.squeeze(-1) - 0.16717362830052426) / 1.0333394966054072


def write_official(folder, scorer, *, med=True):
    folder.mkdir(parents=True, exist_ok=True)
    torch.save(to_official(scorer.model.state_dict()), folder / "ImageReward.pt")
    if med:  # BERT config names, as in the released med_config.json
        text = scorer.model.text.config
        (folder / "med_config.json").write_text(
            '{"architectures": ["BertModel"], "hidden_size": %d, "num_attention_heads": %d, "vocab_size": %d, '
            '"encoder_width": 768, "add_cross_attention": true, "layer_norm_eps": 1e-12}'
            % (text.hidden_size, text.num_attention_heads, text.vocab_size)
        )
    irm.tiny_bert_tokenizer(blip=False).save_pretrained(folder / "bert")  # stands in for bert-base-uncased
    return folder


# --- tests -------------------------------------------------------------------------------------


def test_constants_are_the_published_values():
    # the THUDM/ImageReward source
    assert ir.IMAGEREWARD_MEAN == 0.16717362830052426 and ir.IMAGEREWARD_STD == 1.0333394966054072
    assert ir.IMAGEREWARD_MAX_LENGTH == 35 and ir.IMAGEREWARD_IMAGE_SIZE == 224
    assert ir.OPENAI_CLIP_MEAN == (0.48145466, 0.4578275, 0.40821073)
    assert ir.OPENAI_CLIP_STD == (0.26862954, 0.26130258, 0.27577711)
    assert (irm.IMAGEREWARD_REPO, irm.IMAGEREWARD_FILE, irm.BERT_TOKENIZER) == (
        "THUDM/ImageReward",
        "ImageReward.pt",
        "bert-base-uncased",
    )
    vit = irm.VISION_CONFIG  # BLIP create_vit('large', 224)
    assert (
        vit["hidden_size"],
        vit["num_hidden_layers"],
        vit["num_attention_heads"],
        vit["patch_size"],
        vit["image_size"],
        vit["layer_norm_eps"],
        vit["hidden_act"],
    ) == (1024, 24, 16, 16, 224, 1e-6, "gelu")
    med = irm.TEXT_CONFIG  # med_config.json: BERT-base + 2 BLIP tokens, cross-attention to the ViT
    assert (
        med["vocab_size"],
        med["hidden_size"],
        med["num_hidden_layers"],
        med["num_attention_heads"],
        med["encoder_hidden_size"],
        med["layer_norm_eps"],
    ) == (30524, 768, 12, 12, 1024, 1e-12)
    head = irm.AestheticHead(input_dim=768)
    linears = [m for m in head.layers if isinstance(m, torch.nn.Linear)]
    sizes = [(m.in_features, m.out_features) for m in linears]
    assert sizes == [(768, 1024), (1024, 128), (128, 64), (64, 16), (16, 1)]
    assert [m.p for m in head.layers if isinstance(m, torch.nn.Dropout)] == [0.2, 0.2, 0.1]
    assert get_entry("imagereward").kind == "pointwise"
    settings = get_entry("imagereward").settings
    assert settings["model"] == "THUDM/ImageReward" and settings["max_length"] == 35 and settings["dtype"] == "float32"


def test_preprocessing_follows_torchvision_resize_and_center_crop():
    assert ir.shorter_side_size(480, 640, 224) == (224, 298)  # int(224 * 640 / 480)
    assert ir.shorter_side_size(640, 480, 224) == (298, 224)
    assert [ir.center_crop_offset(n, 224) for n in (224, 297, 298, 299)] == [0, 36, 37, 38]  # round half to even
    from PIL import Image

    ramp = torch.arange(60 * 100, dtype=torch.float32).reshape(60, 100) % 251
    im = Image.fromarray(ramp.to(torch.uint8).numpy()).convert("RGB")  # 100x60: resize to 373x224, crop
    out = ir.imagereward_preprocess_pil(im)
    assert out.shape == (3, 224, 224)
    resized = im.resize((373, 224), Image.BICUBIC).crop((74, 0, 298, 224))  # left = round(149 / 2) = 74
    expected = ImageBatch([resized]).tensor()[0]
    mean, std = torch.tensor(ir.OPENAI_CLIP_MEAN)[:, None, None], torch.tensor(ir.OPENAI_CLIP_STD)[:, None, None]
    assert torch.allclose(out, (expected - mean) / std, atol=1e-6)
    torch.manual_seed(0)
    smooth = F.interpolate(torch.rand(2, 3, 6, 10), size=(60, 100), mode="bilinear").clamp(0, 1)
    x = (smooth * 255).round() / 255
    ours = ir.imagereward_preprocess_tensor(x)
    reference = torch.stack([ir.imagereward_preprocess_pil(p) for p in ImageBatch(x).pil()])
    one_level = 1 / 255 / min(ir.OPENAI_CLIP_STD)
    assert (ours - reference).abs().mean() < 0.5 * one_level and (ours - reference).abs().max() < 3 * one_level


def test_score_matches_an_independent_reference_forward(tiny_ir, images):
    w = to_official(tiny_ir.model.state_dict())
    pixels = torch.stack([ir.imagereward_preprocess_pil(im, tiny_ir.image_size) for im in ImageBatch(images).pil()])
    tokens = tiny_ir.tokens(PROMPTS)
    assert tokens["input_ids"].shape == (5, 35) and (tokens["input_ids"][:, 0] == tiny_ir.tokenizer.cls_token_id).all()
    with torch.no_grad():
        expected = reference_score(
            w,
            pixels,
            tokens["input_ids"],
            tokens["attention_mask"],
            vision_heads=tiny_ir.model.vision.config.num_attention_heads,
            text_heads=tiny_ir.model.text.config.num_attention_heads,
        )
    pil = ir.ImageReward(tiny_ir.model, tiny_ir.tokenizer, device="cpu", preprocess="pil")
    got = pil(images, PROMPTS)["imagereward"]
    assert set(pil(images, PROMPTS)) == {"imagereward"} and got.dtype == torch.float32
    assert torch.allclose(got, expected, atol=1e-5)
    assert got.std() > 1e-3  # depends on image and prompt
    assert torch.allclose(tiny_ir(images, PROMPTS)["imagereward"], expected, atol=0.02)  # tensor path


def test_prompts_are_cut_at_35_tokens(tiny_ir, images):
    long = "a " * 60 + "cat"
    tokens = tiny_ir.tokens([long])
    assert tokens["input_ids"].shape == (1, 35) and bool(tokens["attention_mask"].all())
    assert tokens["input_ids"][0, -1] == tiny_ir.tokenizer.sep_token_id
    longer = long + " on a bike with many more words"
    a = tiny_ir(images[:1], [long])["imagereward"]
    assert torch.equal(a, tiny_ir(images[:1], [longer])["imagereward"])  # the tail is never seen


def test_batching_and_dtype(tiny_ir, images):
    one = ir.ImageReward(tiny_ir.model, tiny_ir.tokenizer, device="cpu", batch_size=1)(images, PROMPTS)["imagereward"]
    many = tiny_ir(images, PROMPTS)["imagereward"]
    assert torch.allclose(one, many, atol=1e-5)
    bf16 = build_scorer("imagereward", tiny=True, device="cpu", dtype="bfloat16")
    assert bf16.model.vision.dtype == torch.bfloat16 and bf16.model.head.layers[0].weight.dtype == torch.float32
    out = bf16(images, PROMPTS)["imagereward"]
    assert out.dtype == torch.float32 and torch.allclose(out, many, atol=0.05)


def test_nan_rows_and_gradients(tiny_ir, images):
    many = tiny_ir(images, PROMPTS)["imagereward"]
    x = images.clone()
    x[2] = float("nan")
    nan = ir.ImageReward(tiny_ir.model, tiny_ir.tokenizer, device="cpu", batch_size=2)(x, PROMPTS)["imagereward"]
    assert torch.isnan(nan[2]) and torch.allclose(nan[[0, 1, 3, 4]], many[[0, 1, 3, 4]], atol=1e-5)
    y = quantised_images(2, 48, 64).requires_grad_(True)
    tiny_ir(y, ["a cat", "a dog"])["imagereward"].sum().backward()
    assert torch.isfinite(y.grad).all() and y.grad.abs().sum() > 0
    assert not any(p.requires_grad for p in tiny_ir.model.parameters())
    with pytest.raises(ValueError, match="needs one prompt per image"):
        tiny_ir(images)


def test_loads_the_official_checkpoint_layout(tiny_ir, images, tmp_path):
    folder = write_official(tmp_path / "official", tiny_ir)
    expected = tiny_ir(images, PROMPTS)["imagereward"]
    for model in (str(folder), str(folder / "ImageReward.pt")):
        scorer = build_scorer("imagereward", model=model, tokenizer=str(folder / "bert"), device="cpu")
        assert scorer.tokenizer.convert_tokens_to_ids(["[DEC]", "[ENC]"]) == [88, 89]  # added like BLIP
        assert torch.allclose(scorer(images, PROMPTS)["imagereward"], expected, atol=1e-6)
    # sizes come from the tensors; heads from med_config.json, else width / 64 (all published BLIPs)
    w = to_official(tiny_ir.model.state_dict())
    vision, text = irm.config_from_official(w, {"num_attention_heads": 4})
    sizes = (vision["hidden_size"], vision["num_hidden_layers"], vision["patch_size"], vision["image_size"])
    assert sizes == (64, 2, 8, 32)
    assert (vision["num_attention_heads"], text["num_attention_heads"], text["vocab_size"]) == (1, 4, 90)
    assert irm.config_from_official(w)[1]["num_attention_heads"] == 1  # 32 / 64, floored at one head


def test_converted_directory_round_trip(tiny_ir, images, tmp_path):
    folder = write_official(tmp_path / "official", tiny_ir)
    ir.convert_imagereward_checkpoint(folder / "ImageReward.pt", tmp_path / "converted", tokenizer=str(folder / "bert"))
    assert {p.name for p in (tmp_path / "converted").iterdir()} >= {"config.json", "model.safetensors"}
    loaded = ir.ImageReward.from_pretrained(str(tmp_path / "converted"), device="cpu")
    assert torch.allclose(loaded(images, PROMPTS)["imagereward"], tiny_ir(images, PROMPTS)["imagereward"], atol=1e-6)


def test_loading_errors_are_clear(tiny_ir, tmp_path):
    w = to_official(tiny_ir.model.state_dict())
    folder = write_official(tmp_path / "x", tiny_ir)
    bert = str(folder / "bert")
    torch.save(dict(w, **{"blip.itm_head.weight": torch.zeros(2, 32)}), tmp_path / "pretraining.pt")
    build_scorer("imagereward", model=str(tmp_path / "pretraining.pt"), tokenizer=bert)  # BLIP extras: dropped
    torch.save({"module." + k: v for k, v in w.items()}, tmp_path / "ddp.pt")
    build_scorer("imagereward", model=str(tmp_path / "ddp.pt"), tokenizer=bert)  # DDP prefix stripped
    torch.save(dict(w, **{"blip.adapter.weight": torch.zeros(2, 32)}), tmp_path / "extra.pt")
    with pytest.raises(KeyError, match="blip.adapter.weight"):
        build_scorer("imagereward", model=str(tmp_path / "extra.pt"), tokenizer=bert)
    torch.save({k: v for k, v in w.items() if k != "mlp.layers.7.bias"}, tmp_path / "missing.pt")
    with pytest.raises(ValueError, match=r"missing \['head.layers.7.bias'\]"):
        build_scorer("imagereward", model=str(tmp_path / "missing.pt"), tokenizer=bert)
    torch.save(dict(w, code=ImageBatch), tmp_path / "code.pt")
    with pytest.raises(Exception, match="[Ww]eights only load failed"):
        build_scorer("imagereward", model=str(tmp_path / "code.pt"), tokenizer=bert)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="ImageReward.pt"):
        build_scorer("imagereward", model=str(tmp_path / "empty"), tokenizer=bert)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        build_scorer("imagereward", model=str(tmp_path / "absent.pt"), tokenizer=bert)
    with pytest.raises(OSError):  # hub id offline: fails fast from the local cache, no download
        build_scorer("imagereward", local_files_only=True)
