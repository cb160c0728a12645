"""ImageBatch: the one input type every scorer sees.

Callers hand over a float tensor [B,3,H,W] in [0,1] (what decoders produce) or a list of PIL
images. Conversions are computed once per batch and shared by every scorer of a MultiReward: the
uint8/PIL form uses the rounding rule of every reference implementation, round(x*255) then clamp.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch
from PIL import Image


class ImageBatch:
    """A batch of RGB images, as a tensor, a list of PIL images, or both (cached)."""

    def __init__(self, images: torch.Tensor | Sequence[Image.Image]):
        self._tensor: torch.Tensor | None = None
        self._pil: list[Image.Image] | None = None
        self._parent: tuple[ImageBatch, slice] | None = None
        self._finite: torch.Tensor | None = None  # finite(), computed once
        if isinstance(images, torch.Tensor):
            self._tensor = _check_tensor(images)
        elif isinstance(images, (list, tuple)) and all(isinstance(i, Image.Image) for i in images):
            # convert("RGB") drops alpha and expands greyscale, as CLIP processors do.
            self._pil = [im if im.mode == "RGB" else im.convert("RGB") for im in images]
        else:
            raise TypeError(
                f"images must be a float tensor [B,3,H,W] in [0,1] or a list of PIL images, got {type(images).__name__}"
            )

    @classmethod
    def of(cls, images) -> "ImageBatch":
        return images if isinstance(images, ImageBatch) else cls(images)

    def __len__(self) -> int:
        return len(self._tensor) if self._tensor is not None else len(self._pil)

    def __getitem__(self, index: slice) -> "ImageBatch":
        if not isinstance(index, slice):
            raise TypeError("ImageBatch supports slices only")
        out = ImageBatch.__new__(ImageBatch)
        out._tensor = None if self._tensor is None else self._tensor[index]
        out._pil = None if self._pil is None else self._pil[index]
        # A micro-batch asks its parent for PIL images, so the whole batch is converted once and
        # every scorer of a MultiReward reuses it.
        out._parent = (self, index)
        out._finite = None
        return out

    @property
    def device(self) -> torch.device:
        return self._tensor.device if self._tensor is not None else torch.device("cpu")

    @property
    def requires_grad(self) -> bool:
        return self._tensor is not None and self._tensor.requires_grad

    @property
    def uniform(self) -> bool:
        """True when every image has the same size (so one 4-D tensor can hold them)."""
        if self._tensor is not None:
            return True
        return len({im.size for im in self._pil}) <= 1

    def tensor(self) -> torch.Tensor:
        """Float [B,3,H,W] in [0,1]; keeps the autograd graph of a tensor input."""
        if self._tensor is None:
            if not self.uniform:
                raise ValueError("images differ in size; use tensors() for a per-image list")
            self._tensor = torch.stack(self.tensors())
        return self._tensor

    def tensors(self) -> list[torch.Tensor]:
        """Per-image float [3,H,W] tensors (sizes may differ for PIL input)."""
        if self._tensor is not None:
            return list(self._tensor.unbind(0))
        return [pil_to_tensor(im) for im in self._pil]

    def pil(self) -> list[Image.Image]:
        """RGB PIL images via round(x*255).clamp(0,255): the uint8 hand-off of the references."""
        if self._pil is None:
            if self._parent is not None:
                parent, index = self._parent
                self._pil = parent.pil()[index]
            else:
                self._pil = [Image.fromarray(a) for a in to_uint8_hwc(self._tensor)]
        return self._pil

    def finite(self) -> torch.Tensor:
        """Bool [B] on CPU: False where an image holds NaN/inf pixels (it cannot be scored)."""
        if self._tensor is None:
            return torch.ones(len(self), dtype=torch.bool)
        if self._finite is None:  # read twice per scorer call (the mask, `sanitized`)
            self._finite = torch.isfinite(self._tensor.detach()).flatten(1).all(1).cpu()
        return self._finite

    def sanitized(self) -> "ImageBatch":
        """Non-finite images replaced by black so a batched forward stays finite; the caller
        marks those rows NaN afterwards. torch.where keeps the gradient of the finite ones."""
        if self._tensor is None:
            return self
        ok = self.finite().to(self._tensor.device)
        if bool(ok.all()):
            return self
        x = torch.where(ok[:, None, None, None], self._tensor, torch.zeros_like(self._tensor))
        return ImageBatch(x)


def _check_tensor(x: torch.Tensor) -> torch.Tensor:
    if x.ndim != 4 or x.shape[1] != 3:
        raise ValueError(f"image tensor must be [B,3,H,W], got shape {tuple(x.shape)}")
    if x.dtype == torch.uint8:
        return x.float() / 255.0  # unambiguous, so accepted
    if not x.is_floating_point():
        raise TypeError(f"image tensor must be float in [0,1] (or uint8), got {x.dtype}")
    return x


def to_uint8_hwc(x: torch.Tensor) -> np.ndarray:
    """[B,3,H,W] float in [0,1] -> uint8 [B,H,W,3] numpy, round(x*255) then clamp."""
    x = torch.nan_to_num(x.detach().float(), nan=0.0)  # NaN images are masked by the caller
    u8 = (x * 255).round().clamp(0, 255).to(torch.uint8)
    return u8.permute(0, 2, 3, 1).cpu().numpy()


def pil_to_tensor(im: Image.Image) -> torch.Tensor:
    """RGB PIL -> float [3,H,W] in [0,1]."""
    a = np.asarray(im.convert("RGB"), dtype=np.uint8)
    return torch.from_numpy(a.copy()).permute(2, 0, 1).float() / 255.0


def as_image_list(value) -> list[torch.Tensor | Image.Image]:
    """A metadata value holding images (one PIL, [3,H,W], [K,3,H,W], or a list) -> flat list."""
    if value is None:
        return []
    if isinstance(value, Image.Image):
        return [value]
    if isinstance(value, torch.Tensor):
        if value.ndim == 3:
            return [value]
        if value.ndim == 4:
            return list(value.unbind(0))
        raise ValueError(f"reference image tensor must be [3,H,W] or [K,3,H,W], got {tuple(value.shape)}")
    if isinstance(value, (list, tuple)):
        return [im for v in value for im in as_image_list(v)]
    raise TypeError(f"not an image: {type(value).__name__}")
