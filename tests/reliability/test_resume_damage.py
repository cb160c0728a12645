"""Resume survives damage (a crash must never lose more than the last checkpoint): a torn last line
in metrics.jsonl, a metrics rewrite killed half-way, a truncated or altered checkpoint file. Through
`flowgrpo train-text ... resume=true`."""

import json
import os
from pathlib import Path

import pytest

from flowgrpo.metrics import read_metrics, truncate_metrics

from .cli_helpers import ROOT, run_cli

TINY = str(ROOT / "configs/text/tiny_pattern.yaml")


def _text(tmp_path: Path, *extra: str):
    return run_cli(
        "train-text",
        TINY,
        "progress=false",
        f"output_dir={tmp_path / 'run'}",
        "checkpoint.every=1",
        "checkpoint.keep_last=3",
        *extra,
        cwd=tmp_path,
    )


def test_resume_after_a_torn_metrics_line(tmp_path):
    assert _text(tmp_path, "iterations=2").returncode == 0
    metrics = tmp_path / "run" / "metrics.jsonl"
    with metrics.open("a") as f:
        f.write('{"iteration": 3, "reward_mean": 0.4')  # a crash mid-write: no closing brace, no newline
    done = _text(tmp_path, "iterations=4", "resume=true")
    assert done.returncode == 0, done.stderr[-2000:]
    assert [r["iteration"] for r in read_metrics(metrics)] == [1, 2, 3, 4]


def test_metrics_rewrite_is_atomic(tmp_path, monkeypatch):
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps({"iteration": s}) + "\n" for s in range(1, 6)))
    before = metrics.read_text()

    def killed(*args):
        raise KeyboardInterrupt  # as if the process died between writing the new file and renaming it

    monkeypatch.setattr(os, "replace", killed)
    with pytest.raises(KeyboardInterrupt):
        truncate_metrics(metrics, 3)
    assert metrics.read_text() == before
    assert [p.name for p in tmp_path.iterdir()] == ["metrics.jsonl"]  # no temporary file left behind
    monkeypatch.undo()
    truncate_metrics(metrics, 3)
    assert [r["iteration"] for r in read_metrics(metrics)] == [1, 2, 3]


def _first(folder: Path, pattern: str) -> Path:
    return sorted(folder.glob(pattern))[0]


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_resume_falls_back_past_a_damaged_checkpoint(tmp_path, damage):
    assert _text(tmp_path, "iterations=3").returncode == 0
    ckpts = tmp_path / "run" / "checkpoints"
    weights = _first(ckpts / "step_00000003", "tensors.*.safetensors")
    data = weights.read_bytes()
    if damage == "truncate":  # a full disk: the file stops half-way
        weights.write_bytes(data[: len(data) // 2])
    else:  # same size, one byte changed
        weights.write_bytes(data[:-10] + bytes([data[-10] ^ 0xFF]) + data[-9:])
    done = _text(tmp_path, "iterations=4", "resume=true")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "step_00000003 is damaged" in done.stderr and weights.name in done.stderr
    assert "resumed from" in done.stderr and "step_00000002" in done.stderr
    assert [r["iteration"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl")] == [1, 2, 3, 4]


def test_every_checkpoint_damaged_is_one_line(tmp_path):
    assert _text(tmp_path, "iterations=1").returncode == 0
    weights = _first(tmp_path / "run" / "checkpoints" / "step_00000001", "tensors.*.safetensors")
    weights.write_bytes(weights.read_bytes()[:100])
    done = _text(tmp_path, "iterations=2", "resume=true")
    assert done.returncode == 2
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("flowgrpo: every checkpoint under") and "step_00000001" in last
    assert "Traceback" not in done.stderr


def test_resume_with_a_changed_setting_is_refused_naming_it(tmp_path):
    assert _text(tmp_path, "iterations=1").returncode == 0
    done = _text(tmp_path, "iterations=2", "resume=true", "optim.lr=0.001")
    assert done.returncode == 2, done.stderr[-2000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("flowgrpo: resume: optim.lr: 0.02 in the checkpoint, 0.001 now")
    assert "Traceback" not in done.stderr
    assert _text(tmp_path, "iterations=2", "resume=true", "progress=true").returncode == 0  # free keys still change
