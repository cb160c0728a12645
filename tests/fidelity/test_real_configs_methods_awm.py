"""The AWM and Flow-DPPO recipes (docs/recipes.md, "Advantage Weighted Matching", "Flow-DPPO" and "Flow-Factory's
AWM") against their published runs: every tabled setting pinned from the loaded config, the batch sizes derived
from the published launches, the training-time strata, the EMA policy's decay and Flow-DPPO's SDE-step draws.

scxue/advantage_weighted_matching@be51372 (config/dgx_awm.py, config/base_awm.py, scripts/train_sd3_awm.py,
train_awm_scripts_*/train_single_node.sh), Tencent-Hunyuan/UniRL@1a7b501 (examples/diffusion/sd3_flowdppo.yaml,
unirl/algorithms/flowdppo.py) and X-GenGroup/Flow-Factory@a0b2bc5 (examples/awm/lora/sd3_5/default.yaml,
src/flow_factory). Only configs are loaded; no model is built.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from flowgrpo.t2i import load_t2i_config
from pipelines.plans import build_plan
from test_real_configs import assert_pinned  # one pin reader for every real-recipe table

REAL_DIR = Path(__file__).resolve().parents[2] / "configs" / "t2i" / "real"

ATTN8 = ["attn.add_k_proj", "attn.add_q_proj", "attn.add_v_proj", "attn.to_add_out", "attn.to_k", "attn.to_out.0",
         "attn.to_q", "attn.to_v"]  # fmt: skip

# dgx_awm.py:geneval_sd3_no_cfg_1node over base_awm.py; train_sd3_awm.py as train_single_node.sh launches it
AWM = {
    "method": "awm",
    "seed": 42,  # base_awm.py seed
    "model.family": "sd3",
    "model.pretrained": "stabilityai/stable-diffusion-3.5-medium",
    "model.finetune": "lora",  # use_lora True
    "model.dtype": "float32",  # pipeline.transformer.to(device): no dtype
    "model.speed.autocast": "float16",  # multi_gpu.yaml mixed_precision fp16 (accelerate wraps the forward)
    "model.speed.tf32": True,  # allow_tf32 True
    "model.component_dtypes.text_encoder_3": "float16",  # .to(device, dtype=inference_dtype)
    "model.component_dtypes.vae": "float32",
    "model.options.max_sequence_length": 128,  # compute_text_embeddings(..., max_sequence_length=128)
    "model.lora.rank": 32,  # LoraConfig(r=32, lora_alpha=64, init_lora_weights="gaussian")
    "model.lora.alpha": 64,
    "model.lora.init": "gaussian",
    "model.lora.target_modules": ATTN8,  # lora_type "attn"
    "data.path": "data/geneval/train.jsonl",  # dataset/geneval
    "sampler.num_steps": 14,
    "sampler.guidance_scale": 1.0,
    "sampler.cfg_mode": "none",
    "sampler.height": 512,  # resolution 512
    "sampler.width": 512,
    "plan.name": "ode_only",  # sde_frac 0; the SA-Solver is tabled as a deviation
    "group_size": 24,  # num_image_per_prompt
    "prompts_per_iteration": 72,  # 8 x 6 x 36 / 24
    "rewards.0.name": "geneval",
    "rewards.0.url": "http://127.0.0.1:18085",
    "rewards.0.weight": 1.0,
    "advantage.estimator.name": "grpo",  # PerPromptStatTracker(global_std=True)
    "advantage.estimator.std_scope": "batch",
    "advantage.estimator.unbiased": False,  # np.std
    "advantage.estimator.eps": 1e-4,
    "advantage.transforms": [],
    "awm.timesteps": 6,  # train_timesteps
    "awm.time_sampling": "discrete_wo_init",  # time_type
    "awm.timestep_fraction": 0.9,
    "awm.time_shift": 3.0,
    "awm.weighting": "ghuber",
    "awm.ghuber_power": 0.25,
    "awm.clip_range": 1.0,
    "awm.adv_clip_max": 5.0,  # base_awm.py adv_clip_max 5
    "awm.advantage_max": 1.0,
    "awm.kl_coef": 0.001,  # beta
    "awm.ema_kl_coef": 1.0,  # ema_beta
    "awm.ema_kl_decay": 0.3,  # kl_ema_decay
    "awm.ema_kl_decay_type": "linear",
    "awm.ema_kl_decay_rate": 0.001,  # min(kl_ema_decay, 0.001 * global_step)
    "awm.ema_kl_clock": "optimizer_steps",
    "optim.lr": 3e-4,
    "optim.schedule": "constant",  # cosine over decay_steps 1e10
    "optim.weight_decay": 1e-4,
    "optim.betas": [0.9, 0.999],
    "optim.eps": 1e-8,
    "optim.max_grad_norm": 1.0,
    "optim.loss_scale.mode": "dynamic",  # accelerate's fp16 GradScaler
    "train.inner_epochs": 1,
    "train.mini_batches": 1,  # gradient_accumulation_steps = every micro-batch of the epoch
    "train.micro_batch_size": 3,  # train.batch_size
    "ema.enabled": True,  # train.ema
    "ema.decay": 0.99,  # ema_decay
    "ema.update_every": 1,  # ema_update_step_interval
    "ema.schedule": "flow_grpo",  # EMAModuleWrapper
    "ema.updates_per_step": 1,  # once per epoch, after its one step
    "eval.every": 50,  # eval_freq
    "eval.num_steps": 40,  # eval_num_steps
    "eval.use_ema": True,  # eval() copies the EMA in
    "checkpoint.every": 50,  # save_freq
}
AWM_OCR = {
    **AWM,
    "data.path": "prompts/ocr_train.txt",
    "rewards.0.name": "ocr",
    "rewards.0.weight": 1.0,
    "awm.kl_coef": 0.003,
    "eval.every": 20,
    "checkpoint.every": 20,
}
del AWM_OCR["rewards.0.url"]
AWM_PICKSCORE = {
    **AWM,
    "data.path": "prompts/pickscore_train.txt",
    "prompts_per_iteration": 24,  # 8 x 6 x 12 / 24
    "rewards.0.name": "pickscore",
    "rewards.0.weight": 1 / 26,  # PickScoreScorer returns score / 26
    "rewards.0.dtype": "float32",
    "awm.kl_coef": 1e-4,
    "awm.time_sampling": "discrete",
    "train.micro_batch_size": 2,
}
del AWM_PICKSCORE["rewards.0.url"]

# UniRL examples/diffusion/sd3_flowdppo.yaml
FLOW_DPPO = {
    "method": "grpo",
    "seed": 42,
    "iterations": 10000,  # num_rollouts
    "model.family": "sd3",
    "model.pretrained": "stabilityai/stable-diffusion-3.5-medium",
    "model.finetune": "lora",
    "model.dtype": "bfloat16",  # model_precision bf16
    "model.speed.autocast": "bfloat16",  # autocast_precision bf16
    "model.component_dtypes.text_encoder_3": "bfloat16",
    "model.component_dtypes.vae": "bfloat16",
    "model.options.max_sequence_length": 256,
    "model.lora.rank": 32,
    "model.lora.alpha": 64,
    "model.lora.init": "default",
    "model.lora.target_modules": ATTN8,
    "data.path": "prompts/pickscore_train.txt",
    "sampler.num_steps": 10,
    "sampler.guidance_scale": 1.0,
    "sampler.cfg_mode": "none",
    "sampler.height": 512,
    "sampler.width": 512,
    "sampler.sde_kernel.name": "flow_sde",  # FlowSDEStrategy
    "sampler.sde_kernel.a": 0.7,  # eta
    "sampler.share_noise": False,  # init_same_noise false
    "plan.name": "window",
    "plan.size": 3,  # num_sde_steps
    "plan.range_end": 5,  # timestep_fraction [0.0, 0.5] of 10
    "group_size": 16,  # samples_per_prompt
    "prompts_per_iteration": 48,  # batch_size
    "rewards.0.name": "pickscore",
    "rewards.0.weight": 1 / 26,  # PickScoreRewardScorer: scores.diag() / 26
    "advantage.estimator.name": "grpo",
    "advantage.estimator.std_scope": "batch",  # adv_use_global_std
    "advantage.estimator.unbiased": True,  # rewards.std() (Bessel)
    "advantage.estimator.eps": 1e-8,
    "advantage.transforms": [],
    "loss.surrogate.name": "flow_dppo",
    "loss.surrogate.kl_threshold": 1e-5,  # kl_mask_threshold
    "loss.surrogate.add_kl_coefficient": True,
    "loss.aggregation.name": "token_mean",  # loss_per_elem.mean()
    "loss.kl.coef": 0.0,
    "optim.lr": 3e-4,
    "optim.weight_decay": 0.0,
    "optim.betas": [0.9, 0.999],
    "optim.eps": 1e-8,
    "optim.max_grad_norm": 1.0,
    "optim.schedule": "constant",
    "optim.warmup_steps": 0,
    "optim.loss_scale.mode": "none",
    "train.mini_batches": 2,  # num_updates_per_batch
    "train.micro_batch_size": 8,
    "ema.enabled": False,
}

# Flow-Factory examples/awm/lora/sd3_5/default.yaml
FF_SD35M_AWM = {
    "method": "awm",
    "seed": 42,
    "model.family": "sd3",
    "model.pretrained": "stabilityai/stable-diffusion-3.5-medium",
    "model.finetune": "lora",
    "model.dtype": "bfloat16",
    "model.speed.autocast": "bfloat16",
    "model.options.max_sequence_length": 512,
    "model.lora.rank": 32,
    "model.lora.alpha": 64,
    "model.lora.init": "gaussian",
    "model.lora.target_modules": [
        "attn.add_q_proj",
        "attn.add_k_proj",
        "attn.add_v_proj",
        "attn.to_add_out",
        "attn.to_q",
        "attn.to_k",
        "attn.to_v",
        "attn.to_out.0",
    ],
    "data.path": "prompts/pickscore_train.txt",
    "sampler.num_steps": 14,
    "sampler.guidance_scale": 1.0,
    "sampler.cfg_mode": "none",
    "sampler.height": 512,
    "plan.name": "ode_only",  # dynamics_type ODE
    "plan.solver": "euler",
    "group_size": 16,
    "prompts_per_iteration": 48,  # unique_sample_num_per_epoch
    "rewards.0.name": "pickscore",
    "rewards.0.weight": 1.0,
    "rewards.0.dtype": "bfloat16",
    "advantage.estimator.std_scope": "batch",  # global_std
    "advantage.estimator.unbiased": False,  # np.std
    "advantage.estimator.eps": 1e-6,  # max(std, 1e-6)
    "advantage.transforms": [],
    "awm.timesteps": 6,
    "awm.time_sampling": "discrete_wo_init",
    "awm.timestep_fraction": 0.9,
    "awm.weighting": "ghuber",
    "awm.ghuber_power": 0.25,
    "awm.clip_range": 1.0,
    "awm.adv_clip_max": 1.0,  # adv_clip_range 1.0
    "awm.advantage_max": 1.0,
    "awm.kl_coef": 1e-4,  # kl_beta
    "awm.ema_kl_coef": 1.0,  # ema_kl_beta
    "awm.ema_kl_decay": 0.3,  # ema_decay
    "awm.ema_kl_decay_type": "linear",
    "awm.ema_kl_decay_rate": 0.3 / 1000,  # warmup_steps 1000
    "awm.ema_kl_clock": "iterations",  # ema_step(step=self.epoch)
    "optim.lr": 3e-4,
    "optim.weight_decay": 1e-4,
    "optim.max_grad_norm": 1.0,
    "optim.loss_scale.mode": "none",  # bf16
    "train.mini_batches": 1,  # gradient_step_per_epoch 1
    "train.micro_batch_size": 8,  # per_device_batch_size
    "ema.enabled": False,
    "eval.every": 20,
    "eval.num_steps": 40,
    "checkpoint.every": 20,
}

METHODS_AWM_PINS: dict[str, dict[str, Any]] = {
    "awm": AWM,
    "awm_ocr": AWM_OCR,
    "awm_pickscore": AWM_PICKSCORE,
    "flow_dppo": FLOW_DPPO,
    "ff_sd35m_awm": FF_SD35M_AWM,
}


def _cfg(recipe: str):
    return load_t2i_config(REAL_DIR / f"{recipe}.yaml")


@pytest.mark.parametrize("recipe", sorted(METHODS_AWM_PINS))
def test_recipe_equals_the_published_run(recipe):
    assert_pinned(_cfg(recipe), recipe, METHODS_AWM_PINS[recipe])


@pytest.mark.parametrize("recipe", sorted(METHODS_AWM_PINS))
def test_reward_names_and_settings_exist(recipe):
    from reward_models import get_entry

    for spec in _cfg(recipe).rewards:
        unknown = set(spec.settings) - set(get_entry(spec.name).settings)
        assert not unknown, f"{recipe}: scorer '{spec.name}' has no setting(s) {sorted(unknown)}"


@pytest.mark.parametrize(
    "recipe, gpus, per_gpu, batches, train_batch",
    [  # dgx_awm.py: sample.train_batch_size 6, num_batches_per_epoch 24 * 24 // 8 // 2 (8 * 24 // 8 // 2 PickScore)
        ("awm", 8, 6, 24 * 24 // 8 // 2, 3),
        ("awm_ocr", 8, 6, 24 * 24 // 8 // 2, 3),
        ("awm_pickscore", 8, 6, 8 * 24 // 8 // 2, 2),
        ("flow_dppo", 8, 96, 1, 8),  # 48 x 16 / 8 GPUs per rollout
        ("ff_sd35m_awm", 8, 8, 48 * 16 // (8 * 8), 8),  # per_device_batch_size 8
    ],
)
def test_batch_sizes_follow_from_the_launch(recipe, gpus, per_gpu, batches, train_batch):
    cfg = _cfg(recipe)
    assert gpus * per_gpu * batches == cfg.prompts_per_iteration * cfg.group_size
    assert cfg.train.micro_batch_size == train_batch
    per_rank = per_gpu * batches
    if recipe.startswith("awm"):
        # gradient_accumulation_steps = train_batch_size // train.batch_size * num_batches_per_epoch: one step
        accumulation = per_gpu // train_batch * batches
        assert per_rank // train_batch == accumulation and cfg.train.mini_batches == 1
    elif recipe == "flow_dppo":  # num_updates_per_batch 2 disjoint mini-batches, each a whole number of micros
        assert cfg.train.mini_batches == 2 and per_rank // 2 % train_batch == 0
    else:
        assert cfg.train.mini_batches == 1  # gradient_step_per_epoch 1


def _published_strata(time_type: str, num_steps: int, fraction: float, k: int) -> list[set[int]]:
    """train_sd3_awm.py's discrete / discrete_wo_init draw: per stratum the grid indices it can return."""
    first = 0 if time_type == "discrete" else 1
    bounds = torch.linspace(first, int(num_steps * fraction), k + 1)
    low, high = bounds[:-1].long().tolist(), bounds[1:].long().tolist()
    return [set(range(lo, max(hi, lo + 1))) for lo, hi in zip(low, high)]


