"""What an `accelerate launch` with each shipped config makes of a run: FSDP2 sharding from the FSDP files, a
ZeRO stage from the DeepSpeed files, a one-line refusal for what the trainers cannot run (zero3_init_flag,
offloading, DeepSpeed's bf16, its gradient accumulation) before any model loads, nothing for DDP."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from flowgrpo.config import ConfigError
from flowgrpo.distributed import Distributed, sharding_from_launch, zero_from_launch

from .test_accelerate_configs import ROOT, _launch_env

ACCELERATE = ROOT / "configs" / "accelerate"
ZERO2 = {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "2",
         "ACCELERATE_GRADIENT_ACCUMULATION_STEPS": "1", "ACCELERATE_MIXED_PRECISION": "no"}  # fmt: skip


@pytest.mark.parametrize("value", ["true", "True", "1"])  # accelerate writes "true" and "True"
def test_a_deepspeed_launch_runs_zero_not_fsdp(value):
    zero = zero_from_launch({**ZERO2, "ACCELERATE_USE_DEEPSPEED": value})
    assert zero is not None and zero.stage == 2
    assert sharding_from_launch({**ZERO2, "ACCELERATE_USE_DEEPSPEED": value}) is None


@pytest.mark.parametrize(
    "change,words",
    [
        ({"ACCELERATE_DEEPSPEED_ZERO_STAGE": "3", "ACCELERATE_DEEPSPEED_ZERO3_INIT": "true"}, ["zero3_init_flag"]),
        ({"ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE": "cpu"}, ["offload_optimizer", "none"]),
        ({"ACCELERATE_GRADIENT_ACCUMULATION_STEPS": "4"}, ["gradient_accumulation_steps 4", "set it to 1"]),
        ({"ACCELERATE_MIXED_PRECISION": "bf16"}, ["mixed_precision 'bf16'", "model.dtype"]),
    ],
    ids=["zero3_init", "offload", "accumulation", "bf16"],
)
def test_what_zero_cannot_run_is_refused_in_one_line(change, words):
    with pytest.raises(ConfigError) as err:
        zero_from_launch({**ZERO2, **change})
    text = str(err.value)
    assert len(text.splitlines()) == 1 and all(w in text for w in words), text


def test_zero3_keeps_trained_and_lora_tensors_whole():
    from flowgrpo.scaling.zero import ZeroError, _whole_on_every_rank

    zero = zero_from_launch(
        {**ZERO2, "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3", "ACCELERATE_DEEPSPEED_ZERO3_INIT": "false"}
    )
    assert zero is not None and zero.stage == 3
    base, lora_a, old_b = torch.nn.Linear(16, 16), torch.nn.Linear(16, 4, bias=False), torch.nn.Linear(4, 16)
    model = torch.nn.ModuleDict({"base": base, "lora_A": lora_a, "old_lora_B": old_b}).requires_grad_(False)
    lora_a.requires_grad_(True)
    threshold = _whole_on_every_rank(model, 3)
    assert threshold == 16 * 4 + 1  # above the trained lora_A and the frozen old-policy LoRA tensors
    config = zero.deepspeed_config(1.0, threshold)["zero_optimization"]
    assert config["stage3_param_persistence_threshold"] == threshold and base.weight.numel() >= threshold
    assert config["memory_efficient_linear"] is False  # DeepSpeed's own linear would change every linear's rounding
    with pytest.raises(ZeroError, match="full fine-tune"):
        _whole_on_every_rank(model.requires_grad_(True), 3)  # nothing frozen left to partition
    assert _whole_on_every_rank(model, 2) == 0


def test_a_deepspeed_json_of_the_user_is_read_with_accelerate_s_auto_values_left_to_deepspeed(tmp_path):
    import json

    file = tmp_path / "ds.json"
    file.write_text(json.dumps({
        "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "bf16": {"enabled": "auto"},
        "zero_optimization": {"stage": 2, "reduce_bucket_size": "auto", "allgather_bucket_size": 5e8},
        "optimizer": {"type": "AdamW"}, "wall_clock_breakdown": True,
    }))  # fmt: skip
    zero = zero_from_launch({**ZERO2, "ACCELERATE_DEEPSPEED_CONFIG_FILE": str(file)})
    assert zero is not None and zero.stage == 2 and zero.config_file == str(file)
    config = zero.deepspeed_config(1.0)
    assert config["zero_optimization"] == {"stage": 2, "allgather_bucket_size": 5e8}
    assert config["train_micro_batch_size_per_gpu"] == 1 and config["gradient_accumulation_steps"] == 1
    assert "bf16" not in config and "optimizer" not in config  # torch's AdamW, the recipe's precision
    assert config["gradient_clipping"] == 1.0 and config["managed_gradient_accumulation"] is False


def test_a_clipping_other_than_the_recipe_s_is_refused():
    from flowgrpo.scaling.zero import ZeroError

    zero = zero_from_launch({**ZERO2, "ACCELERATE_GRADIENT_CLIPPING": "0.5"})
    assert zero is not None and zero.clipping == 0.5
    assert zero.deepspeed_config(0.5)["gradient_clipping"] == 0.5
    with pytest.raises(ZeroError, match="optim.max_grad_norm is 1.0"):
        zero.deepspeed_config(1.0)
    unset = zero_from_launch(ZERO2)
    assert unset is not None and unset.deepspeed_config(None)["gradient_clipping"] == 0.0  # None: no clipping
    assert unset.deepspeed_config(1.0)["managed_gradient_accumulation"] is False


@pytest.mark.parametrize("env", [{}, {"ACCELERATE_USE_FSDP": "false"}, {"ACCELERATE_USE_DEEPSPEED": "False"}])
def test_plain_environment_does_not_shard(env):
    assert sharding_from_launch(env) is None and zero_from_launch(env) is None


def test_fsdp1_config_is_refused():
    with pytest.raises(ConfigError, match="fsdp_version"):
        sharding_from_launch({"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "1"})


@pytest.mark.parametrize(
    "name,engine",
    [
        ("ddp.yaml", None),
        ("fsdp2.yaml", "fsdp2"),
        ("fsdp2_two_nodes.yaml", "fsdp2"),
        ("deepspeed_zero2.yaml", "zero2"),
        ("deepspeed_zero3.yaml", "zero3"),
    ],
)
def test_the_shipped_accelerate_configs(name, engine):
    """The environment the installed accelerate exports for each shipped file."""
    _, env = _launch_env(ACCELERATE / name)
    if engine in ("zero2", "zero3"):
        zero = zero_from_launch(env)
        assert zero is not None and zero.stage == int(engine[-1]) and zero.clipping is None
        assert sharding_from_launch(env) is None
    elif engine is None:
        assert sharding_from_launch(env) is None and zero_from_launch(env) is None
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
def test_both_trainers_refuse_zero3_init_in_one_line_before_loading(tmp_path, command, config):
    out = tmp_path / "out"
    zero3_init = {"ACCELERATE_DEEPSPEED_ZERO_STAGE": "3", "ACCELERATE_DEEPSPEED_ZERO3_INIT": "true"}
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT), **ZERO2, **zero3_init}
    code = "import sys\nfrom flowgrpo.cli import main\nsys.exit(main(sys.argv[1:]))\n"
    argv = [sys.executable, "-c", code, command, str(ROOT / config), f"output_dir={out}"]
    done = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 2, (done.returncode, done.stderr[-2000:])
    text = done.stderr.strip()
    assert "Traceback" not in text and len(text.splitlines()) == 1, text
    assert "zero3_init_flag" in text and "DeepSpeed" in text
    assert not out.exists()  # stopped before the run loop made its folder, so before any model
