"""Run the `flowgrpo` command in its own process, as a user would (optionally with torchvision hidden).

A plain call is a fork of the test process's fork server, which imported torch, diffusers and transformers once
(tests/rank_process.py): the command runs in its own OS process, folder and environment, with its own exit code
and output, ~4 s sooner. `bare=True` (torchvision hidden) and an `env` of the test's own (read by libraries at
import) start a fresh interpreter instead. `start_cli` forks the same way without waiting, for tests that watch
a run and signal or kill it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# a bare install has no torchvision (it is only in the `clip` extra): every path finder misses it
_HIDE_TORCHVISION = """
import importlib.machinery
_find = importlib.machinery.PathFinder.find_spec.__func__
def _hidden(cls, name, path=None, target=None):
    return None if name == "torchvision" or name.startswith("torchvision.") else _find(cls, name, path, target)
importlib.machinery.PathFinder.find_spec = classmethod(_hidden)
"""


def run_cli(
    *argv: str, cwd: Path, bare: bool = False, timeout: float = 600, env: dict | None = None, prelude: str = ""
) -> subprocess.CompletedProcess:
    """`flowgrpo argv...` in `cwd`, `prelude` (Python, e.g. an injected fault) run first in that process; returns
    the finished process (text stdout / stderr)."""
    if not bare and env is None:
        return _forked(list(argv), cwd, timeout, prelude)
    if prelude:
        raise ValueError("a prelude runs in the forked process only (not bare, no env)")
    code = (
        _HIDE_TORCHVISION if bare else ""
    ) + "import sys\nfrom flowgrpo.cli import main\nsys.exit(main(sys.argv[1:]))\n"
    full_env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT), **(env or {})}
    return subprocess.run(
        [sys.executable, "-c", code, *argv], cwd=cwd, env=full_env, capture_output=True, text=True, timeout=timeout
    )


def _forked(argv: list[str], cwd: Path, timeout: float, prelude: str = "") -> subprocess.CompletedProcess:
    started = start_cli(*argv, cwd=cwd, prelude=prelude)
    out, err = started.communicate(timeout)
    return subprocess.CompletedProcess(["flowgrpo", *argv], started.returncode, out, err)


class ForkedCli:
    """A running `flowgrpo argv...` forked from the fork server, with the part of Popen's interface the tests use:
    pid, poll(), send_signal(), communicate(timeout) -> (stdout, stderr), returncode (-N when killed by signal N)."""

    def __init__(self, argv: list[str], cwd: Path, prelude: str = ""):
        import tempfile

        import rank_process

        ctx = rank_process.start_server()
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
        self.argv = argv
        self._tmp = tempfile.TemporaryDirectory()
        self._out, self._err = Path(self._tmp.name) / "stdout", Path(self._tmp.name) / "stderr"
        args = (argv, env, str(cwd), str(self._out), str(self._err), prelude)
        self.proc = ctx.Process(target=rank_process.run_cli_main, args=args)
        self.proc.start()
        self.returncode: int | None = None

    @property
    def pid(self) -> int:
        assert self.proc.pid is not None
        return self.proc.pid

    def poll(self) -> int | None:
        self.returncode = self.proc.exitcode
        return self.returncode

    def send_signal(self, sig: int) -> None:
        os.kill(self.pid, sig)

    def stderr_text(self) -> str:
        return self._err.read_text(errors="replace") if self._err.exists() else ""

    def communicate(self, timeout: float) -> tuple[str, str]:
        self.proc.join(timeout)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()
            self._tmp.cleanup()
            raise subprocess.TimeoutExpired(["flowgrpo", *self.argv], timeout)
        self.returncode = self.proc.exitcode
        out = self._out.read_text(errors="replace") if self._out.exists() else ""
        err = self.stderr_text()
        self._tmp.cleanup()
        return out, err


def start_cli(*argv: str, cwd: Path, prelude: str = "") -> ForkedCli:
    """`flowgrpo argv...` started in the background as a fork of the fork server (see run_cli), so that a test
    can watch it and signal it."""
    return ForkedCli(list(argv), cwd, prelude)


def one_line_error(done: subprocess.CompletedProcess, *needles: str, prefix: str = "flowgrpo") -> str:
    """The command failed with exit 2 and no traceback, its last stderr line (`<prefix>...: why`) holding every
    needle; returns that line."""
    assert done.returncode == 2, (done.returncode, done.stderr[-3000:])
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith(prefix), last
    for needle in needles:
        assert needle in last, (needle, last)
    return last


def blocking_outcome(call, limit_s: float = 20.0) -> tuple[BaseException | None, float]:
    """Run `call` in a thread: the error it raised (None if none) and its seconds; fails instead of hanging past
    limit_s."""
    import threading
    import time

    box: list = [None]

    def run():
        try:
            call()
        except BaseException as err:  # noqa: BLE001 - handed to the test
            box[0] = err

    start = time.monotonic()
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(limit_s)
    assert not thread.is_alive(), f"the call was still blocked after {limit_s}s"
    return box[0], time.monotonic() - start
