"""The checkpoint format: one atomic, verified folder per step, with no pickle (tensors in safetensors,
everything else in JSON); saving, listing, verifying and loading it.

A checkpoint is a folder `step_00000012/` under a root folder:

    tensors.<group>.safetensors   named tensor groups (model or LoRA weights, EMA, ...)
    optim.<name>.safetensors      optimizer state tensors, keyed "<param index>.<key>"
    optim.<name>.json             optimizer param groups and non-tensor state
    rng.safetensors               torch CPU (and CUDA) generator states, numpy's key array
    state.json                    step, the caller's JSON state (data position, ...), LR scheduler
                                  states, python and numpy RNG scalars, format version, and the size
                                  and sha256 of every other file (`files`)
    config.json                   the resolved run config (optional)
    sharded/                      a sharded (FSDP2) run's weights, EMA and optimizer moments: every rank
                                  writes its own shards (torch.distributed.checkpoint, safetensors files),
                                  read back on any number of ranks (flowgrpo.checkpoint.shards)

Before a resume trusts a checkpoint, `latest_checkpoint(root, verify=True)` checks those sizes and
hashes; a damaged checkpoint (truncated by a full disk, altered) is skipped with a warning naming it and
the previous good one is used. Non-finite tensors are refused at save time.

Saving writes everything into a hidden temporary folder next to the target, fsyncs every file and
the folder, then renames it into place: a crash mid-save leaves the previous checkpoints intact and
no half-written `step_*` folder. Only the last `keep_last` checkpoints are kept. A write that fails (a full
disk, a read-only folder) removes the temporary folder and is a CheckpointError naming the checkpoint's folder
and the OS error; the previous checkpoints are intact.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Optional

import torch
from safetensors.torch import load_file, save_file

from ..atomic_io import TensorInJSONError, fsync_dir, fsync_file, from_json, is_io_error, os_error_text, to_json
from .parts import is_shard
from .rng import rng_state, set_rng_state

FORMAT_VERSION = 1
_PREFIX = "step_"
SHARDED = "sharded"  # the subfolder of a sharded (FSDP2) run's checkpoint: every rank's shards


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be read or does not match what it is loaded into."""


# --- JSON (tuples kept apart from lists by flowgrpo.atomic_io) -------------------------------------


def _write_json(path: Path, obj: Any) -> None:
    try:
        value = to_json(obj)
    except TensorInJSONError as err:
        raise CheckpointError(str(err)) from None
    with open(path, "w") as f:
        json.dump(value, f, indent=1, allow_nan=True)
        f.flush()
        os.fsync(f.fileno())


def _read_json(path: Path) -> Any:
    with open(path) as f:
        return from_json(json.load(f))


# --- tensors ------------------------------------------------------------------------------------


def _save_tensors(tensors: Mapping[str, torch.Tensor], path: Path) -> None:
    """safetensors refuses shared storage (tied weights): store each storage once, note the aliases."""
    seen: dict[tuple, str] = {}
    unique: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise CheckpointError(f"{path.name}: '{name}' is a {type(t).__name__}, not a tensor")
        t = t.detach()
        key = (
            (
                t.untyped_storage().data_ptr(),
                t.storage_offset(),
                tuple(t.shape),
                tuple(t.stride()),
                t.dtype,
                t.device.type,
            )
            if t.numel()
            else None
        )
        if key is not None and key in seen:
            aliases[name] = seen[key]
            continue
        if key is not None:
            seen[key] = name
        unique[name] = t.to("cpu").contiguous().clone()
    save_file(unique, str(path), metadata={"aliases": json.dumps(aliases)})
    fsync_file(path)


def _load_tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
        tensors = load_file(str(path))
    except Exception as err:  # SafetensorError, OSError: name the file, not just the library's complaint
        raise CheckpointError(f"{path}: unreadable ({type(err).__name__}: {err})") from None
    for name, target in json.loads(meta.get("aliases", "{}")).items():
        tensors[name] = tensors[target]
    return tensors


# --- optimizer ----------------------------------------------------------------------------------


def _optimizer_parts(optimizer: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict]:
    sd = optimizer.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    sharded: list[str] = []  # states of FSDP2-sharded weights: in the checkpoint's `sharded/` folder
    for idx, slots in sd["state"].items():
        for key, value in slots.items():
            if is_shard(value):
                sharded.append(f"{idx}.{key}")
            elif isinstance(value, torch.Tensor):
                tensors[f"{idx}.{key}"] = value
            else:
                scalars.setdefault(str(idx), {})[key] = value
    meta = {"param_groups": sd["param_groups"], "scalars": scalars, "tensor_keys": sorted(tensors)}
    if sharded:
        meta["sharded_keys"] = sorted(sharded)
    return tensors, meta


