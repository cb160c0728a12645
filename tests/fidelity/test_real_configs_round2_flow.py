"""Round 2 of the real-recipe audit (issue 29), Flow-GRPO lineage: launch files, precision, judges.

The published batch sizes come from a launch (world size) times a config (per-device batch, batches per
epoch, accumulation); precision comes from how the launch wraps the model. Both are written here as the
published facts (docs/recipes.md cites each: repository, commit, file, flag) and the recipe's values are
derived from them, so a config that drifts from its launch fails with the arithmetic that broke.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from flowgrpo.t2i import load_t2i_config

REAL_DIR = Path(__file__).resolve().parents[2] / "configs" / "t2i" / "real"


@dataclass(frozen=True)
class Launch:
    world: int  # processes of the launch
    images_per_batch: int  # images of one rollout batch on one process (a pipeline call)
    batches: int  # rollout batches per process per epoch (num_batches_per_epoch)
    group: int  # images per prompt in one advantage group
    accumulation: int  # batches per optimizer step (config.train.gradient_accumulation_steps)
    ema_calls_per_step: int  # ema.step calls per optimizer step (after every batch, or once)
    wrap: str  # "amp": fp32 weights, forward under autocast; "deepspeed": the engine casts the whole model
    mixed_precision: str  # "fp16" | "bf16"


def _nft_batches(n_gpus: int = 8, groups: int = 48, per_prompt: int = 24, steps: int = 1) -> tuple[int, int]:
    """NVlabs/DiffusionNFT config/nft.py:_get_config's search: the largest bsz <= 9 that tiles the epoch."""
    for bsz in range(9, 0, -1):
        if groups * per_prompt % (n_gpus * bsz) == 0 and bsz * n_gpus % per_prompt == 0:
            batches = groups * per_prompt // (n_gpus * bsz)
            if batches % steps == 0:
                return bsz, batches
    raise AssertionError("no batch size")


