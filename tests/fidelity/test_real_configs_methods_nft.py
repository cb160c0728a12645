"""The Flow-Factory DiffusionNFT recipes (docs/recipes.md, "Flow-Factory NFT recipes") against their published runs:
every tabled setting pinned from the loaded config, the batch arithmetic of the launch, and the discrete training
times on SD3.5's own grid.

X-GenGroup/Flow-Factory@a0b2bc5: examples/nft/lora/{sd3_5,flux2_klein_base,z_image}/default.yaml, src/flow_factory
(trainers/nft.py, utils/noise_schedule.py TimeSampler.discrete, ema/ema_utils.py piecewise_linear_decay,
advantage/advantage_processor.py, models/{stable_diffusion/sd3_5,flux/flux2_klein,z_image/z_image}.py). Only configs are loaded.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from flowgrpo.t2i import load_t2i_config
from flowgrpo.t2i.nft import discrete_times, old_decay
from test_real_configs import assert_pinned  # one pin reader for every real-recipe table

REAL_DIR = Path(__file__).resolve().parents[2] / "configs" / "t2i" / "real"

# shared by both examples (train: / model: / optimizer blocks)
NFT_EXAMPLES: dict[str, Any] = {
    "method": "nft",
    "seed": 42,  # train.seed
    "model.finetune": "lora",  # finetune_type lora
    "model.dtype": "bfloat16",  # mixed_precision bf16
    "model.speed.autocast": "bfloat16",
    "model.lora.init": "gaussian",
    "sampler.schedule.name": "scheduler",  # the pipeline's own grid (set_scheduler_timesteps)
    "sampler.share_noise": False,
    "plan.name": "ode_only",  # dynamics_type ODE
    "group_size": 16,
    "prompts_per_iteration": 48,  # unique_sample_num_per_epoch
    "rewards.0.name": "pickscore",  # reward_model PickScore, weight 1
    "rewards.0.weight": 1.0,
    "advantage.estimator.unbiased": False,  # np.std
    "nft.adv_max": 5.0,  # adv_clip_range 5.0: r = clip(A / 5 / 2 + 0.5, 0, 1), loss x 5
    "nft.time_sampling": "discrete",  # time_sampling_strategy discrete (include_init, no force_init)
    "nft.timestep_fraction": 0.5,  # timestep_range 0.5: grid sigmas >= 0.5
    "nft.decay": "linear",  # piecewise_linear: flat_steps 0, ramp_rate 0.001, ema_decay 0.5
    "nft.decay_clock": "iterations",  # ema_step(step=self.epoch), ema_update_interval 1
    "nft.kl_coef": 0.0,  # kl_beta 0
    "optim.weight_decay": 1e-4,  # adam_weight_decay
    "optim.betas": [0.9, 0.999],
    "optim.eps": 1e-8,
    "optim.max_grad_norm": 1.0,
    "optim.loss_scale.mode": "none",  # bf16: no loss scaling
    "train.inner_epochs": 1,  # num_inner_epochs default 1
    "train.mini_batches": 1,  # gradient_step_per_epoch 1
    "ema.enabled": False,  # the only EMA is the old policy
}

METHODS_NFT_PINS: dict[str, dict[str, Any]] = {
    "ff_sd35_nft": {  # examples/nft/lora/sd3_5/default.yaml
        **NFT_EXAMPLES,
        "model.family": "sd3",
        "model.pretrained": "stabilityai/stable-diffusion-3.5-medium",
        "model.options.max_sequence_length": 512,  # SD3_5Adapter.encode_prompt default
        "model.lora.rank": 32,
        "model.lora.alpha": 64,
        "model.lora.target_modules": [
            "attn.add_q_proj",
            "attn.add_k_proj",
            "attn.add_v_proj",
            "attn.to_add_out",
            "attn.to_q",
            "attn.to_k",
            "attn.to_v",
            "attn.to_out.0",
        ],  # fmt: skip
        "sampler.num_steps": 14,
        "sampler.guidance_scale": 1.0,
        "sampler.cfg_mode": "none",  # guidance_scale > 1.0 is False
        "sampler.train_cfg_mode": "none",
        "sampler.height": 512,
        "sampler.width": 512,
        "advantage.estimator.name": "grpo",  # advantage_aggregation sum
        "advantage.estimator.std_scope": "group",  # global_std false
        "nft.beta": 1.0,  # nft_beta
        "nft.timesteps": 4,  # num_train_timesteps
        "train.micro_batch_size": 8,  # per_device_batch_size
        "optim.lr": 1e-4,  # learning_rate
        "eval.every": 20,  # eval_freq
        "eval.num_steps": 40,
        "checkpoint.every": 20,  # save_freq
    },
    "ff_klein_base_nft": {  # examples/nft/lora/flux2_klein_base/default.yaml
        **NFT_EXAMPLES,
        "model.family": "flux2_edit",  # the example's rows carry source images
        "model.pretrained": "black-forest-labs/FLUX.2-klein-base-4B",
        "data.image_resize": "crop",
        "model.lora.rank": 64,
        "model.lora.alpha": 128,
        "model.lora.target_modules": [
            "attn.to_q",
            "attn.to_k",
            "attn.to_v",
            "attn.to_out.0",
            "attn.add_q_proj",
            "attn.add_k_proj",
            "attn.add_v_proj",
            "attn.to_add_out",
            "ff.linear_in",
            "ff.linear_out",
            "ff_context.linear_in",
            "ff_context.linear_out",
            "attn.to_qkv_mlp_proj",
        ],  # fmt: skip
        "sampler.num_steps": 8,
        "sampler.guidance_scale": 4.0,
        "sampler.negative_prompt": "",  # encode_prompt: negative_prompt None -> ""
        "sampler.cfg_mode": "full",  # guidance_scale > 1.0: true CFG in the rollout
        "sampler.train_cfg_mode": "full",  # the training forward is guided too, no detach
        "sampler.height": 384,
        "sampler.width": 384,
        "advantage.estimator.name": "gdpo",  # advantage_aggregation gdpo
        "nft.beta": 0.1,  # nft_beta
        "nft.timesteps": 2,  # num_train_timesteps
        "train.micro_batch_size": 1,  # per_device_batch_size
        "optim.lr": 1e-4,
        "eval.every": 20,
        "eval.num_steps": 28,
        "checkpoint.every": 20,
    },
    "ff_zimage_nft": {  # examples/nft/lora/z_image/default.yaml
        **NFT_EXAMPLES,
        "model.family": "zimage",
        "model.pretrained": "Tongyi-MAI/Z-Image",
        "model.lora.rank": 64,
        "model.lora.alpha": 128,
        "model.lora.target_modules": [
            "attention.to_k",
            "attention.to_q",
            "attention.to_v",
            "attention.to_out.0",
            "feed_forward.w1",
            "feed_forward.w2",
            "feed_forward.w3",
        ],  # fmt: skip
        "model.options": {},  # cfg_normalization off, as the adapter's default
        "sampler.num_steps": 10,
        "sampler.guidance_scale": 4.0,  # pos + 4 (pos - neg) at every step (cfg_truncation 1.0)
        "sampler.negative_prompt": "",
        "sampler.cfg_mode": "full",  # guidance_scale > 0: CFG in the rollout
        "sampler.train_cfg_mode": "full",  # and in the training forward, no detach
        "sampler.height": 512,
        "sampler.width": 512,
        "advantage.estimator.name": "gdpo",
        "nft.beta": 0.1,
        "nft.timesteps": 2,
        "train.micro_batch_size": 1,
        "optim.lr": 3e-4,
        "eval.every": 40,
        "eval.num_steps": 40,
        "checkpoint.every": 40,
    },
}


def _cfg(recipe: str):
    return load_t2i_config(REAL_DIR / f"{recipe}.yaml")


@pytest.mark.parametrize("recipe", sorted(METHODS_NFT_PINS))
def test_recipe_equals_the_published_run(recipe):
    assert_pinned(_cfg(recipe), recipe, METHODS_NFT_PINS[recipe])


@pytest.mark.parametrize(
    "recipe, per_device, batches", [("ff_sd35_nft", 8, 12), ("ff_klein_base_nft", 1, 96), ("ff_zimage_nft", 1, 96)]
)
def test_batches_follow_from_the_launch_and_the_old_policy_decays_per_epoch(recipe, per_device, batches):
    cfg = _cfg(recipe)
    # num_batches_per_epoch = 48 x 16 / (8 GPUs x per_device_batch_size); accumulation auto = batches // 1: one step
    assert cfg.prompts_per_iteration * cfg.group_size // (8 * per_device) == batches
    assert cfg.train.micro_batch_size == per_device and cfg.train.mini_batches == 1
    # ema_step(step=epoch) after each epoch's optimize: decay min(0.001 epoch, 0.5), 0 after the first epoch
    assert [old_decay(e, cfg.nft.decay) for e in (0, 1, 499, 500, 900)] == [0.0, 0.001, pytest.approx(0.499), 0.5, 0.5]


def test_sd35_training_times_are_the_high_noise_half_of_its_grid():
    """SD3.5-M's scheduler (static shift 3) at 14 steps: the timesteps >= 500 are indices 0..9, and the 4 strata
    of linspace(0, 9, 5) are [0, 2), [2, 4), [4, 6), [6, 9)."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    sched = FlowMatchEulerDiscreteScheduler(shift=3.0)  # stabilityai/stable-diffusion-3.5-medium scheduler_config
    sched.set_timesteps(14)
    sig = sched.sigmas.float()
    valid = [i for i, t in enumerate(sched.timesteps.tolist()) if t >= 500 - 1e-3]
    assert valid == list(range(10))
    cfg = _cfg("ff_sd35_nft")
    g = torch.Generator().manual_seed(0)
    seen = [[int((sig == s).nonzero()[0]) for s in discrete_times(g, sig, cfg.nft.timesteps, 0.5)] for _ in range(200)]
    strata = [(0, 2), (2, 4), (4, 6), (6, 9)]
    assert all(lo <= k < hi for draw in seen for k, (lo, hi) in zip(draw, strata))
    assert {k for draw in seen for k in draw} == set(range(9))  # index 9 (the last >= 500) is never drawn
