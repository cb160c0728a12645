"""Offline preference pairs for Diffusion-DPO: a .jsonl file, one pair a line, encoded by the VAE once.

    {"prompt": "a red apple", "chosen": "img/apple_good.png", "rejected": "img/apple_bad.png"}

Image paths are relative to the .jsonl file's folder (absolute paths are kept). A line that is not JSON, lacks a
field, or names a missing / unreadable image fails the run before any training with one line naming file:line.
Images are resized to the sampler's height x width (bicubic), encoded with the VAE's mode (no sampling), scaled
and shifted as the adapter's decode expects, and kept in memory on the CPU: [N, C, h, w] per side.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ..config import ConfigError


@dataclass(frozen=True)
class PreferencePair:
    prompt: str
    chosen: Path
    rejected: Path
    where: str  # "file:line", for errors


def load_pairs(path: str | Path) -> list[PreferencePair]:
    """The pairs of a .jsonl file; every image path resolved and checked to exist."""
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"dpo.data: preference file '{path}' does not exist")
    root = file.parent
    pairs = []
    for n, line in enumerate(file.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{n}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise ConfigError(f"{where}: not JSON ({err})") from None
        if not isinstance(row, dict) or not all(isinstance(row.get(k), str) and row[k] for k in FIELDS):
            raise ConfigError(f"{where}: needs non-empty string fields {', '.join(FIELDS)}")
        sides = []
        for key in ("chosen", "rejected"):
            image = Path(row[key]) if Path(row[key]).is_absolute() else root / row[key]
            if not image.is_file():
                raise ConfigError(f"{where}: {key} image '{row[key]}' not found (looked for {image})")
            sides.append(image)
        pairs.append(PreferencePair(row["prompt"], sides[0], sides[1], where))
    if not pairs:
        raise ConfigError(f"dpo.data: '{path}' holds no pairs")
    return pairs


FIELDS = ("prompt", "chosen", "rejected")


def read_image(path: Path, where: str, height: int, width: int) -> Tensor:
    """[3, height, width] float32 in [0, 1]; an unreadable file is a ConfigError naming file:line."""
    from PIL import Image

    try:
        with Image.open(path) as im:
            rgb = im.convert("RGB").resize((width, height), Image.BICUBIC)
    except (OSError, ValueError) as err:
        raise ConfigError(f"{where}: cannot read image '{path}' ({err})") from None
    data = torch.frombuffer(bytearray(rgb.tobytes()), dtype=torch.uint8).view(height, width, 3)
    return data.permute(2, 0, 1).float() / 255.0


def _vae_layout(adapter: Any) -> bool:
    """Whether the adapter's latents are the VAE's own layout (its decode is the base one: sd3, flux, sd15)."""
    from pipelines.adapters.base import Adapter

    return type(adapter)._decode is Adapter._decode


@torch.no_grad()
def encode_images(adapter: Any, images: Tensor, batch: int = 8) -> Tensor:
    """VAE latents of images [N, 3, H, W] in [0, 1]: the inverse of the adapter's decode (mode of the posterior)."""
    if not _vae_layout(adapter):
        raise ConfigError(
            f"dpo.data: offline pairs are encoded for families whose latents are the VAE's layout (sd3, flux, "
            f"sd15); '{getattr(adapter, 'family', type(adapter).__name__)}' packs its own"
        )
    vae = adapter.vae
    cfg = vae.config
    shift = getattr(cfg, "shift_factor", None) or 0.0
    out = []
    for chunk in images.split(batch):
        x = (chunk * 2 - 1).to(device=vae.device, dtype=vae.dtype)
        z = vae.encode(x).latent_dist.mode()
        out.append(((z.float() - shift) * cfg.scaling_factor).cpu())
    return torch.cat(out)


@dataclass
class EncodedPairs:
    prompts: list[str]
    chosen: Tensor  # [N, C, h, w] float32, CPU
    rejected: Tensor

    def __len__(self) -> int:
        return len(self.prompts)


def encode_pairs(adapter: Any, pairs: list[PreferencePair], height: int, width: int) -> EncodedPairs:
    chosen = torch.stack([read_image(p.chosen, p.where, height, width) for p in pairs])
    rejected = torch.stack([read_image(p.rejected, p.where, height, width) for p in pairs])
    return EncodedPairs([p.prompt for p in pairs], encode_images(adapter, chosen), encode_images(adapter, rejected))
