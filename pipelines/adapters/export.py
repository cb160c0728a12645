"""Trained denoiser weights written in the formats diffusers reads back: a LoRA file (`write_lora`, for
`<Pipeline>.load_lora_weights` / `<Model>.load_lora_adapter`) and a full model folder (`write_model_folder`, for
`<Model>.from_pretrained`). Adapters call these from `save_lora` / `save_denoiser`."""

from __future__ import annotations

import json
import os
from typing import Any

import torch
from torch import Tensor

from flowgrpo.atomic_io import own_storage


def write_lora(
    writer: Any,
    model: torch.nn.Module,
    path: str | os.PathLike,
    adapter_name: str,
    prefix: str,
    state: dict[str, Tensor] | None = None,
) -> str:
    """`path/pytorch_lora_weights.safetensors` with `model`'s LoRA `adapter_name` under `<prefix>.` keys, its
    LoraConfig as metadata (so alpha survives), by `writer.save_lora_weights` (a diffusers pipeline class or LoRA
    loader mixin that takes `<prefix>_lora_layers`). `state`: the weights gathered from a sharded run."""
    from peft.utils import get_peft_model_state_dict

    layers = get_peft_model_state_dict(model, state_dict=state, adapter_name=adapter_name)
    writer.save_lora_weights(
        os.fspath(path),
        **{
            f"{prefix}_lora_layers": {k: v.detach().to("cpu").contiguous() for k, v in layers.items()},
            f"{prefix}_lora_adapter_metadata": model.peft_config[adapter_name].to_dict(),
        },
    )
    return os.fspath(path)


def write_model_folder(model: torch.nn.Module, path: str | os.PathLike, state: dict[str, Tensor] | None = None) -> str:
    """`model` as a diffusers model folder (config.json + safetensors shards). `state`: the weights gathered from a
    sharded run (default: the live model's)."""
    from huggingface_hub import save_torch_state_dict

    # FSDP2 renames the class (FSDPSD3Transformer2DModel); the folder names the model class it came from
    cls = next(c for c in type(model).__mro__ if hasattr(c, "from_pretrained") and not c.__name__.startswith("FSDP"))
    model.save_config(path)
    config_file = os.path.join(path, "config.json")
    with open(config_file) as f:
        config = json.load(f)
    with open(config_file, "w") as f:
        json.dump({**config, "_class_name": cls.__name__}, f, indent=2, sort_keys=True)
    state = model.state_dict() if state is None else state
    save_torch_state_dict(
        {k: own_storage(v.detach()) for k, v in state.items()},
        os.fspath(path),
        filename_pattern="diffusion_pytorch_model{suffix}.safetensors",
        max_shard_size="10GB",
    )
    return os.fspath(path)
