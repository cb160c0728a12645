"""Durable files: JSON that keeps tuples apart from lists, fsync of files and folders, atomic text replacement.

Shared by the checkpoints (flowgrpo.checkpoint), the sharded checkpoints (flowgrpo.scaling.sharding) and the
metrics.jsonl rewrite on resume (flowgrpo.metrics).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch


class TensorInJSONError(TypeError):
    """A tensor reached a value meant for JSON (tensors belong in safetensors files)."""


def to_json(value: Any) -> Any:
    """JSON-able copy that keeps tuples apart from lists (optimizer betas, RNG states) and dicts with non-string
    keys apart from plain ones; numpy scalars become Python numbers. `from_json` inverts it."""
    if isinstance(value, tuple):
        return {"__tuple__": [to_json(v) for v in value]}
    if isinstance(value, list):
        return [to_json(v) for v in value]
    if isinstance(value, dict):
        bad = [k for k in value if not isinstance(k, str)]
        if bad:
            return {"__intkeys__": [[k, to_json(v)] for k, v in value.items()]}
        return {k: to_json(v) for k, v in value.items()}
    if isinstance(value, (np.integer,)):
        return int(value)
    if isinstance(value, (np.floating,)):
        return float(value)
    if isinstance(value, torch.Tensor):
        raise TensorInJSONError("a tensor reached the JSON part of a checkpoint; tensors go to safetensors")
    return value


def from_json(value: Any) -> Any:
    """The value `to_json` was given (tuples and non-string keys restored)."""
    if isinstance(value, list):
        return [from_json(v) for v in value]
    if isinstance(value, dict):
        if set(value) == {"__tuple__"}:
            return tuple(from_json(v) for v in value["__tuple__"])
        if set(value) == {"__intkeys__"}:
            return {k: from_json(v) for k, v in value["__intkeys__"]}
        return {k: from_json(v) for k, v in value.items()}
    return value


def fsync_file(path: str | Path) -> None:
    """Flush a written file's data to the disk."""
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def fsync_dir(path: str | Path) -> None:
    """Flush a folder's entries (a rename into it, a new file) to the disk; a no-op where the OS cannot."""
    try:
        fd = os.open(str(path), os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def replace_text_atomically(path: Path, text: str) -> None:
    """Write `text` to a temporary file next to `path`, fsync it and rename it over `path`: a crash leaves
    either the old file or the new one, and no temporary file behind."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def own_storage(t: torch.Tensor) -> torch.Tensor:
    """`t` in a storage of its own, as safetensors writes tensors: a DeepSpeed ZeRO engine keeps the trained
    weights as views into one flat buffer (copied to the host, one tensor at a time)."""
    t = t.contiguous()
    if t.untyped_storage().nbytes() != t.numel() * t.element_size():
        return t.to("cpu", copy=True)
    return t
