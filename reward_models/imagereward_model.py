"""The ImageReward v1.0 network on transformers' BLIP classes, and loading its weights.

Modules: transformers `BlipVisionModel` (BLIP's ViT: LayerNorm eps 1e-6, fused qkv with bias,
exact GELU) and `BlipTextModel(add_pooling_layer=False)`, the MED encoder that
`BlipForImageTextRetrieval` uses: built with cross-attention layers (config.is_decoder=True is
what makes transformers create them) and called with is_decoder=False (bidirectional self-attention),
as MED's `mode='multimodal'` encoder. The official `ImageReward.pt` (a state dict; read with
torch.load(weights_only=True)) is mapped key by key onto these modules, strictly: every module
weight must come from the file; only BLIP's unused `vision_proj` / `text_proj` and MED's
`position_ids` buffer are dropped. `load_imagereward` also reads a converted directory
(config.json + model.safetensors + the tokenizer, as ImageReward.save_pretrained writes it), no .pt.

What the real weights need: `ImageReward.pt` (hub repo THUDM/ImageReward, a local directory or
the file) and the `bert-base-uncased` tokenizer (hub id or a local directory). `med_config.json`
is optional: sizes are read off the checkpoint's tensors, attention heads from med_config.json when
present, else width / 64 (true of every published BLIP tower).
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

import torch
from torch import nn

from .aesthetic import AestheticHead
from .state_dicts import read_state_dict

IMAGEREWARD_REPO = "THUDM/ImageReward"
IMAGEREWARD_FILE = "ImageReward.pt"
MED_CONFIG_FILE = "med_config.json"
BERT_TOKENIZER = "bert-base-uncased"
BLIP_EXTRA_TOKENS = {"bos_token": "[DEC]", "additional_special_tokens": ["[ENC]"]}

# BLIP ViT-L/16 @224 (create_vit('large')) and the MED BERT-base of med_config.json (encoder_width
# is set to the ViT width by BLIP_Pretrain).
VISION_CONFIG = dict(
    hidden_size=1024,
    intermediate_size=4096,
    num_hidden_layers=24,
    num_attention_heads=16,
    image_size=224,
    patch_size=16,
    layer_norm_eps=1e-6,
    hidden_act="gelu",
)
TEXT_CONFIG = dict(
    vocab_size=30524,
    hidden_size=768,
    intermediate_size=3072,
    num_hidden_layers=12,
    num_attention_heads=12,
    max_position_embeddings=512,
    layer_norm_eps=1e-12,
    hidden_act="gelu",
    encoder_hidden_size=1024,
    pad_token_id=0,
    bos_token_id=30522,
    sep_token_id=102,
    hidden_dropout_prob=0.0,
    attention_probs_dropout_prob=0.0,
)
HEAD_DIM = 64  # every published BLIP tower: ViT-B 768/12, ViT-L 1024/16, BERT-base 768/12
TINY_VISION_CONFIG = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=1,
    image_size=32,
    patch_size=8,
    layer_norm_eps=1e-6,
    hidden_act="gelu",
    initializer_range=0.02,
)
TINY_TEXT_CONFIG = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=64,
    layer_norm_eps=1e-12,
    hidden_act="gelu",
    encoder_hidden_size=32,
    pad_token_id=0,
    hidden_dropout_prob=0.0,
    attention_probs_dropout_prob=0.0,
)


def _blip_configs(vision: dict, text: dict):
    from transformers import BlipTextConfig, BlipVisionConfig

    vision_config = BlipVisionConfig(**vision)
    # is_decoder=True makes transformers build the cross-attention layers; forward passes
    # is_decoder=False, so self-attention stays bidirectional (MED's multimodal encoder).
    text_config = BlipTextConfig(**{**text, "is_decoder": True, "encoder_hidden_size": vision_config.hidden_size})
    return vision_config, text_config


class ImageRewardModel(nn.Module):
    """BLIP image encoder + cross-attending MED text encoder + the ImageReward MLP."""

    def __init__(self, vision_config, text_config):
        super().__init__()
        from transformers import BlipVisionModel
        from transformers.models.blip.modeling_blip_text import BlipTextModel

        self.vision = BlipVisionModel(vision_config)
        self.text = BlipTextModel(text_config, add_pooling_layer=False)
        self.head = AestheticHead(input_dim=text_config.hidden_size)

    @classmethod
    def from_dicts(cls, vision: dict, text: dict, seed: int = 0) -> ImageRewardModel:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return cls(*_blip_configs(vision, text)).eval()

    def config_dict(self) -> dict:
        keep = set(VISION_CONFIG) | set(TEXT_CONFIG) | {"eos_token_id"}
        vision = {k: v for k, v in self.vision.config.to_dict().items() if k in keep}
        text = {k: v for k, v in self.text.config.to_dict().items() if k in keep}
        return {"architecture": "imagereward", "vision_config": vision, "text_config": text}

    def cls_state(self, pixel_values: torch.Tensor, input_ids: torch.Tensor, attention_mask: torch.Tensor):
        """[CLS] hidden state [B, 768] of the text encoder cross-attending to the image tokens."""
        image_embeds = self.vision(pixel_values=pixel_values).last_hidden_state  # post-LayerNorm, all tokens
        image_atts = torch.ones(image_embeds.shape[:-1], dtype=torch.long, device=image_embeds.device)
        out = self.text(
            input_ids=input_ids,
            attention_mask=attention_mask,
            encoder_hidden_states=image_embeds,
            encoder_attention_mask=image_atts,
            is_decoder=False,
        )
        return out.last_hidden_state[:, 0, :]

    def forward(self, pixel_values, input_ids, attention_mask) -> torch.Tensor:
        """The raw MLP output [B] (before the mean/std normalisation), in float32."""
        return self.head(self.cls_state(pixel_values, input_ids, attention_mask).float()).squeeze(-1)


# --- the official checkpoint -------------------------------------------------------------------

_VIT_BLOCK = [
    ("norm1.", "layer_norm1."),
    ("attn.qkv.", "self_attn.qkv."),
    ("attn.proj.", "self_attn.projection."),
    ("norm2.", "layer_norm2."),
    ("mlp.fc1.", "mlp.fc1."),
    ("mlp.fc2.", "mlp.fc2."),
]
_VIT_TOP = {
    "cls_token": "embeddings.class_embedding",
    "pos_embed": "embeddings.position_embedding",
    "patch_embed.proj.weight": "embeddings.patch_embedding.weight",
    "patch_embed.proj.bias": "embeddings.patch_embedding.bias",
    "norm.weight": "post_layernorm.weight",
    "norm.bias": "post_layernorm.bias",
}
# Not used by the score: BLIP's contrastive projections, MED's position_ids buffer, and BLIP
# pretraining parts a checkpoint might carry (momentum encoders, queues, ITM head, decoder).
_DROPPED = (
    "blip.vision_proj.",
    "blip.text_proj.",
    "blip.text_encoder.embeddings.position_ids",
    "blip.itm_head.",
    "blip.text_decoder.",
    "blip.visual_encoder_m.",
    "blip.text_encoder_m.",
    "blip.vision_proj_m.",
    "blip.text_proj_m.",
    "blip.image_queue",
    "blip.text_queue",
    "blip.idx_queue",
    "blip.queue_ptr",
    "blip.temp",
)


def map_official_key(key: str) -> str | None:
    """An ImageReward.pt key -> our key; None for keys the score does not use; KeyError if unknown."""
    if key.startswith(_DROPPED):
        return None
    if key.startswith("mlp.layers."):
        return "head." + key[len("mlp.") :]
    if key.startswith("blip.text_encoder."):
        return "text." + key[len("blip.text_encoder.") :]
    if key.startswith("blip.visual_encoder."):
        rest = key[len("blip.visual_encoder.") :]
        if rest in _VIT_TOP:
            return "vision." + _VIT_TOP[rest]
        match = re.fullmatch(r"blocks\.(\d+)\.(.+)", rest)
        if match:
            for old, new in _VIT_BLOCK:
                if match.group(2).startswith(old):
                    return f"vision.encoder.layers.{match.group(1)}.{new}{match.group(2)[len(old) :]}"
    raise KeyError(f"unexpected key in the ImageReward checkpoint: {key}")


def map_official_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """ImageReward.pt keys -> ours (unused keys dropped, unknown keys an error)."""
    out = {}
    for key, value in state.items():
        new = map_official_key(key)
        if new is not None:
            out[new] = value
    return out


def config_from_official(state: dict[str, torch.Tensor], med: dict | None = None) -> tuple[dict, dict]:
    """Model sizes read off an ImageReward.pt state dict (so ViT-B/ViT-L BLIPs and tiny test files
    all load); heads are width / 64 as in every published BLIP unless med_config.json says."""
    v = "blip.visual_encoder."
    try:
        width = state[v + "cls_token"].shape[-1]
        patch = state[v + "patch_embed.proj.weight"].shape[-1]
        grid = math.isqrt(state[v + "pos_embed"].shape[1] - 1)
        depth = 1 + max(int(k.split(".")[3]) for k in state if k.startswith(v + "blocks."))
        words = state["blip.text_encoder.embeddings.word_embeddings.weight"]
        positions = state["blip.text_encoder.embeddings.position_embeddings.weight"]
        t = "blip.text_encoder.encoder.layer."
        layers = 1 + max(int(k[len(t) :].split(".")[0]) for k in state if k.startswith(t))
        ffn = state[t + "0.intermediate.dense.weight"].shape[0]
    except (KeyError, ValueError) as err:
        raise ValueError(f"not an ImageReward (BLIP) state dict: {err!r}") from None
    vision = dict(
        VISION_CONFIG,
        hidden_size=width,
        intermediate_size=state[v + "blocks.0.mlp.fc1.weight"].shape[0],
        num_hidden_layers=depth,
        num_attention_heads=max(1, width // HEAD_DIM),
        image_size=grid * patch,
        patch_size=patch,
    )
    text = dict(TEXT_CONFIG, num_attention_heads=max(1, words.shape[1] // HEAD_DIM))
    text.update(
        {k: med[k] for k in ("num_attention_heads", "layer_norm_eps", "hidden_act", "pad_token_id") if k in (med or {})}
    )
    text.update(
        vocab_size=words.shape[0],
        hidden_size=words.shape[1],
        max_position_embeddings=positions.shape[0],
        num_hidden_layers=layers,
        intermediate_size=ffn,
    )
    return vision, text


def load_strict(model: ImageRewardModel, state: dict[str, torch.Tensor], source: str) -> ImageRewardModel:
    expected = model.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    wrong = [k for k in expected if k in state and tuple(state[k].shape) != tuple(expected[k].shape)]
    if missing or unexpected or wrong:
        raise ValueError(
            f"{source} does not fit the ImageReward model: missing {missing[:5]} ({len(missing)}), "
            f"unexpected {unexpected[:5]} ({len(unexpected)}), wrong shape {wrong[:5]}"
        )
    model.load_state_dict(state, strict=True)
    return model.eval()


# --- tokenizer ---------------------------------------------------------------------------------


def blip_tokenizer(source):
    """BLIP's tokenizer: a BertTokenizer (hub id, directory, or a tokenizer object) + [DEC], [ENC]."""
    if isinstance(source, (str, os.PathLike)):
        from transformers import BertTokenizer

        source = BertTokenizer.from_pretrained(str(source))
    if "[ENC]" not in source.get_vocab():
        source.add_special_tokens({"bos_token": BLIP_EXTRA_TOKENS["bos_token"]})
        source.add_special_tokens({"additional_special_tokens": BLIP_EXTRA_TOKENS["additional_special_tokens"]})
    return source


