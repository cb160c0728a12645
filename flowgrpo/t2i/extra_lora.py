"""Further LoRA adapters beside the trained one ("default"): added frozen with the run's LoRA settings, and switched
to for a forward (DiffusionNFT's old policy, GARDO's reference, AWM's EMA policy). Imports no config, so a method's
config module may import it."""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch


def _lora_layers(adapter) -> tuple[list, list[torch.nn.Parameter]]:
    """The denoiser's peft LoRA layers and their adapter weights, found once per adapter (walking every module
    on each switch cost DiffusionNFT several ms per iteration on tiny models)."""
    found = getattr(adapter, "_lora_layers", None)
    if found is None:
        from peft.tuners.tuners_utils import BaseTunerLayer

        layers = [m for m in adapter.denoiser.modules() if isinstance(m, BaseTunerLayer)]
        weights = [p for m in layers for name in m.adapter_layer_names for p in getattr(m, name).parameters()]
        found = adapter._lora_layers = (layers, weights)
    return found


def add_frozen_lora(adapter, lora, name: str) -> None:
    """A second LoRA adapter `name` with the run's LoRA settings (`model.lora`), frozen, the trained one ("default")
    active and alone trainable: DiffusionNFT's old policy, GARDO's reference, AWM's EMA policy. Before sharding:
    FSDP2 manages the parameters present when it wraps a block."""
    adapter.add_lora(
        rank=lora.rank, alpha=lora.alpha, init=lora.init, target_modules=lora.target_modules, adapter_name=name
    )
    adapter.denoiser.set_adapter("default")
    for p in adapter.lora_parameters("default"):
        p.requires_grad_(True)
    for p in adapter.lora_parameters(name):
        p.requires_grad_(False)


@contextlib.contextmanager
def active_lora(adapter, name: str) -> Iterator:
    """Run with LoRA adapter `name` active (DiffusionNFT's old policy), restoring trainability after. Switches
    the LoRA layers themselves (what diffusers' `set_adapter` does for a single adapter, without its checks
    and module walk on every call)."""
    layers, weights = _lora_layers(adapter)
    flags = [(p, p.requires_grad) for p in weights]  # peft's switch marks the active adapter trainable
    for m in layers:
        m.set_adapter(name)
    try:
        yield adapter
    finally:
        for m in layers:
            m.set_adapter("default")
        for p, flag in flags:
            p.requires_grad_(flag)
