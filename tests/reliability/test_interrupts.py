"""Ctrl-C and SIGTERM finish the current update, save a checkpoint and stop; resume continues from it; the
default config checkpoints periodically. Through the `flowgrpo` command."""

import signal
import time
from pathlib import Path

import pytest

from flowgrpo.checkpoint import latest_checkpoint
from flowgrpo.metrics import read_metrics
from flowgrpo.t2i import load_t2i_config
from flowgrpo.text import load_text_config

from .cli_helpers import ROOT, ForkedCli, start_cli


def _start(tmp_path: Path, *argv: str) -> ForkedCli:
    # a fork of the server that imported torch once (cli_helpers.run_cli): its own process, signalled by pid
    return start_cli(*argv, cwd=tmp_path)


def _wait_for_records(metrics: Path, n: int, proc: ForkedCli, limit_s: float = 300) -> None:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"the run ended early: {proc.stderr_text()[-2000:]}")
        if metrics.is_file() and len(metrics.read_text().splitlines()) >= n:
            return
        time.sleep(0.05)
    raise AssertionError("no progress")


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_text_signal_saves_and_resume_continues(tmp_path, sig):
    args = [
        "train-text",
        str(ROOT / "configs/text/tiny_pattern.yaml"),
        "progress=false",
        "checkpoint.every=0",
        f"output_dir={tmp_path / 'run'}",
    ]
    proc = _start(tmp_path, *args, "iterations=200")
    _wait_for_records(tmp_path / "run" / "metrics.jsonl", 2, proc)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + sig, err[-2000:]
    assert err.strip().splitlines()[-1].startswith(f"flowgrpo: stopped by {sig.name} after step")
    saved = latest_checkpoint(tmp_path / "run" / "checkpoints")
    assert saved is not None, "checkpoint.every=0 (only at the end) still saves on the signal"
    step = int(saved.name.split("_")[1])
    assert step >= 2
    resumed = _start(tmp_path, *args, f"iterations={step + 1}", "resume=true")
    _, err = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, err[-2000:]
    assert [r["iteration"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl")] == list(range(1, step + 2))


def test_t2i_sigterm_saves(tmp_path):
    proc = _start(
        tmp_path,
        "train-t2i",
        str(ROOT / "configs/t2i/tiny/flow_grpo.yaml"),
        "progress=false",
        "checkpoint.every=0",
        "iterations=100",
        "artifacts.tensorboard=false",
        f"output_dir={tmp_path / 'run'}",
    )
    _wait_for_records(tmp_path / "run" / "metrics.jsonl", 1, proc)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 128 + signal.SIGTERM, err[-2000:]
    saved = latest_checkpoint(tmp_path / "run" / "checkpoints")
    assert saved is not None and int(saved.name.split("_")[1]) >= 1


def test_periodic_checkpoints_by_default():
    assert load_text_config().checkpoint.every > 0
    assert load_t2i_config(ROOT / "configs/t2i/demo.yaml").checkpoint.every > 0
