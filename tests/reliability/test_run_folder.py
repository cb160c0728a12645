"""A run folder holds one run at a time, and nothing an earlier run wrote is overwritten: a second run on a
folder in use is refused at once (one line naming the folder and the holder's pid, nothing written), the lock
dies with its process (kill -9 included), and an earlier run that left files but no checkpoint is refused like
one that left checkpoints, unless resume=true, which starts it again at step 0 with the earlier files moved to
`earlier_run_1/`. Through `flowgrpo train-text` in processes of their own."""

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from flowgrpo.checkpoint.run_folder import LOCK_NAME, lock_run_folder
from flowgrpo.metrics import read_metrics

from .cli_helpers import ROOT, ForkedCli, one_line_error, run_cli, start_cli

TINY = str(ROOT / "configs/text/tiny_pattern.yaml")


def _text(out: Path, *extra: str, cwd: Path) -> subprocess.CompletedProcess:
    return run_cli("train-text", TINY, "progress=false", f"output_dir={out}", *extra, cwd=cwd)


def _start_long_run(out: Path, cwd: Path) -> ForkedCli:
    """`flowgrpo train-text` with no checkpoint before its end (far away), once its first record is written."""
    argv = ["train-text", TINY, "progress=false", f"output_dir={out}", "iterations=100000", "checkpoint.every=0"]
    proc = start_cli(*argv, cwd=cwd)  # its own OS process (a fork that skips re-importing torch), killable by pid
    deadline = time.monotonic() + 300
    while not (out / "metrics.jsonl").is_file() or not read_metrics(out / "metrics.jsonl"):
        assert proc.poll() is None, proc.stderr_text()[-3000:]
        assert time.monotonic() < deadline, "no metrics record within 300 s"
        time.sleep(0.05)
    return proc


def _kill(proc: ForkedCli) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=30)
    assert proc.returncode == -signal.SIGKILL


def _files(folder: Path) -> dict[str, bytes]:
    """Every file under `folder` but the lock file (a killed run's stays; the next run removes it when it ends)."""
    found = {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}
    return {k: v for k, v in found.items() if k != LOCK_NAME}


def test_a_second_run_on_a_folder_in_use_is_refused_at_once(tmp_path):
    out = tmp_path / "run"
    first = _start_long_run(out, tmp_path)
    try:
        assert (out / LOCK_NAME).is_file()
        config = (out / "config.yaml").read_bytes()
        for extra in (["iterations=3"], ["iterations=3", "resume=true"]):  # resume=true takes no lock either
            started = time.monotonic()
            second = _text(out, *extra, cwd=tmp_path)
            one_line_error(second, f"{out} is in use by another run (pid {first.pid})", "nothing was written")
            assert time.monotonic() - started < 120
            assert (out / "config.yaml").read_bytes() == config  # the second run wrote nothing
            assert not (out / "checkpoints").exists() or not any((out / "checkpoints").iterdir())
        assert first.poll() is None  # the first run goes on
        before = len(read_metrics(out / "metrics.jsonl"))
        deadline = time.monotonic() + 120
        while len(read_metrics(out / "metrics.jsonl")) == before:  # and keeps writing whole records
            assert time.monotonic() < deadline
            time.sleep(0.05)
    finally:
        if first.poll() is None:
            _kill(first)  # kill -9: the kernel drops the lock with the process
    steps = [r["iteration"] for r in read_metrics(out / "metrics.jsonl")]
    assert steps == list(range(1, len(steps) + 1))  # one writer: no mangled or repeated records
    done = _text(out, "iterations=2", "resume=true", cwd=tmp_path)  # no stale lock after kill -9
    assert done.returncode == 0, done.stderr[-3000:]
    assert not (out / LOCK_NAME).exists()  # a run that ends removes its lock file


def test_an_earlier_run_without_checkpoints_is_never_overwritten(tmp_path):
    out = tmp_path / "run"
    _kill(_start_long_run(out, tmp_path))  # killed before its first checkpoint: config.yaml, metrics.jsonl only
    earlier = _files(out)
    assert {"config.yaml", "metrics.jsonl"} <= set(earlier)
    assert not any(k.startswith("checkpoints/") for k in earlier)

    fresh = _text(out, "iterations=2", cwd=tmp_path)
    one_line_error(fresh, f"{out} holds an earlier run (config.yaml, metrics.jsonl) but no checkpoint", "resume=true",
              "another output_dir", "nothing was overwritten")  # fmt: skip
    assert _files(out) == earlier

    resumed = _text(out, "iterations=2", "resume=true", cwd=tmp_path)  # starts again at 0; keeps the earlier files
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "earlier_run_1" in resumed.stderr
    assert _files(out / "earlier_run_1") == earlier
    assert [r["iteration"] for r in read_metrics(out / "metrics.jsonl")] == [1, 2]


@pytest.mark.heavy
def test_ranks_of_one_launch_share_the_lock_and_a_second_launch_is_refused_on_every_rank(tmp_path, launch_ranks):
    """Rank 0 holds the lock for its launch (the other ranks never refuse it); a launch on a folder another
    process holds stops on every rank at once with the same line, instead of waiting in a collective."""
    out = tmp_path / "run"
    args = [TINY, f"output_dir={out}", "progress=false", "iterations=2", "checkpoint.every=1"]
    launch_ranks("train_text.py", args, 2)  # two ranks of one launch: no refusal
    assert [r["iteration"] for r in read_metrics(out / "metrics.jsonl")] == [1, 2]
    assert not (out / LOCK_NAME).exists()

    held = lock_run_folder(out)  # this test process holds the folder now, as another run would
    try:
        results = launch_ranks("train_text.py", [*args, "iterations=3", "resume=true"], 2, timeout=300, check=False)
    finally:
        held.release()
    for code, stderr in results:
        assert code == 2, stderr[-3000:]
        assert f"{out} is in use by another run (pid {os.getpid()})" in stderr.strip().splitlines()[-1]
    assert [r["iteration"] for r in read_metrics(out / "metrics.jsonl")] == [1, 2]
