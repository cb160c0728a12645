"""Device and dtype settings as configs spell them ("auto", "cuda:1", "bfloat16", "bf16")."""

from __future__ import annotations

import torch

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


def resolve_device(device: "str | torch.device | None" = "auto") -> torch.device:
    if device is None or device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: "str | torch.dtype | None" = "float32") -> torch.dtype:
    if dtype is None:
        return torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return _DTYPES[str(dtype).lower().removeprefix("torch.")]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; valid: {sorted(_DTYPES)}") from None


class ModelPlacement:
    """For an object holding `self.model`: one device and one dtype for it, changed by `to` (None keeps
    the current one). Put it before `Scorer` in the bases so its `to` wins."""

    device: torch.device = torch.device("cpu")
    dtype: torch.dtype = torch.float32

    def to(self, device=None, dtype=None):
        if device is not None:
            self.device = resolve_device(device)
        if dtype is not None:
            self.dtype = resolve_dtype(dtype)
        self.model.to(device=self.device, dtype=self.dtype)
        return self