def _optimizer_state(tensors: Mapping[str, torch.Tensor], meta: dict) -> dict:
    state: dict[int, dict[str, Any]] = {}
    for name in meta["tensor_keys"] + meta.get("sharded_keys", []):
        idx, key = name.split(".", 1)
        state.setdefault(int(idx), {})[key] = tensors[name]
    for idx, slots in meta["scalars"].items():
        state.setdefault(int(idx), {}).update(slots)
    return {"state": state, "param_groups": meta["param_groups"]}


# --- the checkpoint -----------------------------------------------------------------------------


def checkpoint_name(step: int) -> str:
    return f"{_PREFIX}{step:08d}"


def list_checkpoints(root: str | Path) -> list[Path]:
    """Complete checkpoints under `root`, oldest first (temporary folders are not listed)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        if (
            p.is_dir()
            and p.name.startswith(_PREFIX)
            and p.name[len(_PREFIX) :].isdigit()
            and (p / "state.json").is_file()
        ):
            found.append((int(p.name[len(_PREFIX) :]), p))
    return [p for _, p in sorted(found)]


def _file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _manifest(folder: Path) -> dict[str, dict[str, Any]]:
    return {
        f.relative_to(folder).as_posix(): {"bytes": f.stat().st_size, "sha256": _file_digest(f)}
        for f in sorted(folder.rglob("*"))
        if f.is_file() and f != folder / "state.json"
    }


def verify_checkpoint(path: str | Path) -> list[str]:
    """What is wrong with a checkpoint folder (empty when it matches the sizes and hashes recorded at save).
    Checkpoints written before hashes were recorded are checked for a readable state.json only."""
    path = Path(path)
    try:
        files = _read_json(path / "state.json").get("files")
    except (OSError, ValueError) as err:
        return [f"state.json unreadable ({type(err).__name__})"]
    problems = []
    for name, want in (files or {}).items():
        f = path / name
        if not f.is_file():
            problems.append(f"{name} is missing")
        elif f.stat().st_size != want["bytes"]:
            problems.append(f"{name} has {f.stat().st_size} bytes, {want['bytes']} were saved")
        elif _file_digest(f) != want["sha256"]:
            problems.append(f"{name} differs from what was saved (sha256)")
    return problems


def latest_checkpoint(root: str | Path, verify: bool = False) -> Optional[Path]:
    """The newest complete checkpoint under `root`, or None. With `verify`, the newest one whose files match
    what was saved: each damaged one is skipped with a warning naming it; CheckpointError when all are."""
    found = list_checkpoints(root)
    if not verify:
        return found[-1] if found else None
    damaged = []
    for path in reversed(found):
        problems = verify_checkpoint(path)
        if not problems:
            return path
        damaged.append(f"{path.name} ({problems[0]})")
        warnings.warn(f"checkpoint {path} is damaged: {'; '.join(problems)}; trying the one before it", stacklevel=2)
    if damaged:
        raise CheckpointError(f"every checkpoint under {root} is damaged: {', '.join(damaged)}")
    return None


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def save_checkpoint(
    root: str | Path,
    step: int,
    *,
    tensors: Optional[Mapping[str, Mapping[str, torch.Tensor]]] = None,
    optimizers: Optional[Mapping[str, torch.optim.Optimizer]] = None,
    schedulers: Optional[Mapping[str, Any]] = None,
    state: Optional[Mapping[str, Any]] = None,
    config: Optional[Mapping[str, Any]] = None,
    keep_last: Optional[int] = None,
    folders: Optional[Mapping[str, Path]] = None,
) -> Path:
    """Write checkpoint `step` under `root` atomically and return its folder.

    tensors:    {group: {name: tensor}}, e.g. {"model": trainable weights}.
    optimizers: {name: torch optimizer} (tensor state to safetensors, the rest to JSON).
    schedulers: {name: object whose state_dict() is JSON-able}: LR schedulers, a GradScaler, ...
    state:      JSON-able caller state (data position, counters, ...).
    keep_last:  remove all but the newest `keep_last` checkpoints after a successful save.
    folders:    {name: folder already written under `root`} moved in as subfolders (a sharded run's `sharded/`,
                written by every rank), covered by the manifest like every other file.
    """
    root = Path(root)
    _refuse_nonfinite(step, tensors, optimizers)  # before anything is written or rotated away
    target = root / checkpoint_name(step)
    try:
        root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{target.name}-", dir=root))
    except OSError as err:
        raise _write_error(target, err) from err
    try:
        os.chmod(tmp, 0o777 & ~_umask())
        for group, named in (tensors or {}).items():
            _save_tensors(named, tmp / f"tensors.{group}.safetensors")
        for name, opt in (optimizers or {}).items():
            opt_tensors, meta = _optimizer_parts(opt)
            _save_tensors(opt_tensors, tmp / f"optim.{name}.safetensors")
            _write_json(tmp / f"optim.{name}.json", meta)
        rng_tensors, rng_scalars = rng_state()
        _save_tensors(rng_tensors, tmp / "rng.safetensors")
        if config is not None:
            _write_json(tmp / "config.json", dict(config))
        for name, folder in (folders or {}).items():
            for f in folder.rglob("*"):
                if f.is_file():
                    fsync_file(f)
            os.rename(folder, tmp / name)
        files = _manifest(tmp)  # what a resume verifies before trusting this checkpoint
        _write_json(
            tmp / "state.json",
            {  # written last: a folder without it is never a checkpoint
                "format_version": FORMAT_VERSION,
                "step": int(step),
                "state": dict(state or {}),
                "schedulers": {name: s.state_dict() for name, s in (schedulers or {}).items()},
                "rng": rng_scalars,
                "files": files,
            },
        )
        for f in tmp.rglob("*"):
            os.chmod(f, (0o777 if f.is_dir() else 0o666) & ~_umask())
            if f.is_dir():
                fsync_dir(f)
        fsync_dir(tmp)
        if target.exists():  # re-saving a step (e.g. after a resume): move the old one aside first
            old = root / f".old-{target.name}-{os.getpid()}"
            os.rename(target, old)
            try:
                os.rename(tmp, target)
            except BaseException:
                os.rename(old, target)  # the step's earlier checkpoint goes back in place
                raise
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, target)
        fsync_dir(root)
    except BaseException as err:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(err, Exception) and is_io_error(err):
            raise _write_error(target, err) from err
        raise
    _cleanup(root, keep_last)
    return target


def _write_error(target: Path, err: BaseException) -> CheckpointError:
    return CheckpointError(
        f"could not save checkpoint {target}: {os_error_text(err)}; the earlier checkpoints under {target.parent} "
        "are intact"
    )


def _refuse_nonfinite(
    step: int,
    tensors: Optional[Mapping[str, Mapping[str, torch.Tensor]]],
    optimizers: Optional[Mapping[str, torch.optim.Optimizer]],
) -> None:
    """A NaN / inf weight or optimizer moment is never saved: keep_last would rotate good checkpoints out."""
    named = [(f"{group}/{name}", t) for group, items in (tensors or {}).items() for name, t in items.items()]
    named += [
        (f"optim.{n}/{k}", t) for n, opt in (optimizers or {}).items() for k, t in _optimizer_parts(opt)[0].items()
    ]
    bad = [
        name
        for name, t in named
        if isinstance(t, torch.Tensor) and t.is_floating_point() and not bool(torch.isfinite(t.detach()).all())
    ]
    if bad:
        raise CheckpointError(
            f"refusing to save step {step}: {len(bad)} tensor(s) hold NaN / inf "
            f"({', '.join(bad[:3])}{' ...' if len(bad) > 3 else ''}); earlier checkpoints kept"
        )


def _cleanup(root: Path, keep_last: Optional[int]) -> None:
    """Remove leftovers of crashed saves and all but the newest `keep_last` checkpoints. The new checkpoint is
    saved already: a removal that fails is a warning, not a failed save."""
    for p in root.iterdir():  # leftovers of crashed saves
        if p.is_dir() and (p.name.startswith(".tmp-") or p.name.startswith(".old-")):
            shutil.rmtree(p, ignore_errors=True)
    if keep_last is not None and keep_last > 0:
        for p in list_checkpoints(root)[:-keep_last]:
            doomed = root / f".old-{p.name}-{os.getpid()}"
            try:
                os.rename(p, doomed)  # out of the listing at once, even if the removal below is interrupted
            except OSError as err:
                warnings.warn(f"could not remove the old checkpoint {p}: {os_error_text(err)}", stacklevel=3)
                continue
            shutil.rmtree(doomed, ignore_errors=True)


@dataclass
class Checkpoint:
    path: Path
    step: int
    tensors: dict[str, dict[str, torch.Tensor]]
    state: dict[str, Any]
    config: Optional[dict[str, Any]] = None
    _raw: dict[str, Any] = field(default_factory=dict, repr=False)


def read_checkpoint_config(path: str | Path) -> Optional[dict[str, Any]]:
    """The run config a checkpoint was saved with (None when it holds none), read without loading anything else:
    a resume compares it with its own before any optimizer or tensor is loaded."""
    f = Path(path) / "config.json"
    if not f.is_file():
        return None
    try:
        config = _read_json(f)
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{f}: unreadable ({type(err).__name__}: {err})") from None
    return dict(config) if isinstance(config, Mapping) else None


def load_checkpoint(
    path: str | Path,
    *,
    optimizers: Optional[Mapping[str, torch.optim.Optimizer]] = None,
    schedulers: Optional[Mapping[str, Any]] = None,
    restore_rng: bool = True,
    shards: Optional[Mapping[str, torch.Tensor]] = None,
) -> Checkpoint:
    """Read a checkpoint folder; load optimizer and scheduler states in place; restore the global RNGs.

    Tensor groups are returned on CPU; the caller loads them into its modules (see `load_into`). A sharded
    run passes the `sharded/` tensors it read (flowgrpo.checkpoint.shards), keyed "tensors.<group>/<name>" and
    "optim.<name>/<index>.<key>": they join the groups and optimizer states.
    """
    path = Path(path)
    if not (path / "state.json").is_file():
        raise CheckpointError(f"{path}: not a complete checkpoint (no state.json)")
    raw = _read_json(path / "state.json")
    if raw.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{path}: format version {raw.get('format_version')}, expected {FORMAT_VERSION}")
    tensors = {}
    for f in sorted(path.glob("tensors.*.safetensors")):
        tensors[f.name[len("tensors.") : -len(".safetensors")]] = _load_tensors(f)
    shards = shards or {}
    for key, value in shards.items():
        if key.startswith("tensors."):
            group, name = key[len("tensors.") :].split("/", 1)
            tensors.setdefault(group, {})[name] = value
    for name, opt in (optimizers or {}).items():
        meta_path = path / f"optim.{name}.json"
        if not meta_path.is_file():
            raise CheckpointError(f"{path}: no optimizer state '{name}'")
        meta = _read_json(meta_path)
        saved = _load_tensors(path / f"optim.{name}.safetensors")
        prefix = f"optim.{name}/"
        saved.update({k[len(prefix) :]: v for k, v in shards.items() if k.startswith(prefix)})
        missing = [k for k in meta.get("sharded_keys", []) if k not in saved]
        if missing:
            raise CheckpointError(f"{path}: optimizer '{name}' has sharded states but none were read ({missing[0]})")
        opt.load_state_dict(_optimizer_state(saved, meta))
    for name, sched in (schedulers or {}).items():
        if name not in raw["schedulers"]:
            raise CheckpointError(f"{path}: no scheduler state '{name}'")
        sched.load_state_dict(raw["schedulers"][name])
    if restore_rng:
        set_rng_state(_load_tensors(path / "rng.safetensors"), raw["rng"])
    config = _read_json(path / "config.json") if (path / "config.json").is_file() else None
    return Checkpoint(path, int(raw["step"]), tensors, raw["state"], config, raw)


def load_into(module: torch.nn.Module, tensors: Mapping[str, torch.Tensor], *, strict_keys: bool = True) -> None:
    """Copy saved tensors into a module's parameters/buffers by name (a subset of the module is fine).

    strict_keys: every saved name must exist in the module.
    """
    own = dict(module.named_parameters())
    own.update(dict(module.named_buffers()))
    missing = [k for k in tensors if k not in own]
    if missing and strict_keys:
        raise CheckpointError(f"checkpoint tensors not in the model: {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    with torch.no_grad():
        for name, value in tensors.items():
            if name in own:
                if own[name].shape != value.shape:
                    raise CheckpointError(
                        f"'{name}': checkpoint shape {list(value.shape)}, model shape {list(own[name].shape)}"
                    )
                own[name].copy_(value)
