"""FSDP2 for the trainers: `fully_shard` on the transformer blocks of a denoiser or a causal LM, gradient
clipping over the shards, and gathered weights for export.

Sharding: every block whose class name is listed becomes one FSDP unit (its parameters are gathered
for its forward and freed after), then the root module is sharded so the rest (embeddings, final
norm, heads) forms one more unit. Works with peft LoRA inside the blocks (frozen bf16 base weights
and fp32 LoRA weights may share a unit) and for a full fine-tune.

Checkpoints of a sharded model by parameter name (`save_sharded` / `load_sharded` / `save_sharded_atomic`, for
users' own loops) live in flowgrpo.checkpoint.sharded_model with the other checkpoint formats; this module
re-exports them, their documented import path, and the `ShardingError` both raise.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist

from ..checkpoint.sharded_model import (  # noqa: F401  (re-exported: the documented import path)
    ShardedState,
    ShardingError,
    load_sharded,
    save_sharded,
    save_sharded_atomic,
    sharded_state,
    state_dict_options,
)

# The transformer blocks of the models we train: SD3 / SD3.5 (MMDiT), FLUX.1 (double and single
# stream), Qwen-Image, and the decoder layers of Qwen2 / Qwen2.5 and Llama (SmolLM2, Llama 3) text
# policies; configs/accelerate/fsdp2.yaml lists these. Then the video denoisers' blocks: Wan 2.1 / 2.2 (both
# experts of A14B and TI2V 5B use WanTransformerBlock), HunyuanVideo (double and single stream) and
# HunyuanVideo 1.5, which a launch names with --fsdp_transformer_layer_cls_to_wrap (docs/scaling.md).
BLOCK_CLASSES: tuple[str, ...] = (
    "JointTransformerBlock",
    "FluxTransformerBlock",
    "FluxSingleTransformerBlock",
    "QwenImageTransformerBlock",
    "Qwen2DecoderLayer",
    "LlamaDecoderLayer",
    "WanTransformerBlock",
    "HunyuanVideoTransformerBlock",
    "HunyuanVideoSingleTransformerBlock",
    "HunyuanVideo15TransformerBlock",
    "Flux2TransformerBlock",
    "Flux2SingleTransformerBlock",
    "ZImageTransformerBlock",
)

_DTYPES = {"no": None, "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class ShardingConfig:
    """What `shard_model` does. `param_dtype` is the dtype blocks compute in (parameters are gathered in
    it; None keeps each parameter's own dtype, e.g. fp32 LoRA on a bf16 base); `reduce_dtype` is the
    dtype gradients are averaged in (fp32 so the sum over ranks does not lose bits)."""

    block_classes: tuple[str, ...] = BLOCK_CLASSES
    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = torch.float32
    reshard_after_forward: bool = True
    activation_checkpointing: bool = False

    @classmethod
    def from_accelerate_env(cls, env: dict[str, str] | None = None) -> ShardingConfig:
        """The config `accelerate launch --config_file configs/accelerate/fsdp2.yaml` asks for, read
        through accelerate's own FSDP plugin (the FSDP_* variables it exports to every rank)."""
        from accelerate.utils import FullyShardedDataParallelPlugin

        env = dict(os.environ if env is None else env)
        with mock.patch.dict(os.environ, env, clear=True):  # the plugin reads os.environ only
            plugin = FullyShardedDataParallelPlugin()
        if plugin.fsdp_version != 2:
            raise ShardingError(
                f"flowgrpo shards with FSDP2; the accelerate config says fsdp_version "
                f"{plugin.fsdp_version} (set fsdp_config.fsdp_version: 2)"
            )
        precision = env.get("ACCELERATE_MIXED_PRECISION", "no")
        if precision not in _DTYPES:
            raise ShardingError(f"mixed_precision '{precision}' is not one of {sorted(_DTYPES)}")
        names = plugin.transformer_cls_names_to_wrap or list(BLOCK_CLASSES)
        return cls(
            block_classes=tuple(names),
            param_dtype=_DTYPES[precision],
            reshard_after_forward=bool(plugin.reshard_after_forward),
            activation_checkpointing=bool(plugin.activation_checkpointing),
        )


def _mesh(mesh: Any) -> Any:
    if mesh is not None:
        return mesh
    from torch.distributed.device_mesh import init_device_mesh

    device = "cuda" if torch.cuda.is_available() else "cpu"
    return init_device_mesh(device, (dist.get_world_size(),))


def enable_activation_checkpointing(model: torch.nn.Module) -> None:
    """The model library's own block-level recomputation (keeps parameter names, unlike wrapping the
    blocks in torch's CheckpointWrapper, so checkpoints and LoRA exports keep their keys). Recomputes in
    backward whatever mode the model is in: the policies run in eval mode (no dropout, ratio 1)."""
    base = getattr(model, "get_base_model", lambda: model)()  # under peft, the wrapped model
    if hasattr(base, "enable_gradient_checkpointing"):  # diffusers ModelMixin (recomputes whenever grad is on)
        base.enable_gradient_checkpointing()
        return
    if hasattr(base, "activation_checkpointing_enable"):  # transformers >= 5 PreTrainedModel
        base.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    elif hasattr(base, "gradient_checkpointing_enable"):  # older transformers
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    else:
        raise ShardingError(f"{type(base).__name__} has no gradient checkpointing switch")
    _recompute_in_eval_mode(base)


def _recompute_in_eval_mode(base: torch.nn.Module) -> None:
    """transformers recomputes a layer only while that layer is in training mode (and grad is on), so an
    eval-mode policy kept every activation. The checkpointed layers alone are marked as training: their
    own forward does not read the flag (checked for the common decoder layers); their attention and
    dropout children stay in eval mode. A later `model.eval()` would undo it (the trainers call it once,
    before this)."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    layers = [m for m in base.modules() if isinstance(m, GradientCheckpointingLayer) and m.gradient_checkpointing]
    if not layers:
        raise ShardingError(
            f"{type(base).__name__} has no transformers GradientCheckpointingLayer with checkpointing on: its "
            "recomputation would run only in training mode, and the policy runs in eval mode"
        )
    for layer in layers:
        layer.training = True


def shard_model(model: torch.nn.Module, cfg: ShardingConfig = ShardingConfig(), mesh: Any = None) -> list[str]:
    """Apply FSDP2 to `model` in place (blocks first, then the root); returns the names of the sharded
    blocks. Build the optimizer after this call: its parameters become DTensor shards."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if not dist.is_initialized():
        raise ShardingError("shard_model needs torch.distributed to be initialized (launch with accelerate / torchrun)")
    wanted = set(cfg.block_classes)
    blocks = [(name, m) for name, m in model.named_modules() if type(m).__name__ in wanted]
    if not blocks:
        present = sorted(
            {type(m).__name__ for m in model.modules() if "Block" in type(m).__name__ or "Layer" in type(m).__name__}
        )
        raise ShardingError(
            f"no module of {type(model).__name__} is one of the block classes "
            f"{sorted(wanted)}; its block-like classes are {present}"
        )
    if cfg.activation_checkpointing:
        enable_activation_checkpointing(model)
    policy = MixedPrecisionPolicy(param_dtype=cfg.param_dtype, reduce_dtype=cfg.reduce_dtype)
    mesh = _mesh(mesh)
    for _, block in blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=cfg.reshard_after_forward)
    # The root keeps its parameters gathered after forward: the next forward needs them first.
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=False)
    return [name for name, _ in blocks]


def clip_grad_norm(parameters: list[torch.nn.Parameter], max_norm: float) -> float:
    """Clip the global gradient norm over all shards (torch computes it on DTensors with one
    all-reduce) and return it as a float, the same on every rank."""
    norm = torch.nn.utils.clip_grad_norm_(parameters, max_norm)
    full = getattr(norm, "full_tensor", None)
    return float(full() if full is not None else norm)


def full_state(model: torch.nn.Module, trainable_only: bool = False) -> dict[str, torch.Tensor]:
    """Gathered, unsharded CPU tensors for export (a LoRA safetensors file, a diffusers transformer
    folder). Every rank must call it (it all-gathers); with torch's cpu_offload only rank 0 gets the
    tensors, the other ranks an empty dict."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return get_model_state_dict(model, options=state_dict_options(trainable_only, full=True))
