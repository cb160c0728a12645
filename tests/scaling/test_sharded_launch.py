"""What an `accelerate launch` with each shipped config makes of a run: FSDP2 sharding from the FSDP files, a
one-line refusal for DeepSpeed (the trainers shard with FSDP2 only) before any model loads, nothing for DDP."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from flowgrpo.config import ConfigError
from flowgrpo.distributed import Distributed, sharding_from_launch

from .test_accelerate_configs import ROOT, _launch_env

ACCELERATE = ROOT / "configs" / "accelerate"


@pytest.mark.parametrize("value", ["true", "True", "1"])  # accelerate writes "true" and "True"
def test_deepspeed_is_refused_in_one_line(value):
    with pytest.raises(ConfigError, match="FSDP2 only") as err:
        sharding_from_launch({"ACCELERATE_USE_DEEPSPEED": value})
    assert "configs/accelerate/fsdp2.yaml" in str(err.value)
    assert len(str(err.value).splitlines()) == 1


@pytest.mark.parametrize("env", [{}, {"ACCELERATE_USE_FSDP": "false"}, {"ACCELERATE_USE_DEEPSPEED": "False"}])
def test_plain_environment_does_not_shard(env):
    assert sharding_from_launch(env) is None


def test_fsdp1_config_is_refused():
    with pytest.raises(ConfigError, match="fsdp_version"):
        sharding_from_launch({"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "1"})


@pytest.mark.parametrize(
    "name,engine",
    [
        ("ddp.yaml", None),
        ("fsdp2.yaml", "fsdp2"),
        ("fsdp2_two_nodes.yaml", "fsdp2"),
        ("deepspeed_zero2.yaml", "refused"),
        ("deepspeed_zero3.yaml", "refused"),
    ],
)
def test_the_shipped_accelerate_configs(name, engine):
    """The environment the installed accelerate exports for each shipped file."""
    _, env = _launch_env(ACCELERATE / name)
    if engine == "refused":
        with pytest.raises(ConfigError, match="FSDP2 only"):
            sharding_from_launch(env)
    elif engine is None:
        assert sharding_from_launch(env) is None
    else:
        sharding = sharding_from_launch(env)
        assert sharding is not None
        assert sharding.param_dtype == torch.bfloat16 and sharding.reduce_dtype == torch.float32
        assert sharding.reshard_after_forward and sharding.activation_checkpointing
        assert "FluxTransformerBlock" in sharding.block_classes


def test_one_sharded_process_gets_a_process_group_of_one(monkeypatch):
    """A sharded run resumed on one process (no torchrun variables) still shards: a group of one."""
    import torch.distributed as dist

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", "2")
    try:
        d = Distributed.from_environment()
        assert d.sharded and d.world_size == 1 and d.rank == 0 and dist.is_initialized()
        assert d.passes_to_pad(3) == 0 and d.most(3) == 3
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "false")
    assert not Distributed.from_environment().sharded


@pytest.mark.parametrize(
    "command,config",
    [("train-t2i", "configs/t2i/tiny/flow_grpo.yaml"), ("train-text", "configs/text/tiny_pattern.yaml")],
)
def test_both_trainers_refuse_deepspeed_in_one_line_before_loading(tmp_path, command, config):
    out = tmp_path / "out"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT), "ACCELERATE_USE_DEEPSPEED": "true"}
    code = "import sys\nfrom flowgrpo.cli import main\nsys.exit(main(sys.argv[1:]))\n"
    argv = [sys.executable, "-c", code, command, str(ROOT / config), f"output_dir={out}"]
    done = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 2, (done.returncode, done.stderr[-2000:])
    text = done.stderr.strip()
    assert "Traceback" not in text and len(text.splitlines()) == 1, text
    assert "FSDP2 only" in text and "DeepSpeed" in text
    assert not out.exists()  # stopped before the run loop made its folder, so before any model
