"""The sharded part of a checkpoint: the tensors FSDP2 splits over the ranks (weights, EMA, NFT's old policy,
optimizer moments), written by every rank into the checkpoint's `sharded/` folder and read back on any number
of ranks.

torch.distributed.checkpoint does the work: each rank writes only its shards, as safetensors files whose
headers record each shard's offsets (HuggingFaceStorageWriter: no pickled metadata file), and a reader takes the
slices its own shards cover, so a checkpoint saved on 2 ranks resumes on 1 or 8. Keys: "tensors.<group>/<name>"
for the trainer's tensor groups and "optim.<name>/<index>.<key>" for optimizer states (the checkpoint's own
naming). Everything else (step, RNG, schedules, plain tensors) stays in rank 0's files (flowgrpo.checkpoint.format).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from .format import CheckpointError
from .parts import CheckpointParts, is_shard, local_part


def _no_dist() -> bool:
    return not dist.is_initialized()


def shard_tensors(parts: CheckpointParts) -> dict[str, torch.Tensor]:
    """The sharded tensors of a checkpoint's parts, under their `sharded/` keys."""
    out = {f"tensors.{g}/{n}": t for g, named in parts.tensors.items() for n, t in named.items() if is_shard(t)}
    for name, opt in parts.optimizers.items():
        for idx, slots in opt.state_dict()["state"].items():
            out.update({f"optim.{name}/{idx}.{key}": v for key, v in slots.items() if is_shard(v)})
    return out


def without_shards(parts: CheckpointParts) -> CheckpointParts:
    """The parts rank 0 writes itself (optimizers skip their sharded states on their own)."""
    plain = {g: {n: t for n, t in named.items() if not is_shard(t)} for g, named in parts.tensors.items()}
    return replace(parts, tensors={g: named for g, named in plain.items() if named})


def all_finite(tensors: dict[str, torch.Tensor]) -> bool:
    """Whether this rank's shards are finite (the caller reduces the answer over ranks)."""
    local = [local_part(t) for t in tensors.values()]
    return all(bool(torch.isfinite(t).all()) for t in local if t.is_floating_point())


def write_shards(folder: Path, tensors: dict[str, torch.Tensor]) -> None:
    """Every rank calls this with the same (shared) folder; each writes its own shards."""
    from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageWriter
    from torch.distributed.checkpoint.state_dict_saver import save

    writer = HuggingFaceStorageWriter(str(folder), save_distributed=True)
    save(tensors, storage_writer=writer, no_dist=_no_dist())


def read_shards(folder: Path, parts: CheckpointParts) -> dict[str, torch.Tensor]:
    """The `sharded/` tensors of a checkpoint, laid out like this run's tensors (sharded on this run's ranks, or
    whole in a run that does not shard): group tensors like the live ones, optimizer moments like their
    parameter. Every rank calls it."""
    from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageReader
    from torch.distributed.checkpoint.state_dict_loader import load

    reader = HuggingFaceStorageReader(str(folder))
    saved = set(reader.read_metadata().state_dict_metadata)
    expected = {f"tensors.{g}/{n}" for g, named in parts.tensors.items() for n in named}
    templates: dict[str, torch.Tensor] = {}
    for key in sorted(saved):
        kind, rest = key.split(".", 1)
        name, item = rest.split("/", 1)
        if kind == "tensors":
            live = parts.tensors.get(name, {}).get(item)
            if live is None:
                raise CheckpointError(f"{folder}: '{key}' belongs to no tensor of this run")
            templates[key] = torch.empty_like(live)
        else:
            params = [p for group in parts.optimizers[name].param_groups for p in group["params"]]
            templates[key] = torch.zeros_like(params[int(item.split(".", 1)[0])])
    missing = [k for k in expected - saved if is_shard(_live(parts, k))]
    if missing:
        raise CheckpointError(
            f"{folder} lacks {len(missing)} sharded tensors this run holds, e.g. {sorted(missing)[:3]}"
        )
    load(templates, storage_reader=reader, no_dist=_no_dist())
    return templates


def _live(parts: CheckpointParts, key: str) -> Optional[torch.Tensor]:
    group, name = key[len("tensors.") :].split("/", 1)
    return parts.tensors[group][name]
