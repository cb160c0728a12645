"""ImageReward v1.0 on transformers' BLIP classes (the ImageReward paper and the THUDM/ImageReward release).

    score = (MLP(h_cls) - 0.16717362830052426) / 1.0333394966054072

h_cls is the [CLS] state of BLIP's BERT-base text encoder ("MED") run in encoder mode over the
prompt, with cross-attention in every layer to all tokens of BLIP's ViT-L/16 image encoder (224 px,
197 tokens, the final LayerNorm applied). The MLP is 768 -> 1024 -> 128 -> 64 -> 16 -> 1 with
dropout 0.2, 0.2, 0.1 and no activations: the same layout as the LAION aesthetic head, so
`AestheticHead` is reused; it runs in float32 on `h_cls.float()` as the reference does. The output
is a z-score (typically -2..2), meant to rank images of one prompt.

Reference recipe (THUDM/ImageReward `ImageReward.score` / `inference_rank`):
- image: resize the shorter side to 224 (bicubic; long side int(224 * long / short)), centre crop
  224 (torchvision offsets: int(round((size - 224) / 2))), RGB, ToTensor, OpenAI CLIP mean/std;
- text: BLIP's `bert-base-uncased` BertTokenizer with [DEC] (bos) and [ENC] added (30,524 ids),
  padding="max_length", truncation, max_length=35: longer prompts are cut at 35 tokens; the first
  token stays [CLS] (ImageReward does not swap in [ENC]);
- fp32; the reference scores one image at a time, here images are batched.

Modules: transformers `BlipVisionModel` (BLIP's ViT: LayerNorm eps 1e-6, fused qkv with bias,
exact GELU) and `BlipTextModel(add_pooling_layer=False)`, the MED encoder that
`BlipForImageTextRetrieval` uses: built with cross-attention layers (config.is_decoder=True is
what makes transformers create them) and called with is_decoder=False (bidirectional self-attention),
as MED's `mode='multimodal'` encoder. The official `ImageReward.pt` (a state dict; read with
torch.load(weights_only=True)) is mapped key by key onto these modules, strictly: every module
weight must come from the file; only BLIP's unused `vision_proj` / `text_proj` and MED's
`position_ids` buffer are dropped. `save_pretrained` writes config.json + model.safetensors +
the tokenizer, which loads back without the .pt.

What the real weights need: `ImageReward.pt` (hub repo THUDM/ImageReward, a local directory or
the file) and the `bert-base-uncased` tokenizer (hub id or a local directory). `med_config.json`
is optional: sizes are read off the checkpoint's tensors, attention heads from med_config.json when
present, else width / 64 (true of every published BLIP tower).
Not verified here: parity with the `image-reward` package on real weights (no hub access;
a GPU parity check against that package is the missing piece).
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

import torch
from PIL import Image
from torch import nn

from .aesthetic import AestheticHead
from .base import Pretrained, Scorer
from .encoders import PREPROCESS_MODES
from .images import ImageBatch, pil_to_tensor
from .placement import ModelPlacement
from .state_dicts import read_state_dict
from .preprocess import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD
from .registry import register

IMAGEREWARD_REPO = "THUDM/ImageReward"
IMAGEREWARD_FILE = "ImageReward.pt"
MED_CONFIG_FILE = "med_config.json"
BERT_TOKENIZER = "bert-base-uncased"
IMAGEREWARD_MEAN = 0.16717362830052426
IMAGEREWARD_STD = 1.0333394966054072
IMAGEREWARD_MAX_LENGTH = 35
IMAGEREWARD_IMAGE_SIZE = 224
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


# --- tokenizer and preprocessing --------------------------------------------------------------


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


def center_crop_offset(length: int, crop: int) -> int:
    """torchvision's CenterCrop offset: int(round((length - crop) / 2)) (round half to even)."""
    return int(round((length - crop) / 2.0))


def shorter_side_size(height: int, width: int, size: int) -> tuple[int, int]:
    """Resize(size) on the shorter side, as torchvision computes it: the long side is int()-floored."""
    return (size, int(size * width / height)) if height <= width else (int(size * height / width), size)


def imagereward_preprocess_pil(image: Image.Image, size: int = IMAGEREWARD_IMAGE_SIZE) -> torch.Tensor:
    """The reference transform on one PIL image, with PIL only (what torchvision does on PIL input):
    Resize(size, BICUBIC) on the shorter side, CenterCrop(size), RGB, ToTensor, Normalize."""
    w, h = image.size
    new_h, new_w = shorter_side_size(h, w, size)
    if (new_h, new_w) != (h, w):
        image = image.resize((new_w, new_h), Image.BICUBIC)
    top, left = center_crop_offset(new_h, size), center_crop_offset(new_w, size)
    x = pil_to_tensor(image.crop((left, top, left + size, top + size)).convert("RGB"))
    return (x - torch.tensor(OPENAI_CLIP_MEAN)[:, None, None]) / torch.tensor(OPENAI_CLIP_STD)[:, None, None]


def imagereward_preprocess_tensor(x: torch.Tensor, size: int = IMAGEREWARD_IMAGE_SIZE) -> torch.Tensor:
    """Float [B,3,H,W] in [0,1] -> [B,3,size,size], the same steps on the tensor; differentiable."""
    import torch.nn.functional as F

    x = x.clamp(0, 1)
    new_h, new_w = shorter_side_size(x.shape[-2], x.shape[-1], size)
    h, w = x.shape[-2:]
    if (new_h, new_w) != (h, w):
        x = F.interpolate(x, size=(new_h, new_w), mode="bicubic", align_corners=False, antialias=True).clamp(0, 1)
    top, left = center_crop_offset(new_h, size), center_crop_offset(new_w, size)
    x = x[..., top : top + size, left : left + size]
    mean = torch.tensor(OPENAI_CLIP_MEAN, dtype=x.dtype, device=x.device)[:, None, None]
    std = torch.tensor(OPENAI_CLIP_STD, dtype=x.dtype, device=x.device)[:, None, None]
    return (x - mean) / std


