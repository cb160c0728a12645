"""Diffusion-DPO and best-of-N SFT recipes (docs/recipes.md, "Diffusion-DPO and best-of-N SFT on SD3.5-M" and
"Diffusion-DPO on SD1.5, Pick-a-Pic v2 (offline)") against their published runs: every tabled setting pinned from
the loaded config, the batch arithmetic derived from the launches, and why config/dpo.py:pickscore_sd3 is not the
recipe (its accumulation of 0 cannot run).

yifan123/flow_grpo @ ac4c86e (config/dpo.py, config/sft.py, config/base.py, scripts/train_sd3_dpo.py,
scripts/train_sd3_sft.py, flow_grpo/stat_tracking.py, scripts/single_node/{dpo,sft}.sh) and
SalesforceAIResearch/DiffusionDPO @ 5233e75 (train.py, launchers/sd15.sh). Only configs are loaded; no model is built.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from flowgrpo.t2i import load_t2i_config
from test_real_configs import SD35M, assert_pinned  # one pin reader for every real-recipe table

REAL_DIR = Path(__file__).resolve().parents[2] / "configs" / "t2i" / "real"

# config/dpo.py:geneval_sd3 / config/sft.py:geneval_sd3 over config/base.py, as scripts/single_node/{dpo,sft}.sh
# launch them (--num_processes=1); SD3.5-M, LoRA, precision, optimizer: _sd35m.yaml (SD35M)
GENEVAL_SD3 = {
    **SD35M,
    "data.path": "prompts/geneval_train.jsonl",  # dataset/geneval/train_metadata.jsonl (rows wrapped: "geneval")
    "data.eval_path": "prompts/geneval_test.jsonl",
    "sampler.num_steps": 40,  # sample.num_steps = 40
    "sampler.guidance_scale": 4.5,
    "sampler.cfg_mode": "full",  # rollouts with the empty negative prompt
    "sampler.sde_kernel.a": 0.7,  # base.py sample.noise_level = 0.7
    "plan.name": "full_sde",  # pipeline_with_logprob: every step SDE
    "group_size": 24,  # sample.num_image_per_prompt = 24
    "prompts_per_iteration": 1,  # 1 process x train_batch_size 24 x num_batches_per_epoch 1 / 24
    "rewards.0.name": "geneval",  # reward_fn = {"geneval": 1.0}
    "rewards.0.url": "http://127.0.0.1:18085",  # flow_grpo/rewards.py geneval_score url
    "rewards.0.weight": 1.0,
    "train.inner_epochs": 1,  # num_inner_epochs = 1
    "train.mini_batches": 1,  # gradient_accumulation_steps 1 x 39 timesteps: one optimizer step per epoch
    "ema.enabled": True,  # train.ema = True
    "ema.updates_per_step": 1,  # ema.step once per optimizer step
    "eval.every": 40,  # eval_freq = 40
    "eval.num_steps": 40,  # eval_num_steps = 40
    "checkpoint.every": 40,  # save_freq = 40
}

DPO = {
    **GENEVAL_SD3,
    "method": "diffusion_dpo",
    "dpo.beta": 100.0,  # train.beta = 100
    "dpo.pairs": "best_worst",  # stat_tracker type 'dpo': argmax +1, argmin -1
    "dpo.tied_groups": "first_two",  # max_idx == min_idx: min_idx = 0, max_idx = 1
    "dpo.timesteps": 39,  # int(40 x timestep_fraction 0.99)
    "dpo.time_sampling": "logit_normal",  # compute_density_for_timestep_sampling('logit_normal', 0, 1)
    "dpo.logit_mean": 0.0,
    "dpo.logit_std": 1.0,
    "dpo.time_shift": 3.0,  # noise_scheduler.timesteps (SD3.5-M scheduler shift 3)
    "dpo.sample_with": "reference",  # set_adapter("ref") while sampling; ref_update_step = 10000000
    "dpo.data": None,  # online
    "dpo.sft_coef": 0.0,  # -logsigmoid only
}

SFT = {
    **GENEVAL_SD3,
    "method": "sft",
    "sft.mode": "max",  # stat_tracker type 'sft': (rewards == max).float()
    "sft.normalize": "samples",  # torch.mean over the batch
    "sft.sample_with": "reference",  # set_adapter("ref") while sampling
    "sft.timesteps": 39,
    "sft.time_sampling": "logit_normal",
    "sft.time_shift": 3.0,
    "sft.kl_coef": 0.0,
}

# DiffusionDPO launchers/sd15.sh + train.py defaults
DIFFUSION_DPO_SD15 = {
    "method": "diffusion_dpo",
    "model.family": "sd15",  # noise-prediction form (dpo.py)
    "model.pretrained": "runwayml/stable-diffusion-v1-5",  # MODEL_NAME
    "model.finetune": "full",  # AdamW(unet.parameters()), ref_unet frozen
    "model.dtype": "float32",
    "model.speed.autocast": "float16",  # --mixed_precision default fp16
    "model.speed.gradient_checkpointing": False,  # no --gradient_checkpointing in sd15.sh
    "model.speed.tf32": False,  # no --allow_tf32
    "model.component_dtypes.text_encoder": "float16",  # .to(device, dtype=weight_dtype)
    "model.component_dtypes.vae": "float16",
    "sampler.height": 512,  # --resolution default 512 without --sdxl
    "sampler.width": 512,
    "iterations": 2000,  # --max_train_steps=2000
    "dpo.beta": 5000.0,  # --beta_dpo 5000
    "dpo.data": "data/pickapic_v2_pairs/pairs.jsonl",  # DATASET_NAME yuvalkirstain/pickapic_v2 (converted)
    "dpo.encode": "per_iteration",  # vae.encode every step
    "dpo.pairs_per_iteration": 2048,  # 16 x 1 x 128 ("Paper used 2048")
    "dpo.timesteps": 1,
    "dpo.time_sampling": "uniform",  # torch.randint(0, num_train_timesteps)
    "dpo.empty_prompt_fraction": 0.2,  # --proportion_empty_prompts default 0.2
    "dpo.sft_coef": 0.0,
    "train.mini_batches": 1,
    "train.micro_batch_size": 1,  # --train_batch_size=1
    "optim.lr": 2.048e-5,  # --learning_rate=1e-8 --scale_lr: x 128 x 1 x 16
    "optim.schedule": "constant",  # --lr_scheduler="constant_with_warmup"
    "optim.warmup_steps": 500,  # --lr_warmup_steps=500 (optimizer steps)
    "optim.weight_decay": 1e-2,  # --adam_weight_decay default
    "optim.betas": [0.9, 0.999],
    "optim.eps": 1e-8,
    "optim.max_grad_norm": 1.0,  # --max_grad_norm default
    "optim.loss_scale.mode": "dynamic",  # accelerate's fp16 GradScaler
    "ema.enabled": False,  # no EMA in train.py
    "checkpoint.every": 500,  # --checkpointing_steps 500
}

DPO_PINS: dict[str, dict[str, Any]] = {"dpo": DPO, "sft": SFT, "diffusion_dpo_sd15": DIFFUSION_DPO_SD15}


def _cfg(recipe: str):
    return load_t2i_config(REAL_DIR / f"{recipe}.yaml")


@pytest.mark.parametrize("recipe", sorted(DPO_PINS))
def test_recipe_equals_the_published_run(recipe):
    assert_pinned(_cfg(recipe), recipe, DPO_PINS[recipe])


@pytest.mark.parametrize("recipe", sorted(DPO_PINS))
def test_reward_names_and_settings_exist(recipe):
    from reward_models import get_entry

    for spec in _cfg(recipe).rewards:
        unknown = set(spec.settings) - set(get_entry(spec.name).settings)
        assert not unknown, f"{recipe}: scorer '{spec.name}' has no setting(s) {sorted(unknown)}"


@pytest.mark.parametrize("recipe", ["dpo", "sft"])
def test_flow_grpo_batches_follow_from_the_launch(recipe):
    """samples per epoch = processes x sample.train_batch_size x num_batches_per_epoch = prompts x group; one
    optimizer step per epoch (accumulation 1 x 39 timesteps); DPO: one pair per prompt."""
    processes, train_batch_size, num_batches, k = 1, 24, 1, 24  # dpo.sh / sft.sh, config/{dpo,sft}.py:geneval_sd3
    cfg = _cfg(recipe)
    assert cfg.prompts_per_iteration * cfg.group_size == processes * train_batch_size * num_batches
    assert cfg.group_size == k and cfg.train.mini_batches == 1 and cfg.train.inner_epochs == 1
    assert getattr(cfg, recipe).timesteps == int(40 * 0.99)


def test_diffusion_dpo_lr_and_pairs_follow_from_sd15_sh():
    gpus, batch, accumulation = 16, 1, 128  # "Effective BS ... Paper used 2048"; --train_batch_size=1, accumulation 128
    cfg = _cfg("diffusion_dpo_sd15")
    assert cfg.dpo.pairs_per_iteration == gpus * batch * accumulation == 2048
    assert cfg.optim.lr == pytest.approx(1e-8 * accumulation * batch * gpus, rel=1e-12)  # --scale_lr


def test_pickscore_sd3_dpo_accumulation_of_zero_cannot_run():
    """config/dpo.py:pickscore_sd3 sets gradient_accumulation_steps = num_batches_per_epoch // 2 = 1 // 2 = 0, and
    train_sd3_dpo.py hands Accelerator 0 x 39 = 0: the first accumulate() divides by it. Hence geneval_sd3."""
    from accelerate import Accelerator

    acc = Accelerator(gradient_accumulation_steps=(1 // 2) * int(40 * 0.99), cpu=True)
    with pytest.raises(ZeroDivisionError):
        with acc.accumulate():
            pass