FLOW_GRPO = Launch(32, 9, int(48 / (32 * 9 / 24)), 24, int(48 / (32 * 9 / 24)) // 2, 2, "amp", "fp16")
_NFT_BSZ, _NFT_BATCHES = _nft_batches()
LAUNCHES = {
    # scripts/multi_node/main.sh (--num_processes 32, multi_node.yaml mixed_precision fp16); grpo.py:pickscore_sd3
    "flow_grpo": FLOW_GRPO,
    # pickscore_sd3_fast: 1 prompt x mini_num_image_per_prompt 9 per call, k = 24 // 9 = 2 calls per prompt
    "flow_grpo_fast": Launch(32, 9, int(48 / (32 * 9 / 24)), (24 // 9) * 9, 2, 2, "amp", "fp16"),
    "grpo_guard": FLOW_GRPO,  # no code: Flow-GRPO's PickScore run (GUESS for the launch)
    "vgpo": FLOW_GRPO,  # no code: Flow-GRPO's PickScore run (GUESS for the launch)
    # GARDO's scripts/single_node/grpo_gardo_sd3.sh: not audited for world size (GUESS: Flow-GRPO's launch; its
    # config's 48 prompts x 24 and 2 optimizer steps per epoch are what the recipe pins)
    "gardo": FLOW_GRPO,
    # config/dgx.py:pickscore_sd3_pr ("8*A800"): 1 spine per batch, 4 batches, 4 spines per prompt
    "tempflow_grpo": Launch(8, 1, 4, 4, 2, 2, "amp", "fp16"),
    # scripts/multi_node/common_op3.sh (NUM_PROCESSES 32, deepspeed_zero2.yaml); my_grpo.py:pickscore_sd3_fast_op3
    "tp_grpo": Launch(32, 9, int(48 / (32 * 9 / 24)), 24, 2, 2, "deepspeed", "fp16"),
    # README: torchrun --nproc_per_node=8; nft.py:sd3_pickscore (gradient_step_per_epoch 1); torch autocast fp16
    "diffusion_nft": Launch(8, _NFT_BSZ, _NFT_BATCHES, 24, _NFT_BATCHES, 1, "amp", "fp16"),
    # scripts/grpo_dino.sh (--num_processes 8, deepspeed_zero2.yaml); grpo.py:dino_cotrain_sd3_patch_fast (bf16)
    "adv_grpo": Launch(8, 8, int(48 / (8 * 8 / 16)), 16, int(48 / (8 * 8 / 16)) // 2, 6, "deepspeed", "bf16"),
    # flow_grpo scripts/single_node/dpo.sh / sft.sh (--num_processes=1, multi_gpu.yaml fp16); config/dpo.py and
    # config/sft.py:geneval_sd3
    "dpo": Launch(1, 24, 1, 24, 1, 1, "amp", "fp16"),
    "sft": Launch(1, 24, 1, 24, 1, 1, "amp", "fp16"),
}
DTYPE = {"fp16": "float16", "bf16": "bfloat16"}


def _cfg(recipe: str):
    return load_t2i_config(REAL_DIR / f"{recipe}.yaml")


def test_every_sd35m_recipe_has_a_launch():
    sd3 = {p.stem for p in REAL_DIR.glob("*.yaml") if not p.name.startswith("_") and _cfg(p.stem).model.family == "sd3"}
    # the Flow-GRPO lineage's launches; AWM's, Flow-DPPO's and Flow-Factory's (ff_*) are pinned with their own
    # batch arithmetic in test_real_configs_methods_awm.py / _nft.py
    own_launch_tests = {"awm", "awm_ocr", "awm_pickscore", "flow_dppo"}
    assert {n for n in sd3 - own_launch_tests if not n.startswith("ff_")} == set(LAUNCHES)


def test_the_launch_arithmetic_of_each_published_run():
    assert (_NFT_BSZ, _NFT_BATCHES) == (9, 16)  # 8 GPUs x 9 x 16 = 1152 = 48 x 24
    assert LAUNCHES["adv_grpo"].batches == 12 and LAUNCHES["flow_grpo"].batches == 4


@pytest.mark.parametrize("recipe", sorted(LAUNCHES))
def test_batch_sizes_follow_from_the_launch(recipe):
    launch, cfg = LAUNCHES[recipe], _cfg(recipe)
    images = launch.world * launch.images_per_batch * launch.batches
    assert images % launch.group == 0 and launch.batches % launch.accumulation == 0
    assert cfg.group_size == launch.group
    assert cfg.prompts_per_iteration == images // launch.group
    assert cfg.train.mini_batches == launch.batches // launch.accumulation  # optimizer steps per epoch
    assert cfg.train.inner_epochs == 1
    assert cfg.ema.updates_per_step == launch.ema_calls_per_step


@pytest.mark.parametrize("recipe", sorted(LAUNCHES))
def test_precision_follows_from_the_launch(recipe):
    """accelerate MULTI_GPU fp16 (native AMP) and torch.autocast keep the frozen fp32 weights and autocast every
    forward (the rollout's too: the pipeline calls the same patched module); a DeepSpeed fp16 / bf16 engine casts
    the whole model and runs it without autocast."""
    launch, model = LAUNCHES[recipe], _cfg(recipe).model
    if launch.wrap == "amp":
        assert (model.dtype, model.speed.autocast) == ("float32", DTYPE[launch.mixed_precision])
    else:
        assert (model.dtype, model.speed.autocast) == (DTYPE[launch.mixed_precision], None)
    assert not model.speed.tf32 and not model.speed.cudnn_attention  # left at their defaults (docs/recipes.md)


@pytest.mark.parametrize("recipe", sorted(LAUNCHES))
def test_frozen_parts_and_loss_scale_follow_from_the_launch(recipe):
    """Every script casts the text encoders to `inference_dtype` (the mixed-precision dtype) and the VAE to fp32,
    whatever wraps the transformer; an fp16 launch scales the loss (native AMP / DiffusionNFT: torch's GradScaler,
    growth every 2000 finite steps; DeepSpeed's fp16 engine: its dynamic scale, loss_scale_window 1000), a bf16 one
    does not."""
    launch, cfg = LAUNCHES[recipe], _cfg(recipe)
    mixed = DTYPE[launch.mixed_precision]
    encoders = {"text_encoder": mixed, "text_encoder_2": mixed, "text_encoder_3": mixed}
    assert cfg.model.component_dtypes == {**encoders, "vae": "float32"}
    scale = cfg.optim.loss_scale
    assert scale.enabled == (launch.mixed_precision == "fp16")
    if scale.enabled:
        assert (scale.init_scale, scale.min_scale) == (2.0**16, 1.0)  # GradScaler's init; DeepSpeed's 2^16, min 1
        assert scale.growth_interval == (2000 if launch.wrap == "amp" else 1000)


@pytest.mark.parametrize("recipe", sorted(LAUNCHES))
def test_prompt_encoding_seed_and_judges(recipe):
    cfg = _cfg(recipe)
    assert cfg.model.options == {"max_sequence_length": 128}  # every script: compute_text_embeddings(..., 128)
    assert cfg.seed == 42  # config/base.py of every codebase here
    if recipe == "gardo":  # the OCR task: ocr 0.8, aesthetic 0.1, imagereward 0.1 (config/gardo.py reward_fn)
        assert [(r.name, r.weight) for r in cfg.rewards] == [("ocr", 0.8), ("aesthetic", 0.1), ("imagereward", 0.1)]
        return
    if recipe in ("dpo", "sft"):  # config/dpo.py, config/sft.py:geneval_sd3 (reward_fn geneval 1.0)
        assert [(r.name, r.weight) for r in cfg.rewards] == [("geneval", 1.0)]
        return
    pick = [r for r in cfg.rewards if r.name == "pickscore"]
    assert len(pick) == 1 and pick[0].settings == {"dtype": "float32", "preprocess": "pil"}
    assert pick[0].weight == pytest.approx(0.0 if recipe == "adv_grpo" else 1 / 26)
    if recipe == "adv_grpo":
        dino = cfg.rewards[0]
        assert dino.name == "dino_discriminator" and dino.settings["dtype"] == "bfloat16"
        assert dino.settings["head_dtype"] == "bfloat16"  # head.to(torch.bfloat16) before its Adam


def test_the_recipe_settings_reach_the_adapter():
    """model.options go to the adapter's constructor (build_policy: build_adapter(..., **options)), whose own T5
    length would be the SD3 pipeline's 256; model.speed.autocast becomes the adapter's forward autocast dtype."""
    import torch

    from pipelines.adapters.sd3 import SD3Adapter
    from pipelines.speed import AUTOCAST_DTYPES

    assert "max_sequence_length" in SD3Adapter.options and SD3Adapter.default_max_sequence_length == 256
    assert AUTOCAST_DTYPES[_cfg("flow_grpo").model.speed.autocast] is torch.float16
