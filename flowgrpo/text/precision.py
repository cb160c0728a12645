"""Mixed precision of the text policy: fp32 master weights, forwards under `torch.autocast`.

AdamW on bf16 weights loses every update below bf16's resolution (2^-8 to 2^-7 of the weight): at the
learning rates of RL fine-tuning (1e-6) a step leaves almost every weight as it was (measured on a tiny
Qwen2, one step at lr 1e-6: 2 % of the weights moved in bf16, all of them in fp32). `model.autocast`
keeps the weights in `model.dtype` (float32) and runs every forward of the policy (generation, log-prob
passes, the training forward, the frozen reference copy) with bf16 / fp16 matmuls; the config refuses a
full fine-tune in bf16 / fp16 weights, as the image trainer's does.
"""

from __future__ import annotations

from typing import Any

import torch


class _AutocastHooks:
    """A forward pre-hook that enters torch.autocast and an always-called forward hook that leaves it.
    Hooks, not a wrapped `forward`: a deep copy of the module (the frozen KL reference) gets its own."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.active: list[Any] = []

    def enter(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        device = next(module.parameters()).device.type
        scope = torch.autocast(device_type=device, dtype=self.dtype)
        scope.__enter__()
        self.active.append(scope)

    def leave(self, module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        self.active.pop().__exit__(None, None, None)


def autocast_forwards(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Every forward of `model` (under peft: of the model it wraps, which `generate` calls) runs under
    torch.autocast(dtype); the weights keep their own dtype."""
    base = getattr(model, "get_base_model", lambda: model)()
    hooks = _AutocastHooks(dtype)
    base.register_forward_pre_hook(hooks.enter, with_kwargs=True)
    base.register_forward_hook(hooks.leave, with_kwargs=True, always_call=True)
