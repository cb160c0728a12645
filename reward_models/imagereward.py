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

Model, checkpoint mapping, tokenizer and loading: reward_models.imagereward_model.

Not verified here: parity with the `image-reward` package on real weights (no hub access;
a GPU parity check against that package is the missing piece).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from PIL import Image
from torch import nn

from .base import Pretrained, Scorer
from .encoders import PREPROCESS_MODES
from .images import ImageBatch, pil_to_tensor
from .imagereward_model import (
    BERT_TOKENIZER,
    IMAGEREWARD_REPO,
    TINY_TEXT_CONFIG,
    TINY_VISION_CONFIG,
    ImageRewardModel,
    load_imagereward,
    tiny_bert_tokenizer,
)
from .placement import ModelPlacement
from .preprocess import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD
from .registry import register

IMAGEREWARD_MEAN = 0.16717362830052426
IMAGEREWARD_STD = 1.0333394966054072
IMAGEREWARD_MAX_LENGTH = 35
IMAGEREWARD_IMAGE_SIZE = 224


# --- preprocessing ---------------------------------------------------------------------------


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