def tiny_bert_tokenizer(*, blip: bool = True):
    """An in-memory WordPiece vocabulary (specials, lower-case letters, digits, punctuation), with
    BLIP's two extra tokens unless blip=False (then it stands in for bert-base-uncased)."""
    from transformers import BertTokenizer

    chars = list("abcdefghijklmnopqrstuvwxyz0123456789")
    tokens = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + chars + ["##" + c for c in chars] + list(".,!?'\"-:;()")
    tokenizer = BertTokenizer(vocab={t: i for i, t in enumerate(tokens)})
    return blip_tokenizer(tokenizer) if blip else tokenizer


# --- loading -----------------------------------------------------------------------------------


def _official_checkpoint(model: str, *, local_files_only: bool, revision: str | None) -> tuple[str, str | None]:
    """(ImageReward.pt path, med_config.json path or None) from a file, a directory or a hub id."""
    if os.path.isfile(model):
        med = os.path.join(os.path.dirname(model), MED_CONFIG_FILE)
        return model, med if os.path.isfile(med) else None
    if os.path.isdir(model):
        pt, med = os.path.join(model, IMAGEREWARD_FILE), os.path.join(model, MED_CONFIG_FILE)
        if not os.path.isfile(pt):
            raise FileNotFoundError(
                f"{model} holds neither config.json + model.safetensors (a converted ImageReward) "
                f"nor {IMAGEREWARD_FILE}"
            )
        return pt, med if os.path.isfile(med) else None
    if model.startswith((".", "/", "~")) or model.count("/") != 1 or model.endswith(".pt"):
        raise FileNotFoundError(f"ImageReward checkpoint {model} does not exist")
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError

    opts = dict(revision=revision, local_files_only=local_files_only)
    pt = hf_hub_download(model, IMAGEREWARD_FILE, **opts)
    try:
        med = hf_hub_download(model, MED_CONFIG_FILE, **opts)
    except EntryNotFoundError:  # optional (local or remote miss): heads then follow the width
        med = None
    return pt, med