# --- the scorer ---------------------------------------------------------------------------------


class ImageReward(ModelPlacement, Pretrained, Scorer):
    """ImageReward v1.0: (MLP(BLIP [CLS]) - mean) / std."""

    name = "imagereward"
    requires_prompts = True
    differentiable = True

    def __init__(
        self,
        model: ImageRewardModel,
        tokenizer,
        *,
        device="auto",
        dtype="float32",
        preprocess: str = "tensor",
        max_length: int = IMAGEREWARD_MAX_LENGTH,
        batch_size: int = 32,
        key: str | None = None,
    ):
        if preprocess not in PREPROCESS_MODES:
            raise ValueError(f"preprocess must be one of {PREPROCESS_MODES}, got {preprocess!r}")
        super().__init__(batch_size=batch_size, key=key)
        self.model = model.eval().requires_grad_(False)
        self.tokenizer, self.preprocess, self.max_length = tokenizer, preprocess, int(max_length)
        if len(tokenizer) > model.text.config.vocab_size:
            raise ValueError(f"tokenizer has {len(tokenizer)} ids, the text encoder {model.text.config.vocab_size}")
        self.image_size = int(model.vision.config.image_size)
        self.to(device, dtype)

    def to(self, device=None, dtype=None):
        super().to(device, dtype)
        self.model.head.to(dtype=torch.float32)  # the reference MLP runs on h_cls.float()
        return self

    def save_pretrained(self, path: str | Path) -> None:
        from safetensors.torch import save_file

        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        (path / "config.json").write_text(json.dumps(self.model.config_dict(), indent=2))
        save_file(
            {k: v.detach().float().cpu().contiguous() for k, v in self.model.state_dict().items()},
            str(path / "model.safetensors"),
        )
        self.tokenizer.save_pretrained(path)

    def pixel_values(self, images: ImageBatch) -> torch.Tensor:
        if self.preprocess == "pil":
            if images.requires_grad:
                raise ValueError("preprocess='pil' goes through uint8 and is not differentiable; use 'tensor'")
            pixels = torch.stack([imagereward_preprocess_pil(im, self.image_size) for im in images.pil()])
        elif images.uniform:
            pixels = imagereward_preprocess_tensor(images.tensor().to(self.device, torch.float32), self.image_size)
        else:
            pixels = torch.cat(
                [
                    imagereward_preprocess_tensor(t[None].to(self.device, torch.float32), self.image_size)
                    for t in images.tensors()
                ]
            )
        return pixels.to(device=self.device, dtype=self.dtype)

    def tokens(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        out = self.tokenizer(
            prompts, padding="max_length", truncation=True, max_length=self.max_length, return_tensors="pt"
        )
        return {"input_ids": out["input_ids"].to(self.device), "attention_mask": out["attention_mask"].to(self.device)}

    def score_batch(self, images, prompts, metadata):
        tokens = self.tokens(prompts)
        with torch.set_grad_enabled(images.requires_grad and torch.is_grad_enabled()):
            raw = self.model(self.pixel_values(images), tokens["input_ids"], tokens["attention_mask"])
        return {self.key: (raw - IMAGEREWARD_MEAN) / IMAGEREWARD_STD}


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


def convert_imagereward_checkpoint(
    src: str | Path, dst: str | Path, *, tokenizer: str = BERT_TOKENIZER, local_files_only: bool = False
) -> None:
    """One-off: the official ImageReward.pt (+ tokenizer) -> a directory of safetensors + JSON."""
    net, tok = load_imagereward(str(src), tokenizer=tokenizer, local_files_only=local_files_only)
    ImageReward(net, tok, device="cpu").save_pretrained(dst)


@register("imagereward")
def build_imagereward(
    *,
    model: str = IMAGEREWARD_REPO,
    tokenizer: str | None = None,
    tiny: bool = False,
    device: str = "auto",
    dtype: str = "float32",
    preprocess: str = "tensor",
    max_length: int = IMAGEREWARD_MAX_LENGTH,
    batch_size: int = 32,
    local_files_only: bool = False,
    revision: str | None = None,
    key: str | None = None,
) -> ImageReward:
    """ImageReward v1.0 (BLIP ViT-L + MED + MLP, z-scored); model = hub id, ImageReward.pt, or a converted dir."""
    if tiny:
        tok = tiny_bert_tokenizer()
        text = dict(
            TINY_TEXT_CONFIG,
            vocab_size=len(tok),
            bos_token_id=tok.bos_token_id,
            sep_token_id=tok.sep_token_id,
            eos_token_id=tok.sep_token_id,
        )
        net = ImageRewardModel.from_dicts(TINY_VISION_CONFIG, text)
        with torch.random.fork_rng(devices=[]):  # unit-gain head, so tiny scores spread visibly
            torch.manual_seed(0)
            for layer in net.head.layers:
                if isinstance(layer, nn.Linear):
                    nn.init.normal_(layer.weight, std=layer.in_features**-0.5)
    else:
        net, tok = load_imagereward(model, tokenizer=tokenizer, local_files_only=local_files_only, revision=revision)
    return ImageReward(
        net,
        tok,
        device=device,
        dtype=dtype,
        preprocess=preprocess,
        max_length=max_length,
        batch_size=batch_size,
        key=key,
    )
