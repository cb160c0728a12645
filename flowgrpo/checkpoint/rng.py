"""The global RNG states a checkpoint saves and a resume restores, so a resumed run draws what an uninterrupted
one would: torch's CPU and CUDA generators, python's `random`, numpy's legacy global state.

Tensors (torch states, numpy's key array) go to the checkpoint's rng.safetensors, the scalars to its state.json
(flowgrpo.checkpoint.format).
"""

from __future__ import annotations

import random
from typing import Any, Mapping

import numpy as np
import torch


def rng_state() -> tuple[dict[str, torch.Tensor], dict]:
    """Every global RNG the training loop may touch: torch (CPU, CUDA), python `random`, numpy."""
    tensors = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"torch_cuda_{i}"] = s
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    tensors["numpy_keys"] = torch.from_numpy(np.asarray(keys, dtype=np.uint32).astype(np.int64))
    scalars = {"python": random.getstate(), "numpy": [kind, int(pos), int(has_gauss), float(cached)]}
    return tensors, scalars


def set_rng_state(tensors: Mapping[str, torch.Tensor], scalars: Mapping[str, Any]) -> None:
    torch.set_rng_state(tensors["torch_cpu"])
    cuda = sorted(k for k in tensors if k.startswith("torch_cuda_"))
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([tensors[k] for k in cuda])
    version, internal, gauss = scalars["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, pos, has_gauss, cached = scalars["numpy"]
    np.random.set_state((kind, tensors["numpy_keys"].numpy().astype(np.uint32), pos, has_gauss, cached))
