"""The README's Quickstart on an install without extras: no torchvision (the Quickstart must work on a bare install)."""

from .cli_helpers import ROOT, run_cli


def test_train_t2i_runs_without_torchvision(tmp_path):
    done = run_cli(
        "train-t2i",
        str(ROOT / "configs/t2i/demo.yaml"),
        "iterations=1",
        "progress=false",
        "artifacts.tensorboard=false",
        "eval.images_per_prompt=1",
        f"output_dir={tmp_path / 'run'}",
        cwd=tmp_path,
        bare=True,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "Traceback" not in done.stderr
    assert (tmp_path / "run" / "metrics.jsonl").is_file()


def test_train_text_runs_without_torchvision(tmp_path):
    done = run_cli(
        "train-text",
        str(ROOT / "configs/text/tiny_pattern.yaml"),
        "iterations=1",
        "progress=false",
        f"output_dir={tmp_path / 'run'}",
        cwd=tmp_path,
        bare=True,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert (tmp_path / "run" / "metrics.jsonl").is_file()


def test_torchvision_is_reported_missing_not_raised():
    code = "import importlib.util, torchvision_cpu_hook; print(importlib.util.find_spec('torchvision'))"
    from .cli_helpers import _HIDE_TORCHVISION
    import os
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", _HIDE_TORCHVISION + code],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "None"