@pytest.mark.parametrize("recipe", ["awm", "awm_pickscore", "ff_sd35m_awm"])
def test_training_times_fall_in_the_published_strata(recipe):
    from diffusers import FlowMatchEulerDiscreteScheduler

    from flowgrpo.t2i.awm import draw_times

    cfg = _cfg(recipe)
    s = cfg.awm
    sched = FlowMatchEulerDiscreteScheduler(shift=3.0)  # SD3.5-M's scheduler config
    sched.set_timesteps(cfg.sampler.num_steps)
    sigmas = sched.sigmas.float()
    if recipe.startswith("ff_"):
        # Flow-Factory's timestep_range 0.9 keeps grid times >= 1000 (1 - 0.9); its last index is AWM's bound
        assert int(torch.where(sched.timesteps >= 100 - 1e-3)[0].max()) == int(cfg.sampler.num_steps * 0.9) == 12
    strata = _published_strata(s.time_sampling, cfg.sampler.num_steps, s.timestep_fraction, s.timesteps)
    g = torch.Generator().manual_seed(0)
    seen: list[set[int]] = [set() for _ in strata]
    for _ in range(200):
        drawn = draw_times(g, s, sigmas)
        idx = [int((sigmas[:-1] - t).abs().argmin()) for t in drawn]
        for j, i in enumerate(idx):
            seen[j].add(i)
    assert seen == strata  # every published index drawn, nothing else