def load_imagereward(
    model: str, *, tokenizer: str | None = None, local_files_only: bool = False, revision: str | None = None
) -> tuple[ImageRewardModel, object]:
    """A converted directory (config.json + model.safetensors + tokenizer files), or the official
    ImageReward.pt (file, directory or hub repo) + a bert-base-uncased tokenizer."""
    if os.path.isdir(model) and os.path.isfile(os.path.join(model, "model.safetensors")):
        from safetensors.torch import load_file

        config = json.loads(Path(model, "config.json").read_text())
        if config.get("architecture") != "imagereward":
            raise ValueError(f"{model}/config.json is not an ImageReward config")
        net = ImageRewardModel.from_dicts(config["vision_config"], config["text_config"])
        net = load_strict(net, load_file(os.path.join(model, "model.safetensors")), model)
        return net, blip_tokenizer(tokenizer or model)
    pt, med = _official_checkpoint(model, local_files_only=local_files_only, revision=revision)
    raw = read_state_dict(pt)
    vision, text = config_from_official(raw, json.loads(Path(med).read_text()) if med else None)
    net = load_strict(ImageRewardModel.from_dicts(vision, text), map_official_state_dict(raw), pt)
    from transformers import BertTokenizer

    tok = BertTokenizer.from_pretrained(tokenizer or BERT_TOKENIZER, local_files_only=local_files_only)
    return net, blip_tokenizer(tok)
