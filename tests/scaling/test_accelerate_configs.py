"""The shipped accelerate configs go through the installed accelerate's own code path of
`accelerate launch --config_file ...` (config class, launch arguments, the environment it exports to
every rank, the plugin each rank builds from it) and ask for what their comments say."""

from __future__ import annotations

import os
from pathlib import Path
from unittest import mock

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted((ROOT / "configs" / "accelerate").glob("*.yaml"))
NAMES = [p.name for p in CONFIGS]
FSDP2_BLOCKS = [
    "JointTransformerBlock",
    "FluxTransformerBlock",
    "FluxSingleTransformerBlock",
    "QwenImageTransformerBlock",
    "Qwen2DecoderLayer",
    "LlamaDecoderLayer",
    "WanTransformerBlock",
    "HunyuanVideoTransformerBlock",
    "HunyuanVideoSingleTransformerBlock",
    "HunyuanVideo15TransformerBlock",
    "Flux2TransformerBlock",
    "Flux2SingleTransformerBlock",
    "ZImageTransformerBlock",
]


def _launch_env(path: Path) -> tuple[object, dict[str, str]]:
    """What `accelerate launch --config_file path train.py` would export to each rank."""
    from accelerate.commands.config.config_args import load_config_from_file
    from accelerate.commands.launch import (
        _validate_launch_command,
        launch_command_parser,
    )
    from accelerate.utils.launch import prepare_deepspeed_cmd_env, prepare_multi_gpu_env

    parser = launch_command_parser()
    known = set(vars(parser.parse_args(["train.py"])))
    cfg = load_config_from_file(str(path))  # raises on an unknown top-level key
    # accelerate copies nested keys onto its launch arguments without checking them: we do.
    nested = [k if k.startswith("fsdp") else f"fsdp_{k}" for k in cfg.fsdp_config] + list(cfg.deepspeed_config)
    unknown = [k for k in nested if k not in known]
    assert not unknown, f"{path.name}: keys the installed accelerate does not know: {unknown}"
    args, defaults, mp_from_config = _validate_launch_command(
        parser.parse_args(["--config_file", str(path), "train.py"])
    )
    if args.use_deepspeed:  # as accelerate's launch_command does before the DeepSpeed launcher
        fields = list(defaults.deepspeed_config) + (["mixed_precision"] if mp_from_config else [])
        args.deepspeed_fields_from_accelerate_config = ",".join(fields)
        _, env = prepare_deepspeed_cmd_env(args)
    else:
        env = prepare_multi_gpu_env(args)
    return args, env


def test_the_issue_s_configs_are_shipped():
    assert {"ddp.yaml", "fsdp2.yaml", "deepspeed_zero2.yaml", "deepspeed_zero3.yaml"} <= set(NAMES)
    assert any("two_nodes" in n for n in NAMES)


@pytest.mark.parametrize("path", CONFIGS, ids=NAMES)
def test_config_is_valid_for_the_installed_accelerate(path):
    args, _ = _launch_env(path)
    assert args.num_processes >= 8 and args.num_processes % args.num_machines == 0


@pytest.mark.parametrize("name", ["fsdp2.yaml", "fsdp2_two_nodes.yaml"])
def test_fsdp2_config_gives_full_shard_bf16_block_wrap_and_checkpointing(name):
    from accelerate.utils import FullyShardedDataParallelPlugin

    from flowgrpo.scaling.sharding import ShardingConfig

    _, env = _launch_env(ROOT / "configs" / "accelerate" / name)
    with mock.patch.dict(os.environ, env, clear=True):
        plugin = FullyShardedDataParallelPlugin()
    assert plugin.fsdp_version == 2
    assert plugin.reshard_after_forward is True  # full shard
    assert plugin.activation_checkpointing is True
    assert plugin.transformer_cls_names_to_wrap == FSDP2_BLOCKS
    assert env["ACCELERATE_MIXED_PRECISION"] == "bf16"
    sharding = ShardingConfig.from_accelerate_env(env)  # what flowgrpo's fully_shard calls will use
    assert sharding.block_classes == tuple(FSDP2_BLOCKS)
    assert (sharding.param_dtype, sharding.reduce_dtype) == (torch.bfloat16, torch.float32)
    assert sharding.reshard_after_forward and sharding.activation_checkpointing


def test_block_class_names_are_the_models_own():
    """The names in fsdp2.yaml are block classes diffusers / transformers declare as unsplittable, and every
    family's denoiser (and the text models) has its repeated blocks among them."""
    import diffusers
    from transformers import LlamaForCausalLM, Qwen2ForCausalLM

    import flowgrpo  # noqa: F401  (torchvision hook)

    models = [getattr(diffusers, name) for name in (
        "SD3Transformer2DModel", "FluxTransformer2DModel", "QwenImageTransformer2DModel", "WanTransformer3DModel",
        "HunyuanVideoTransformer3DModel", "HunyuanVideo15Transformer3DModel", "Flux2Transformer2DModel",
        "ZImageTransformer2DModel",
    )] + [Qwen2ForCausalLM, LlamaForCausalLM]  # fmt: skip
    declared = {n for c in models for n in c._no_split_modules}
    assert set(FSDP2_BLOCKS) <= declared, set(FSDP2_BLOCKS) - declared
    for c in models:  # the embedders / refiners they also declare run once: not worth a shard unit each
        assert any(n.endswith(("Block", "Layer")) and n in FSDP2_BLOCKS for n in c._no_split_modules), c.__name__


def test_two_node_config_points_every_machine_at_machine_0():
    args, _ = _launch_env(ROOT / "configs" / "accelerate" / "fsdp2_two_nodes.yaml")
    assert (args.num_machines, args.nproc_per_node, args.nnodes) == (2, "8", "2")
    # torchrun's rendezvous on machine 0 (accelerate picks rdzv_endpoint or master_addr/port)
    where = getattr(args, "rdzv_endpoint", None) or f"{args.master_addr}:{args.master_port}"
    assert where == "10.0.0.1:29500"


@pytest.mark.parametrize("name,stage", [("deepspeed_zero2.yaml", "2"), ("deepspeed_zero3.yaml", "3")])
def test_deepspeed_configs_ask_for_their_zero_stage(name, stage):
    _, env = _launch_env(ROOT / "configs" / "accelerate" / name)
    assert env["ACCELERATE_USE_DEEPSPEED"] == "true"
    assert env["ACCELERATE_DEEPSPEED_ZERO_STAGE"] == stage
    assert env["ACCELERATE_GRADIENT_ACCUMULATION_STEPS"] == "1"


def test_the_zero2_file_leaves_precision_and_clipping_to_the_recipe():
    _, env = _launch_env(ROOT / "configs" / "accelerate" / "deepspeed_zero2.yaml")
    assert env["ACCELERATE_MIXED_PRECISION"] == "no"  # DeepSpeed's bf16 mode would cast the fp32 LoRA weights
    assert "ACCELERATE_GRADIENT_CLIPPING" not in env  # the recipe's optim.max_grad_norm is handed to DeepSpeed


def test_a_non_fsdp2_environment_is_refused():
    from flowgrpo.scaling.sharding import ShardingConfig, ShardingError

    with pytest.raises(ShardingError, match="fsdp_version"):
        ShardingConfig.from_accelerate_env({"FSDP_VERSION": "1", "ACCELERATE_USE_FSDP": "true"})
