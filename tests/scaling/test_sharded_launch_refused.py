"""An FSDP / DeepSpeed `accelerate launch` is refused before any model loads: the trainers do not shard yet
(flowgrpo.scaling is not wired in), so every rank would silently hold the whole model."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from flowgrpo.config import ConfigError
from flowgrpo.distributed import Distributed, refuse_sharded_launch

from .test_accelerate_configs import ROOT, _launch_env

ACCELERATE = ROOT / "configs" / "accelerate"


@pytest.mark.parametrize("var", ["ACCELERATE_USE_FSDP", "ACCELERATE_USE_DEEPSPEED"])
@pytest.mark.parametrize("value", ["true", "True", "1"])  # accelerate writes "true" and "True"
def test_sharded_environment_is_refused(var, value):
    with pytest.raises(ConfigError, match="does not shard yet") as err:
        refuse_sharded_launch({var: value})
    assert "configs/accelerate/ddp.yaml" in str(err.value) and "_lora" in str(err.value)
    assert len(str(err.value).splitlines()) == 1


@pytest.mark.parametrize("env", [{}, {"ACCELERATE_USE_FSDP": "false"}, {"ACCELERATE_USE_DEEPSPEED": "False"}])
def test_plain_environment_passes(env):
    refuse_sharded_launch(env)


def test_from_environment_checks_first(monkeypatch):
    """Even one process (no WORLD_SIZE) stops: `from_environment` is the trainers' first step."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("ACCELERATE_USE_DEEPSPEED", raising=False)
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    with pytest.raises(ConfigError, match="FSDP"):
        Distributed.from_environment()
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "false")
    assert not Distributed.from_environment().active


@pytest.mark.parametrize(
    "name,refused",
    [
        ("ddp.yaml", False),
        ("fsdp2.yaml", True),
        ("fsdp2_two_nodes.yaml", True),
        ("deepspeed_zero2.yaml", True),
        ("deepspeed_zero3.yaml", True),
    ],
)
def test_the_shipped_accelerate_configs(name, refused):
    """The environment the installed accelerate exports for each shipped file."""
    _, env = _launch_env(ACCELERATE / name)
    if refused:
        with pytest.raises(ConfigError, match="does not shard yet"):
            refuse_sharded_launch(env)
    else:
        refuse_sharded_launch(env)


@pytest.mark.parametrize(
    "command,config",
    [("train-t2i", "configs/t2i/tiny/flow_grpo.yaml"), ("train-text", "configs/text/tiny_pattern.yaml")],
)
def test_both_trainers_stop_in_one_line_before_loading(tmp_path, command, config):
    out = tmp_path / "out"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT), "ACCELERATE_USE_DEEPSPEED": "true"}
    code = "import sys\nfrom flowgrpo.cli import main\nsys.exit(main(sys.argv[1:]))\n"
    argv = [sys.executable, "-c", code, command, str(ROOT / config), f"output_dir={out}"]
    done = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 2, (done.returncode, done.stderr[-2000:])
    text = done.stderr.strip()
    assert "Traceback" not in text and len(text.splitlines()) == 1, text
    assert "does not shard yet" in text and "DeepSpeed" in text
    assert not out.exists()  # stopped before the run loop made its folder, so before any model
