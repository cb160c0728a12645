"""Resume survives damage (issue 16, items 9 and 11): a torn last line in metrics.jsonl, a metrics rewrite
killed half-way, a truncated or altered checkpoint file. Through `flowgrpo train-text ... resume=true`."""

import json
import os
from pathlib import Path

import pytest

from flowgrpo.metrics import read_metrics, truncate_metrics

from .cli_helpers import ROOT, run_cli

TINY = str(ROOT / "configs/text/tiny_pattern.yaml")


def _text(tmp_path: Path, *extra: str):
    return run_cli("train-text", TINY, "progress=false", f"output_dir={tmp_path / 'run'}", "checkpoint.every=1",
                   "checkpoint.keep_last=3", *extra, cwd=tmp_path)


def test_resume_after_a_torn_metrics_line(tmp_path):
    assert _text(tmp_path, "steps=2").returncode == 0
    metrics = tmp_path / "run" / "metrics.jsonl"
    with metrics.open("a") as f:
        f.write('{"step": 3, "reward_mean": 0.4')  # a crash mid-write: no closing brace, no newline
    done = _text(tmp_path, "steps=4", "resume=true")
    assert done.returncode == 0, done.stderr[-2000:]
    assert [r["step"] for r in read_metrics(metrics)] == [1, 2, 3, 4]


def test_metrics_rewrite_is_atomic(tmp_path, monkeypatch):
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps({"step": s}) + "\n" for s in range(1, 6)))
    before = metrics.read_text()

    def killed(*args):
        raise KeyboardInterrupt  # as if the process died between writing the new file and renaming it

    monkeypatch.setattr(os, "replace", killed)
    with pytest.raises(KeyboardInterrupt):
        truncate_metrics(metrics, 3, "step")
    assert metrics.read_text() == before
    assert [p.name for p in tmp_path.iterdir()] == ["metrics.jsonl"]  # no temporary file left behind
    monkeypatch.undo()
    truncate_metrics(metrics, 3, "step")
    assert [r["step"] for r in read_metrics(metrics)] == [1, 2, 3]
