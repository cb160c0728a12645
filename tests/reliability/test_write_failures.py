"""A write that fails (a full disk: ENOSPC injected into a real `flowgrpo` process) stops the run with one line
naming the file and the OS error (exit 2), and loses nothing already saved: the previous checkpoint, the
records before the failed one, the earlier config.yaml and final model stay whole, and no staging folder is
left. Every write path of a run: a checkpoint, metrics.jsonl, config.yaml, a grid, reward_curve.png, the
final model export."""

import errno
import os
import subprocess
from pathlib import Path

import pytest

from flowgrpo.checkpoint import list_checkpoints, verify_checkpoint
from flowgrpo.metrics import read_metrics

from .cli_helpers import ROOT, one_line_error, run_cli

TEXT = str(ROOT / "configs/text/tiny_pattern.yaml")
T2I = str(ROOT / "configs/t2i/tiny/flow_grpo.yaml")
ENOSPC = f"ENOSPC: {os.strerror(errno.ENOSPC)}"

# the start of every injected fault: `full()` is the OSError a full disk gives
PREAMBLE = """
import errno, os, sys
from pathlib import Path
def full(filename=None):
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), *([str(filename)] if filename else []))
"""


def _run(command: str, config: str, out: Path, *extra: str, fault: str = "") -> subprocess.CompletedProcess:
    """`flowgrpo <command> <config> output_dir=<out> <extra>` in its own (forked) process, with `fault` (Python
    run first there: it patches the already imported modules, so a fault replaces a module attribute that the
    code looks up when it writes)."""
    argv = [command, config, "progress=false", f"output_dir={out}", *extra]
    if command == "train-t2i":
        argv += ["artifacts.tensorboard=false"]
    return run_cli(*argv, cwd=out.parent, prelude=PREAMBLE + fault)


def _checkpoints(out: Path) -> list[str]:
    """The checkpoints under out/checkpoints, each verified against its manifest; nothing else is there."""
    root = out / "checkpoints"
    found = list_checkpoints(root)
    assert sorted(p.name for p in root.iterdir()) == [p.name for p in found]  # no staging folder left behind
    for path in found:
        assert verify_checkpoint(path) == [], path
    return [p.name for p in found]


def _no_staging(out: Path) -> None:
    assert not [p.name for p in out.iterdir() if p.name.startswith(".")], list(out.iterdir())


def test_a_checkpoint_write_that_fails_is_one_line_and_keeps_the_previous_one(tmp_path):
    out = tmp_path / "run"
    fault = """
import flowgrpo.checkpoint.format as ck
real = ck._save_tensors
def save(tensors, path):  # step 2: the weights are written, then the disk fills up on the optimizer state
    if path.parent.name.startswith(".tmp-step_00000002") and path.name.startswith("optim."):
        path.write_bytes(b"half")
        raise full()
    return real(tensors, path)
ck._save_tensors = save
"""
    done = _run("train-text", TEXT, out, "iterations=3", "checkpoint.every=1", "checkpoint.keep_last=1", fault=fault)
    one_line_error(done, f"could not save checkpoint {out / 'checkpoints' / 'step_00000002'}", ENOSPC,
              "earlier checkpoints", "intact")  # fmt: skip
    assert _checkpoints(out) == ["step_00000001"]  # keep_last=1 rotated nothing away
    # the record of step 2 went out before its checkpoint; a resume drops it and goes on from step 1
    resumed = _run("train-text", TEXT, out, "iterations=3", "checkpoint.every=1", "checkpoint.keep_last=1",
                   "resume=true")  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert [r["iteration"] for r in read_metrics(out / "metrics.jsonl")] == [1, 2, 3]