def test_ema_policy_decay_over_the_runs():
    from flowgrpo.t2i.awm import ema_kl_decay

    awm, ff = _cfg("awm").awm, _cfg("ff_sd35m_awm").awm
    # the authors: after the k-th optimizer step (one per iteration) min(0.3, 0.001 k)
    assert [ema_kl_decay(awm, k, k - 1) for k in (1, 100, 300, 1000)] == pytest.approx([0.001, 0.1, 0.3, 0.3])
    # Flow-Factory: the epoch index e before it is counted, 0.3 * min(e / 1000, 1): the first update copies
    assert [ema_kl_decay(ff, e + 1, e) for e in (0, 1, 500, 1000, 3000)] == pytest.approx([0.0, 3e-4, 0.15, 0.3, 0.3])


def test_flow_dppo_draws_three_sde_steps_in_the_first_half():
    cfg = _cfg("flow_dppo")
    drawn = [build_plan(cfg.plan.name, cfg.sampler.num_steps, it, 0, **cfg.plan.settings) for it in range(60)]
    for p in drawn:
        sde = [i for i, st in enumerate(p.steps) if st.sde]
        assert sde == p.trained_steps and len(sde) == 3 and max(sde) < 5  # ODE elsewhere, only those trained
    assert {tuple(p.trained_steps) for p in drawn} == {(0, 1, 2), (1, 2, 3), (2, 3, 4)}
