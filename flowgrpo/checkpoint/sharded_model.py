"""FSDP2 model checkpoints keyed by parameter name, for users' own training loops (docs/scaling.md):
`save_sharded` / `load_sharded` / `save_sharded_atomic` write and read a model's (and its optimizer's) state on
any number of ranks. The trainers' checkpoints key optimizer states by parameter index instead and keep their
shards inside a step folder (flowgrpo.checkpoint.shards); this format is a folder of its own.

Each rank writes only its shards, as safetensors files (DCP's HuggingFaceStorageWriter: the offsets of each shard
live in the safetensors header as JSON, so there is no pickled `.metadata` file); the reader stitches and
re-slices the shards for the world size it runs on. Optimizer states are flattened to tensors
"optim.<param fqn>.<key>", the optimizer's param groups go to JSON. flowgrpo.scaling.sharding re-exports these
names (their documented import path) and raises the same `ShardingError`, which lives here so that the
checkpoint package does not import the sharding one.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..atomic_io import fsync_dir, fsync_file, from_json, to_json

_MODEL = "model."
_OPTIM = "optim."
_PARAM_GROUPS = "optim_param_groups.json"


class ShardingError(RuntimeError):
    """A model that cannot be sharded as asked, or a sharded checkpoint that does not match."""


@dataclass
class ShardedState:
    """A model's (and optimizer's) state as this rank holds it: `tensors` are local shards or replicated
    tensors keyed "model.<fqn>" / "optim.<fqn>.<key>"; `param_groups` is the optimizer's JSON part."""

    tensors: dict[str, torch.Tensor]
    param_groups: list[dict] = field(default_factory=list)


def state_dict_options(trainable_only: bool, full: bool = False) -> Any:
    """torch's state-dict options for these checkpoints (local shards) and, with `full`, for the gathered CPU
    state an export writes (flowgrpo.scaling.sharding.full_state)."""
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

    options = state_dict_options(trainable_only)
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
    options = state_dict_options(trainable_only)
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
