"""Released scorer checkpoints read without running code."""

from __future__ import annotations

from pathlib import Path

import torch


def read_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """A state dict from safetensors, or from a torch file with torch.load(weights_only=True) (tensors and
    plain containers only: a pickled class is refused). A `state_dict` entry is unwrapped and a
    DistributedDataParallel `module.` prefix removed."""
    path = str(path)
    if path.endswith(".safetensors"):
        from safetensors.torch import load_file

        state = load_file(path)
    else:
        state = torch.load(path, map_location="cpu", weights_only=True)
        if isinstance(state, dict) and isinstance(state.get("state_dict"), dict):
            state = state["state_dict"]
    if not isinstance(state, dict) or not state or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ValueError(f"{path}: not a state dict of tensors")
    if all(k.startswith("module.") for k in state):  # saved from DistributedDataParallel
        state = {k[len("module.") :]: v for k, v in state.items()}
    return state
