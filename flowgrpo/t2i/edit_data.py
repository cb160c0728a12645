"""Image-conditioned prompt rows (image editing) and the grids that show source | edit.

A .jsonl row names its input image(s):

    {"prompt": "make the sky pink", "images": ["photos/beach.png"], "any": "metadata"}
    {"instruction": "put the cat from picture 2 on the sofa of picture 1", "images": ["sofa.png", "cat.png"]}

`prompt` or `instruction` is the text; `images` (or `image`, one path) are paths relative to the .jsonl file. Every
image is read when the prompt file loads, converted to RGB and brought to the configured sampler height x width
with diffusers' VaeImageProcessor, as the pipelines do: `data.image_resize` "resize" (the pipelines' default: a
plain resize, the aspect ratio may change), "crop" (resize to cover, then a centre crop: no distortion) or "exact"
(an image of another size is an error). A missing, unreadable or (with "exact") wrong-size image stops the run
before any model loads with one line naming the row (file:line).

The row's prompt becomes an `EditPrompt` (a str carrying the images; the editing adapters read them) and its
metadata gains:
- "source_images": the row's images as uint8 tensors [3, H, W] (CPU, the same tensors the model was conditioned
  on), a list per row. The reward stage repeats a row's metadata for each of its images, so a scorer receives
  metadata["source_images"][i] = the list of source images of generated image i.
- "images": the resolved paths (strings).
Rows are held in memory once loaded: N rows x H x W x 3 bytes per image (1,000 rows at 512 px: 0.8 GB).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch

from ..config import ConfigError

SOURCE_KEY = "source_images"
IMAGE_RESIZE = ("resize", "crop", "exact")


@dataclass(frozen=True)
class ImageSpec:
    """The size every source image is brought to (the sampler's height x width) and how."""

    height: int
    width: int
    resize: str = "resize"


def text_of(row: dict[str, Any]) -> Any:
    """The row's text: "prompt", else "instruction" (popped from the row)."""
    text = row.pop("prompt", None)
    return row.pop("instruction", None) if text is None else text


def names_images(row: dict[str, Any]) -> bool:
    return "images" in row or "image" in row


def edit_prompt(text: str, row: dict[str, Any], file: Path, line: int, what: str, spec: ImageSpec | None) -> Any:
    """The row's EditPrompt; its metadata gains "source_images" (uint8 [3, H, W] tensors) and resolved "images"."""
    from pipelines.adapters.editing import EditPrompt

    where = f"{what}: {file}:{line}"
    names = [row.pop("image")] if "image" in row else row.pop("images")
    if "images" in row:
        raise ConfigError(f"{where}: give either 'image' or 'images', not both")
    if not isinstance(names, list) or not names or not all(isinstance(n, str) and n for n in names):
        raise ConfigError(f"{where}: 'images' must be a non-empty list of paths (relative to the .jsonl file)")
    if spec is None:
        raise ConfigError(f"{where}: the row names input images, but this prompt set takes none")
    paths = [file.parent / n for n in names]
    images = [load_image(p, where, spec) for p in paths]
    prompt = EditPrompt(text, images)
    row["images"] = [str(p) for p in paths]
    row[SOURCE_KEY] = list(prompt.images)  # the very tensors the model is conditioned on
    return prompt


def load_image(path: Path, where: str, spec: ImageSpec) -> torch.Tensor:
    """One source image as uint8 [3, H, W] at spec's size; ConfigError naming `where` when it cannot be."""
    import numpy as np
    from diffusers.image_processor import VaeImageProcessor
    from PIL import Image

    if not path.is_file():
        raise ConfigError(f"{where}: image '{path}' does not exist")
    try:
        with Image.open(path) as opened:
            opened.load()
            image = opened.convert("RGB")
    except (OSError, ValueError, Image.DecompressionBombError) as err:
        raise ConfigError(f"{where}: image '{path}' cannot be read ({type(err).__name__}: {err})") from None
    h, w = spec.height, spec.width
    if image.size != (w, h):
        if spec.resize == "exact":
            raise ConfigError(
                f"{where}: image '{path}' is {image.width}x{image.height} px; data.image_resize 'exact' needs "
                f"{w}x{h} (the sampler's width x height), or set image_resize: resize | crop"
            )
        mode = "crop" if spec.resize == "crop" else "default"
        image = VaeImageProcessor(vae_scale_factor=1).resize(image, h, w, resize_mode=mode)
    return torch.from_numpy(np.asarray(image).copy()).permute(2, 0, 1).contiguous()


def check_family(prompts: Sequence[str], family: str, what: str = "data") -> None:
    """An editing family (an EditAdapter: also wan2.2_i2v, whose image is the first frame) needs every row to name its
    images; the others take none."""
    from pipelines.adapters import ADAPTERS
    from pipelines.adapters.editing import EditAdapter, EditPrompt

    cls = ADAPTERS.get(family)
    if cls is None:
        return  # an unknown family: build_adapter names the valid ones
    edits = issubclass(cls, EditAdapter)
    with_images = sum(isinstance(p, EditPrompt) for p in prompts)
    if edits and with_images < len(prompts):
        row, text = next((i, p) for i, p in enumerate(prompts, 1) if not isinstance(p, EditPrompt))
        raise ConfigError(
            f"{what}: model family '{family}' edits images: every prompt row needs 'images' (a .jsonl file with "
            f'{{"prompt": ..., "images": [paths]}}); {len(prompts) - with_images} of {len(prompts)} rows name none '
            f"(the first: row {row}, {str(text)[:60]!r})"
        )
    if not edits and with_images:
        takers = sorted(name for name, c in ADAPTERS.items() if issubclass(c, EditAdapter))
        raise ConfigError(
            f"{what}: {with_images} prompt rows name input images, but model family '{family}' does not edit "
            f"images ({', '.join(takers)} do)"
        )


def with_sources(images: torch.Tensor, prompts: Sequence[str], per_row: int) -> tuple[torch.Tensor, int]:
    """Grid rows source(s) | edits: `images` [P * per_row, 3, H, W] (row p = prompts[p]'s images) -> the images with
    each row's source images first (black where a row has fewer than the most), and the new row length. Prompts
    without images leave the grid as it was."""
    from pipelines.adapters.editing import EditPrompt

    rows = images.shape[0] // per_row
    sources = [list(p.images) if isinstance(p, EditPrompt) else [] for p in prompts[:rows]]
    k = max((len(s) for s in sources), default=0)
    if k == 0:
        return images, per_row
    size = images.shape[2:]
    out = []
    for r, srcs in enumerate(sources):
        for s in srcs:
            s = s.float()[None] / 255.0
            if tuple(s.shape[2:]) != tuple(size):
                s = torch.nn.functional.interpolate(s, size=tuple(size), mode="bilinear", align_corners=False)
            out.append(s[0].to(images.dtype))
        out += [images.new_zeros(images.shape[1:])] * (k - len(srcs))
        out += list(images[r * per_row : (r + 1) * per_row])
    return torch.stack(out), per_row + k
