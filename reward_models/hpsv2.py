"""HPSv2 / HPSv2.1: human preference score on an OpenCLIP ViT-H/14 (the HPSv2 paper and release).

score = cos(image, text) = <f_img / |f_img|, f_txt / |f_txt|>, the published recipe: the model's
L2-normalised image and text features, dotted, with no logit scale. Range [-1, 1]; typical 0.20-0.35
(papers report x100). Scores compare images of the same prompt (HPSv2 issue #9).

Weights: `HPS_v2_compressed.pt` (version "v2.0") or `HPS_v2.1_compressed.pt` ("v2.1", what DanceGRPO
and Flow-GRPO train with) from the hub repo `xswu/HPSv2`, a local directory holding them, or a
local file (.pt with a 'state_dict', a bare state dict, or .safetensors). The file holds every
weight: the architecture is built locally (random init, no 'laion2B-s32B-b79K' download, unlike
the reference) and the file is loaded strictly. `.pt` files are read with
torch.load(weights_only=True): tensors only.

Preprocessing (the reference `preprocess_val`): resize so the LONGER side is 224 (bicubic, aspect
kept), pad to 224x224 centred with black, OpenAI CLIP mean/std. Two paths: "tensor" (default;
differentiable, on the model's device) and "pil" (open_clip's own transform on uint8 PIL images,
the reference). Text: open_clip's CLIP BPE tokenizer (bundled with open_clip), 77 tokens.
The reference runs under fp16 autocast; `dtype` casts the weights instead, scores are float32.
open_clip needs torchvision; on a CPU torch `import reward_models` installs the import fix
(torchvision_cpu_hook.py) before open_clip is imported here.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

import torchvision_cpu_hook  # noqa: F401  (torchvision on a CPU torch, before open_clip)
from .encoders import Backbone, EmbeddingScorer
from .images import ImageBatch
from .state_dicts import read_state_dict
from .preprocess import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD
from .registry import register

HPS_REPO = "xswu/HPSv2"
HPS_FILES = {"v2.0": "HPS_v2_compressed.pt", "v2.1": "HPS_v2.1_compressed.pt"}
HPS_ARCH = "ViT-H-14"  # open_clip architecture of every HPSv2 checkpoint
HPS_IMAGE_SIZE = 224
HPS_INTERPOLATION = "bicubic"
HPS_RESIZE_MODE = "longest"  # resize the longer side, then pad (open_clip's ResizeMaxSize)
HPS_FILL = 0  # padding colour (black, before normalisation)

# A tiny open_clip architecture for tests and demos: the real CLIP BPE vocabulary (49,408 tokens)
# so open_clip's own tokenizer works, 32 px images, 2+2 layers of width 32.
TINY_ARCH = "reward-models-tiny-clip"
TINY_CONFIG = {
    "embed_dim": 16,
    "vision_cfg": {"image_size": 32, "layers": 2, "width": 32, "head_width": 16, "patch_size": 8},
    "text_cfg": {"context_length": 16, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 2},
}
_TOKENIZERS: dict[str, object] = {}


def import_open_clip():
    try:
        import open_clip
    except ImportError as err:
        raise ImportError(
            "hpsv2 needs open_clip: pip install 'open-clip-torch>=3' torchvision (CPU: with -c constraints-cpu.txt)"
        ) from err
    return open_clip


def register_tiny_open_clip() -> str:
    """Register TINY_ARCH with open_clip (a JSON config in a temporary folder); returns its name."""
    open_clip = import_open_clip()
    if TINY_ARCH not in open_clip.list_models():
        folder = Path(tempfile.mkdtemp(prefix="reward_models_open_clip_"))
        path = folder / f"{TINY_ARCH}.json"
        path.write_text(json.dumps(TINY_CONFIG))
        open_clip.add_model_config(path)
    return TINY_ARCH


def open_clip_tokenizer(arch: str):
    """open_clip's tokenizer for `arch` (the bundled CLIP BPE for ViT-H-14), cached per process."""
    if arch not in _TOKENIZERS:
        _TOKENIZERS[arch] = import_open_clip().get_tokenizer(arch)
    return _TOKENIZERS[arch]


def hps_reference_transform(image_size: int = HPS_IMAGE_SIZE):
    """open_clip's evaluation transform with the HPS settings (PIL in, normalised tensor out)."""
    return import_open_clip().image_transform(
        image_size,
        is_train=False,
        mean=OPENAI_CLIP_MEAN,
        std=OPENAI_CLIP_STD,
        resize_mode=HPS_RESIZE_MODE,
        interpolation=HPS_INTERPOLATION,
        fill_color=HPS_FILL,
    )


def longest_side_size(height: int, width: int, size: int) -> tuple[int, int]:
    """Size after resizing the longer side to `size`, aspect kept, rounded as open_clip does."""
    ratio = max(height, width) / size
    return round(height / ratio), round(width / ratio)