def test_a_metrics_write_that_fails_is_one_line_and_keeps_the_records_before(tmp_path):
    out = tmp_path / "run"
    fault = """
import pathlib
_open = pathlib.Path.open
class Full:  # metrics.jsonl on a disk that fills up half-way through the second record
    def __init__(self, f):
        self.f, self.lines = f, 0
    def write(self, text):
        self.lines += 1
        if self.lines == 2:
            self.f.write(text[:10])
            self.f.flush()
            raise full()
        return self.f.write(text)
    def flush(self):
        self.f.flush()
    def close(self):
        self.f.close()
def opener(self, mode="r", *args, **kwargs):
    f = _open(self, mode, *args, **kwargs)
    return Full(f) if self.name == "metrics.jsonl" and mode in ("a", "w") else f
pathlib.Path.open = opener
"""
    done = _run("train-text", TEXT, out, "iterations=3", "checkpoint.every=1", fault=fault)
    one_line_error(done, f"could not write {out / 'metrics.jsonl'}", ENOSPC, "step_00000001", "resume=true")
    assert _checkpoints(out) == ["step_00000001"]
    with pytest.warns(UserWarning, match="partial last line"):
        assert [r["iteration"] for r in read_metrics(out / "metrics.jsonl")] == [1]


def test_a_config_write_that_fails_keeps_the_earlier_config(tmp_path):
    out = tmp_path / "run"
    assert _run("train-text", TEXT, out, "iterations=1").returncode == 0
    config = (out / "config.yaml").read_bytes()
    fault = """
import flowgrpo.run.loop as loop
def dump_config(cfg, path):
    Path(path).write_text("iterations: ")  # torn by a full disk
    raise full(path)
loop.dump_config = dump_config
"""
    done = _run("train-text", TEXT, out, "iterations=2", "resume=true", fault=fault)
    one_line_error(done, "config.yaml", ENOSPC)
    assert (out / "config.yaml").read_bytes() == config
    assert _checkpoints(out) == ["step_00000001"]
    _no_staging(out)


@pytest.mark.parametrize("where", ["grid", "reward_curve"])
def test_an_image_artifact_write_that_fails_is_one_line(tmp_path, where):
    out = tmp_path / "run"
    fault = {
        "grid": """
import flowgrpo.t2i.artifacts as artifacts
real = artifacts.save_grid
def save_grid(images, path, *args, **kwargs):
    if path.name == "rollout_000002.png":
        raise full()  # PIL writing the PNG: no file name in the error
    return real(images, path, *args, **kwargs)
artifacts.save_grid = save_grid
""",
        "reward_curve": """
import flowgrpo.t2i.artifacts as artifacts
def plot_rewards(metrics, out):
    raise full(out)
artifacts.plot_rewards = plot_rewards
""",
    }[where]
    extra = ["iterations=2", "checkpoint.every=1", "artifacts.grid_every=1", "checkpoint.save_final_model=false"]
    done = _run("train-t2i", T2I, out, *extra, fault=fault)
    last = one_line_error(done, f"a write under {out} failed", ENOSPC, "is intact", "resume=true")
    if where == "reward_curve":
        assert "reward_curve.png" in last
        assert _checkpoints(out) == ["step_00000001", "step_00000002"]
    else:
        assert _checkpoints(out) == ["step_00000001"]


def test_a_final_model_export_that_fails_keeps_the_earlier_export(tmp_path):
    out = tmp_path / "run"
    args = ["checkpoint.every=1", "checkpoint.save_final_model=true"]
    assert _run("train-text", TEXT, out, "iterations=1", *args).returncode == 0
    exported = {p.name: p.read_bytes() for p in (out / "final").iterdir()}
    assert "model.safetensors" in exported
    fault = """
import transformers.modeling_utils as mu
def safe_save_file(tensors, filename, *args, **kwargs):
    Path(filename).write_bytes(b"half a model")  # the disk fills up half-way through the weights
    raise full(filename)
mu.safe_save_file = safe_save_file
"""
    done = _run("train-text", TEXT, out, "iterations=2", "resume=true", *args, fault=fault)
    one_line_error(done, f"could not export the final model under {out}", ENOSPC, "earlier export is unchanged",
              "step_00000002")  # fmt: skip
    assert {p.name: p.read_bytes() for p in (out / "final").iterdir()} == exported
    assert _checkpoints(out) == ["step_00000001", "step_00000002"]
    _no_staging(out)
    again = _run("train-text", TEXT, out, "iterations=2", "resume=true", *args)  # resume=true exports it again
    assert again.returncode == 0, again.stderr[-3000:]
    assert (out / "final" / "model.safetensors").read_bytes() != exported["model.safetensors"]
