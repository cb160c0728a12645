"""A run's output folder: one run at a time (a lock), and an earlier run's files are never overwritten.

lock_run_folder   an OS advisory lock (flock) on `<output_dir>/.flowgrpo.lock`, held for the run's life by the
                  process that writes the folder (rank 0 of a launch). The kernel drops it when the process dies,
                  however it dies (kill -9 included), so a lock is never stale; the file records the holder's pid
                  and host, which a refused run names. A second lock on a folder this process holds already (a
                  second trainer built in one Python process, one after another) shares it.
earlier_run       the files an earlier run left in the folder (config.yaml, metrics.jsonl) when it left no
                  checkpoint (killed before its first one); `set_aside` moves them into `earlier_run_<n>/`.
"""

from __future__ import annotations

import errno
import fcntl
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from ..atomic_io import WriteFailed, os_error_text
from ..config import ConfigError

LOCK_NAME = ".flowgrpo.lock"
# what every run writes first (config.yaml) or as it goes (metrics.jsonl): their presence means an earlier run
EARLIER_RUN_MARKS = ("config.yaml", "metrics.jsonl")
# what a run leaves in its folder besides checkpoints and final models, moved aside together
EARLIER_RUN_FILES = ("config.yaml", "metrics.jsonl", "grids", "tensorboard", "eval_final.json", "reward_curve.png")
EARLIER_FOLDER = "earlier_run_{}"


@dataclass
class _Held:
    fd: int
    path: Path
    pid: int
    count: int


_HELD: dict[str, _Held] = {}  # this process's locks, by the lock file's resolved path


def _forget_after_fork() -> None:
    """A forked child does not hold its parent's locks: close its copies (the parent's lock stays), so that a
    worker outliving a killed parent does not keep the folder locked."""
    for held in _HELD.values():
        try:
            os.close(held.fd)
        except OSError:
            pass
    _HELD.clear()


os.register_at_fork(after_in_child=_forget_after_fork)


class RunFolderLock:
    """This process's hold on a run folder; `release()` (idempotent) lets it go, and removes the lock file when
    the last holder in this process lets go."""

    def __init__(self, key: str) -> None:
        self._key: Optional[str] = key

    @property
    def held(self) -> bool:
        return self._key is not None

    def release(self) -> None:
        key, self._key = self._key, None
        held = _HELD.get(key) if key is not None else None
        if key is None or held is None or held.pid != os.getpid():
            return
        held.count -= 1
        if held.count > 0:
            return
        del _HELD[key]
        try:
            held.path.unlink(missing_ok=True)  # while still locked: a run waiting on this file sees it go
        except OSError:
            pass
        os.close(held.fd)  # drops the lock


def _holder(fd: int) -> str:
    """The pid (and host, when not this one) the lock file records; its holder writes it right after locking."""
    for _ in range(50):
        try:
            text = os.pread(fd, 200, 0).decode("utf-8", "replace").split()
        except OSError:
            text = []
        if text:
            pid = text[0]
            host = text[1] if len(text) > 1 else ""
            return f"pid {pid}" + (f" on {host}" if host and host != socket.gethostname() else "")
        time.sleep(0.01)
    return "pid unknown"


def lock_run_folder(folder: Path) -> RunFolderLock:
    """Lock `folder` for this run (ConfigError naming the folder and the holder's pid when another run holds it;
    WriteFailed when the lock file cannot be created). Releases on `release()` or when the process ends."""
    path = folder / LOCK_NAME
    key = str(path.resolve())
    held = _HELD.get(key)
    if held is not None and held.pid == os.getpid():
        held.count += 1
        return RunFolderLock(key)
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as err:
            raise WriteFailed(f"could not create the lock file {path}: {os_error_text(err)}") from err
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            holder = _holder(fd)
            os.close(fd)
            if err.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise ConfigError(
                    f"{folder} is in use by another run ({holder}): wait for it to end, or choose another "
                    "output_dir (nothing was written)"
                ) from None
            raise WriteFailed(f"could not lock {path}: {os_error_text(err)}") from err
        try:
            same = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)  # the previous holder removed the file between our open and our lock: lock the new one
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()} {socket.gethostname()}\n".encode(), 0)
    except OSError:
        pass  # the lock holds without the pid (a full disk): a refused run then says "pid unknown"
    _HELD[key] = _Held(fd, path, os.getpid(), 1)
    return RunFolderLock(key)


def earlier_run(folder: Path) -> list[str]:
    """The names of an earlier run's files in `folder` (config.yaml, metrics.jsonl), empty when there are none."""
    return [name for name in EARLIER_RUN_MARKS if (folder / name).exists()]


def refuse_earlier_files(folder: Path, unit: str) -> None:
    """A run that does not resume must not overwrite an earlier run that left files but no checkpoint (killed
    before its first one). Called after the refusal of an earlier run's checkpoints."""
    found = earlier_run(folder)
    if found:
        raise ConfigError(
            f"{folder} holds an earlier run ({', '.join(found)}) but no checkpoint: set resume=true to start it "
            f"again at {unit} 0 (its files are kept, moved to {folder / EARLIER_FOLDER.format('<n>')}/), or choose "
            "another output_dir (nothing was overwritten)"
        )


def set_aside(folder: Path) -> Optional[Path]:
    """Move an earlier run's files (config.yaml, metrics.jsonl, grids, ...) into a new `earlier_run_<n>/`; returns
    it (None when there was nothing to move)."""
    names = [name for name in EARLIER_RUN_FILES if (folder / name).exists()]
    if not names:
        return None
    n = 1
    while (folder / EARLIER_FOLDER.format(n)).exists():
        n += 1
    dest = folder / EARLIER_FOLDER.format(n)
    try:
        dest.mkdir()
        for name in names:
            os.rename(folder / name, dest / name)
    except OSError as err:
        raise WriteFailed(f"could not move the earlier run's files into {dest}: {os_error_text(err)}") from err
    return dest