def hps_preprocess_tensor(x: torch.Tensor, size: int = HPS_IMAGE_SIZE) -> torch.Tensor:
    """Float [B,3,H,W] in [0,1] -> [B,3,size,size]: longer side to `size` (bicubic, antialiased,
    clamped as the uint8 reference is), black padding centred (extra pixel right/bottom), then
    OpenAI CLIP mean/std. Differentiable."""
    x = x.clamp(0, 1)
    h, w = longest_side_size(x.shape[-2], x.shape[-1], size)
    if (h, w) != tuple(x.shape[-2:]):
        x = F.interpolate(x, size=(h, w), mode="bicubic", align_corners=False, antialias=True).clamp(0, 1)
    pad_h, pad_w = size - h, size - w
    x = F.pad(x, (pad_w // 2, pad_w - pad_w // 2, pad_h // 2, pad_h - pad_h // 2), value=float(HPS_FILL))
    mean = torch.tensor(OPENAI_CLIP_MEAN, dtype=x.dtype, device=x.device)[:, None, None]
    std = torch.tensor(OPENAI_CLIP_STD, dtype=x.dtype, device=x.device)[:, None, None]
    return (x - mean) / std


def resolve_hps_checkpoint(
    model: str, version: str, *, local_files_only: bool = False, revision: str | None = None
) -> str:
    """A local file, a local directory holding the version's file, or a hub repo id -> a file path."""
    if version not in HPS_FILES:
        raise ValueError(f"hpsv2 version must be one of {sorted(HPS_FILES)}, got {version!r}")
    if os.path.isfile(model):
        return model
    if os.path.isdir(model):
        path = os.path.join(model, HPS_FILES[version])
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{model} has no {HPS_FILES[version]} (hpsv2 version {version})")
        return path
    if model.startswith((".", "/", "~")) or model.count("/") != 1 or model.endswith((".pt", ".safetensors")):
        raise FileNotFoundError(
            f"hpsv2 checkpoint {model} does not exist (expected a file, a directory "
            f"holding {HPS_FILES[version]}, or a hub repo id)"
        )
    from huggingface_hub import hf_hub_download

    return hf_hub_download(model, HPS_FILES[version], revision=revision, local_files_only=local_files_only)


def convert_hps_checkpoint(src: str | Path, dst: str | Path) -> None:
    """One-off conversion of a released HPS .pt to safetensors (tensors only, no pickle)."""
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in read_state_dict(src).items()}, str(dst))


class _DropRecords(logging.Filter):
    def __init__(self, prefix: str):
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefix)


class OpenClipBackbone(Backbone):
    """An open_clip CLIP + its tokenizer with HPS preprocessing, one device and one dtype."""

    def __init__(
        self,
        model,
        tokenizer,
        *,
        image_size: int | None = None,
        device="auto",
        dtype="float32",
        preprocess: str = "tensor",
    ):
        self.tokenizer = tokenizer
        size = image_size or model.visual.image_size
        self.image_size = int(size[0] if isinstance(size, (tuple, list)) else size)
        self._reference = None
        super().__init__(model, device=device, dtype=dtype, preprocess=preprocess)

    @classmethod
    def build(cls, arch: str, state: dict[str, torch.Tensor] | None = None, *, seed: int = 0, **kwargs):
        """open_clip architecture `arch` with random weights (seeded), then `state` loaded strictly."""
        open_clip = import_open_clip()
        quiet = _DropRecords("No pretrained weights loaded")  # weights come next, from the HPS file
        logging.getLogger().addFilter(quiet)
        try:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                model = open_clip.create_model(arch, pretrained=None, precision="fp32", device="cpu", output_dict=True)
        finally:
            logging.getLogger().removeFilter(quiet)
        if state is not None:
            result = model.load_state_dict(state, strict=False)
            if result.missing_keys or result.unexpected_keys:
                raise ValueError(
                    f"checkpoint does not fit open_clip '{arch}': missing {result.missing_keys[:5]} "
                    f"({len(result.missing_keys)}), unexpected {result.unexpected_keys[:5]} "
                    f"({len(result.unexpected_keys)})"
                )
        return cls(model, open_clip_tokenizer(arch), **kwargs)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().float().cpu().contiguous() for k, v in self.model.state_dict().items()}

    def pil_pixels(self, images: list) -> torch.Tensor:
        if self._reference is None:
            self._reference = hps_reference_transform(self.image_size)
        return torch.stack([self._reference(im) for im in images])

    def tensor_pixels(self, images: ImageBatch) -> torch.Tensor:
        if images.uniform:
            return hps_preprocess_tensor(images.tensor().to(self.device, torch.float32), self.image_size)
        return torch.cat(
            [hps_preprocess_tensor(t[None].to(self.device, torch.float32), self.image_size) for t in images.tensors()]
        )

    def encode_image(self, pixels: torch.Tensor) -> torch.Tensor:
        return self.model.encode_image(pixels)

    def encode_text(self, prompts: list[str]) -> torch.Tensor:
        return self.model.encode_text(self.tokenizer(prompts).to(self.device))


class HPSv2(EmbeddingScorer):
    """HPSv2 / HPSv2.1: cos(image, text) of the fine-tuned OpenCLIP ViT-H/14, no logit scale."""

    name = "hpsv2"
    requires_prompts = True

    def score_batch(self, images, prompts, metadata):
        return {self.key: self.text_image_cosine(images, prompts)}


@register("hpsv2")
def build_hpsv2(
    *,
    model: str = HPS_REPO,
    version: str = "v2.1",
    arch: str = HPS_ARCH,
    tiny: bool = False,
    device: str = "auto",
    dtype: str = "float32",
    preprocess: str = "tensor",
    batch_size: int = 32,
    local_files_only: bool = False,
    revision: str | None = None,
    key: str | None = None,
) -> HPSv2:
    """HPSv2 (version v2.0) / HPSv2.1 (v2.1): cosine on an OpenCLIP ViT-H/14; model = hub id, dir or file."""
    if version not in HPS_FILES:  # checked before any download
        raise ValueError(f"hpsv2 version must be one of {sorted(HPS_FILES)}, got {version!r}")
    options = dict(device=device, dtype=dtype, preprocess=preprocess)
    if tiny:
        backbone = OpenClipBackbone.build(register_tiny_open_clip(), **options)
    else:
        path = resolve_hps_checkpoint(model, version, local_files_only=local_files_only, revision=revision)
        backbone = OpenClipBackbone.build(arch, read_state_dict(path), **options)
    return HPSv2(backbone, batch_size=batch_size, key=key)
