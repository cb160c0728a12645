"""FSDP2 for the trainers: `fully_shard` on the transformer blocks of a denoiser or a causal LM, and
sharded checkpoints (torch.distributed.checkpoint) that load on any world size.

Sharding: every block whose class name is listed becomes one FSDP unit (its parameters are gathered
for its forward and freed after), then the root module is sharded so the rest (embeddings, final
norm, heads) forms one more unit. Works with peft LoRA inside the blocks (frozen bf16 base weights
and fp32 LoRA weights may share a unit) and for a full fine-tune.

Checkpoints: each rank writes only its shards, as safetensors files (DCP's HuggingFaceStorageWriter:
the offsets of each shard live in the safetensors header as JSON, so there is no pickled `.metadata`
file); the reader stitches and re-slices the shards for the world size it runs on. Optimizer states
are flattened to tensors "optim.<param fqn>.<key>", the optimizer's param groups go to JSON.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist

from flowgrpo.atomic_io import fsync_dir, fsync_file, from_json, to_json

# The transformer blocks of the models we train: SD3 / SD3.5 (MMDiT), FLUX.1 (double and single
# stream), Qwen-Image, and the decoder layers of Qwen2 / Qwen2.5 and Llama (SmolLM2, Llama 3) text
# policies. configs/accelerate/fsdp2.yaml lists the same names.
BLOCK_CLASSES: tuple[str, ...] = (
    "JointTransformerBlock",
    "FluxTransformerBlock",
    "FluxSingleTransformerBlock",
    "QwenImageTransformerBlock",
    "Qwen2DecoderLayer",
    "LlamaDecoderLayer",
)

_MODEL = "model."
_OPTIM = "optim."
_PARAM_GROUPS = "optim_param_groups.json"
_DTYPES = {"no": None, "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class ShardingError(RuntimeError):
    """A model that cannot be sharded as asked, or a sharded checkpoint that does not match."""


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


# ---- checkpoints --------------------------------------------------------------------------------


@dataclass
class ShardedState:
    """A model's (and optimizer's) state as this rank holds it: `tensors` are local shards or replicated
    tensors keyed "model.<fqn>" / "optim.<fqn>.<key>"; `param_groups` is the optimizer's JSON part."""

    tensors: dict[str, torch.Tensor]
    param_groups: list[dict] = field(default_factory=list)


def _options(trainable_only: bool, full: bool = False) -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    # strict=False when only trainable weights are saved: the frozen base is not in the checkpoint.
    return StateDictOptions(
        ignore_frozen_params=trainable_only, full_state_dict=full, cpu_offload=full, strict=not trainable_only
    )


def sharded_state(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None, trainable_only: bool = False
) -> ShardedState:
    """The state to save, or the templates to load into (a fresh optimizer gets zero states first)."""
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    options = _options(trainable_only)
    tensors = {_MODEL + k: v for k, v in get_model_state_dict(model, options=options).items()}
    groups: list[dict] = []
    if optimizer is not None:
        osd = get_optimizer_state_dict(model, optimizer, options=options)
        for fqn, state in osd["state"].items():
            for key, value in state.items():
                if not isinstance(value, torch.Tensor):
                    raise ShardingError(f"optimizer state {fqn}.{key} is not a tensor ({type(value).__name__})")
                tensors[f"{_OPTIM}{fqn}.{key}"] = value
        groups = osd["param_groups"]
    return ShardedState(tensors, groups)


def _no_dist() -> bool:
    return not (dist.is_available() and dist.is_initialized())


def save_sharded(
    path: str | Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    trainable_only: bool = False,
) -> None:
    """Every rank calls this with the same `path` (a shared folder); each writes its own shards."""
    import torch.distributed.checkpoint as dcp

    path = Path(path)
    state = sharded_state(model, optimizer, trainable_only)
    dcp.save(
        state.tensors, storage_writer=dcp.HuggingFaceStorageWriter(str(path), save_distributed=True), no_dist=_no_dist()
    )
    if optimizer is not None and (_no_dist() or dist.get_rank() == 0):
        (path / _PARAM_GROUPS).write_text(json.dumps(to_json(state.param_groups), indent=1))
    if not _no_dist():
        dist.barrier()  # the folder is complete on every rank before anyone renames or reads it


def load_sharded(
    path: str | Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    trainable_only: bool = False,
) -> None:
    """Load a folder written by `save_sharded` on any world size into `model` (and `optimizer`), sharded
    or not: each rank reads the slices of the saved shards that its own shards cover."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    path = Path(path)
    if not path.is_dir() or not any(path.glob("*.safetensors")):
        raise ShardingError(f"{path} holds no sharded checkpoint (*.safetensors)")
    state = sharded_state(model, optimizer, trainable_only)
    reader = dcp.HuggingFaceStorageReader(str(path))
    saved = set(reader.read_metadata().state_dict_metadata)
    missing = sorted(set(state.tensors) - saved)
    if missing:
        raise ShardingError(f"{path} lacks {len(missing)} tensors this model needs, e.g. {missing[:3]}")
    dcp.load(state.tensors, storage_reader=reader, no_dist=_no_dist())
    options = _options(trainable_only)
    model_sd = {k[len(_MODEL) :]: v for k, v in state.tensors.items() if k.startswith(_MODEL)}
    set_model_state_dict(model, model_sd, options=options)
    if optimizer is not None:
        groups_file = path / _PARAM_GROUPS
        if not groups_file.is_file():
            raise ShardingError(f"{path} has no optimizer param groups ({_PARAM_GROUPS})")
        groups = from_json(json.loads(groups_file.read_text()))
        by_param: dict[str, dict[str, torch.Tensor]] = {}
        for key, value in state.tensors.items():
            if key.startswith(_OPTIM):
                fqn, name = key[len(_OPTIM) :].rsplit(".", 1)
                by_param.setdefault(fqn, {})[name] = value
        for group, template in zip(groups, state.param_groups):
            group["params"] = template["params"]  # this model's fqns, in this optimizer's order
        set_optimizer_state_dict(model, optimizer, {"state": by_param, "param_groups": groups}, options=options)


def _rank0() -> bool:
    return _no_dist() or dist.get_rank() == 0


def _barrier() -> None:
    if not _no_dist():
        dist.barrier()


def save_sharded_atomic(
    target: str | Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    trainable_only: bool = False,
) -> Path:
    """`save_sharded` into a hidden folder next to `target`, then rank 0 fsyncs it and renames it into
    place: a crash mid-save leaves no half-written `target`. Every rank calls it with the same
    `target`, on a file system all ranks share."""
    target = Path(target)
    tmp = target.with_name(f".tmp-{target.name}")  # the same name on every rank, no broadcast needed
    if _rank0():
        if tmp.exists():
            shutil.rmtree(tmp)  # left over by a crashed save
        tmp.mkdir(parents=True)
    _barrier()
    save_sharded(tmp, model, optimizer, trainable_only)  # ends with a barrier: every shard is written
    if _rank0():
        for f in tmp.iterdir():
            fsync_file(f)
        fsync_dir(tmp)
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
        fsync_dir(target.parent)
    _barrier()
    return target


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

    return get_model_state_dict(model, options=_options(trainable_only, full=True))
