"""Durable files: JSON that keeps tuples apart from lists, fsync of files and folders, atomic text replacement.

Shared by the checkpoints (flowgrpo.checkpoint), the sharded checkpoints (flowgrpo.scaling.sharding), the
metrics.jsonl rewrite on resume (flowgrpo.metrics) and the run loop's config.yaml and final-model export.

A run's file that cannot be written (a full disk, a read-only folder) is `WriteFailed`: one line naming the file
and the OS error, which the `flowgrpo` command prints with exit 2; `os_error_text` words the OS error.
"""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable

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


class WriteFailed(RuntimeError):
    """A run's file could not be written (a full disk, a read-only folder): the message names the file and the OS
    error in one line; what was saved before is intact."""


# errors that only a write gives (an EACCES / EPERM may be a read too: callers also check the file's folder)
WRITE_ERRNOS = frozenset(
    e for e in (errno.ENOSPC, getattr(errno, "EDQUOT", None), errno.EROFS, errno.EFBIG) if e is not None
)


def os_error_text(err: BaseException) -> str:
    """An OS error in a few words: "ENOSPC: No space left on device"; other errors as "Type: message"."""
    if isinstance(err, OSError) and err.errno is not None:
        return f"{errno.errorcode.get(err.errno, err.errno)}: {err.strerror or err}"
    return f"{type(err).__name__}: {err}"


def is_io_error(err: BaseException) -> bool:
    """An OSError, or a safetensors error that wraps one (safetensors reports a failed write as
    `SafetensorError("Error while serializing: I/O error: No space left on device (os error 28) ...")`)."""
    if isinstance(err, OSError):
        return True
    return type(err).__name__ == "SafetensorError" and ("I/O error" in str(err) or "os error" in str(err))


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


def _mode_for(path: Path) -> int:
    """The permissions a replacement of `path` gets: the old file's, or a new file's under the umask (a temporary
    file is created 0600)."""
    try:
        return path.stat().st_mode & 0o777
    except OSError:
        mask = os.umask(0)
        os.umask(mask)
        return 0o666 & ~mask


def replace_text_atomically(path: Path, text: str) -> None:
    """Write `text` to a temporary file next to `path`, fsync it and rename it over `path`: a crash leaves
    either the old file or the new one, and no temporary file behind."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        os.chmod(tmp, _mode_for(path))
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def replace_atomically(path: Path, write: Callable[[Path], None]) -> None:
    """`write(tmp)` writes the new file to a temporary path next to `path`; it is fsynced and renamed over
    `path`. A failure leaves the old file whole and no temporary file behind."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    os.close(fd)
    try:
        os.chmod(tmp, _mode_for(path))
        write(Path(tmp))
        fsync_file(tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def replace_folder(new: Path, dest: Path) -> None:
    """Move the folder (or file) `new` to `dest`, replacing what is there: the old one is moved aside first and
    put back if the move fails, then removed."""
    for f in [new] if new.is_file() else [f for f in new.rglob("*") if f.is_file()]:
        fsync_file(f)
    old = None
    if dest.exists() or dest.is_symlink():
        old = dest.with_name(f".old-{dest.name}-{os.getpid()}")
        os.rename(dest, old)
    try:
        os.rename(new, dest)
    except BaseException:
        if old is not None:
            os.rename(old, dest)
        raise
    fsync_dir(dest.parent)
    if old is not None:
        if old.is_dir() and not old.is_symlink():
            shutil.rmtree(old, ignore_errors=True)
        else:
            old.unlink(missing_ok=True)


def own_storage(t: torch.Tensor) -> torch.Tensor:
    """`t` in a storage of its own, as safetensors writes tensors: a DeepSpeed ZeRO engine keeps the trained
    weights as views into one flat buffer (copied to the host, one tensor at a time)."""
    t = t.contiguous()
    if t.untyped_storage().nbytes() != t.numel() * t.element_size():
        return t.to("cpu", copy=True)
    return t
