"""The policy: a model-family adapter with LoRA (or all denoiser weights) trainable, and its references."""

from __future__ import annotations

import contextlib
import copy
from typing import Iterator, Optional

import torch

from reward_models.placement import resolve_device

from ..config import ConfigError
from .config import ImageModelConfig

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def build_policy(cfg: ImageModelConfig):
    """(adapter, trainable parameters). Frozen weights in cfg.dtype (cfg.component_dtypes: some components in
    another); LoRA weights in float32."""
    from pipelines.adapters import build_adapter
    from pipelines.speed import apply_speed

    device = resolve_device(cfg.device)
    dtype = DTYPES[cfg.dtype]
    if cfg.tiny:
        adapter = build_adapter(
            cfg.family, tiny=True, seed=cfg.init_seed, dtype=dtype, device=device, **cfg.tiny_options
        )
    else:
        adapter = build_adapter(cfg.family, pretrained=cfg.pretrained, dtype=dtype, device=device, **cfg.options)
    apply_component_dtypes(adapter, cfg.component_dtypes)
    if cfg.finetune == "full":
        params = list(adapter.denoiser.parameters())
        for p in params:
            p.requires_grad_(True)
    elif cfg.init_lora:
        params = adapter.load_lora(cfg.init_lora)
    else:
        params = adapter.add_lora(
            rank=cfg.lora.rank, alpha=cfg.lora.alpha, init=cfg.lora.init, target_modules=cfg.lora.target_modules
        )
    apply_speed(adapter, cfg.speed)  # after LoRA: compiled blocks include the LoRA layers
    return adapter, params


def apply_component_dtypes(adapter, dtypes: dict[str, str]) -> dict[str, torch.dtype]:
    """Cast the named frozen components of the adapter's pipeline (`model.component_dtypes`), before LoRA is
    attached. The published SD3.5-M runs keep the text encoders in the mixed-precision dtype and the VAE in fp32
    whatever the transformer's dtype; prompt embeddings are cast to the denoiser's dtype after encoding and
    latents to the VAE's before decoding (pipelines.adapters), so any mix runs. An unknown name is a one-line
    error listing the pipeline's components; the denoiser takes `model.dtype`."""
    modules = {k: v for k, v in adapter.pipe.components.items() if isinstance(v, torch.nn.Module)}
    done: dict[str, torch.dtype] = {}
    for name, dtype in dtypes.items():
        if name == adapter.denoiser_name:
            raise ConfigError(
                f"model.component_dtypes: '{name}' is the denoiser, whose frozen weights take model.dtype; "
                "list the other components only"
            )
        if name not in modules:
            valid = sorted(k for k in modules if k != adapter.denoiser_name)
            raise ConfigError(
                f"model.component_dtypes: '{name}' is not a loaded component of the {adapter.family} pipeline; "
                f"valid: {valid}"
            )
        modules[name].to(dtype=DTYPES[dtype])
        done[name] = DTYPES[dtype]
    return done


class FrozenCopyReference:
    """KL reference for full fine-tuning: a frozen copy of the initial denoiser, swapped in on demand."""

    def __init__(self, adapter):
        self.adapter = adapter
        self.frozen = copy.deepcopy(adapter.denoiser).requires_grad_(False).eval()

    @contextlib.contextmanager
    def __call__(self) -> Iterator:
        name = self.adapter.denoiser_name
        live = getattr(self.adapter.pipe, name)
        setattr(self.adapter.pipe, name, self.frozen)
        try:
            yield self.adapter
        finally:
            setattr(self.adapter.pipe, name, live)


def resolution_problem_before_load(cfg: ImageModelConfig, height: int, width: int) -> Optional[str]:
    """Why a pretrained model cannot take height x width, read from its denoiser's and VAE's config.json before
    any weight loads (None: it can, or the configs cannot be read: the load itself then says why, naming the
    source). Tiny models are checked once built (they build in a second)."""
    from pipelines.adapters import ADAPTERS

    if cfg.tiny or cfg.pretrained is None:
        return None
    family = ADAPTERS[cfg.family]
    try:
        denoiser_config, vae_config = family.pretrained_configs(cfg.pretrained, **cfg.options)
    except (OSError, ValueError, KeyError):
        return None
    return family.resolution_problem(height, width, denoiser_config, vae_config)


def shard_policy(adapter, reference, dist) -> list[torch.nn.Parameter]:
    """FSDP2 on the denoiser (and on the frozen reference copy of a full fine-tune); returns the trainable
    parameters, which `fully_shard` replaced by DTensor shards (build the optimizer and EMA from these)."""
    dist.shard(adapter.denoiser)
    if isinstance(reference, FrozenCopyReference):
        dist.shard(reference.frozen)
    return [p for p in adapter.denoiser.parameters() if p.requires_grad]


def reference_context(adapter, cfg: ImageModelConfig, needed: bool):
    """A context manager giving the reference policy: LoRA disabled, or a frozen copy when fully tuned."""
    if not needed:
        return None
    if cfg.finetune == "full":
        return FrozenCopyReference(adapter)
    return adapter.reference
