"""The video recipes equal their published runs, setting by setting (docs/recipes.md, "DanceGRPO on HunyuanVideo" and
"Flow-GRPO on Wan 2.1"); only configs are loaded (no adapter, no weights).

XueZeyue/DanceGRPO (snapshot 15cc71d): scripts/finetune/finetune_hunyuan_grpo.sh + fastvideo/train_grpo_hunyuan.py.
yifan123/flow_grpo: config/grpo.py:general_ocr_wan2_1 (31c71b9) over config/base.py, scripts/train_wan2_1.py
(32b48fd), the launch in README (94e23ee: one process).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from flowgrpo.t2i import load_t2i_config
from pipelines.plans import build_plan
from reward_models import get_entry

REAL_DIR = Path(__file__).resolve().parents[2] / "configs" / "t2i" / "real"

VIDEO_PINS: dict[str, dict[str, Any]] = {
    "dance_grpo_hunyuanvideo": {
        "iterations": 202,  # --max_train_steps 202
        "seed": 42,
        "model.family": "hunyuan_video",
        "model.finetune": "full",
        "model.dtype": "float32",  # --master_weight_type fp32
        "model.speed.autocast": "bfloat16",
        "model.speed.gradient_checkpointing": True,
        "model.speed.tf32": True,
        "model.options.num_frames": 53,  # --t 53
        "sampler.num_steps": 16,
        "sampler.guidance_scale": 6.018,  # guidance=6018.0 into the embedding (x 1000 in the adapter)
        "sampler.cfg_mode": "none",
        "sampler.train_cfg_mode": "none",
        "sampler.height": 480,
        "sampler.width": 480,
        "sampler.schedule.name": "time_shift",
        "sampler.schedule.shift": 5.0,
        "sampler.schedule.integer_timesteps": True,
        "sampler.sde_kernel.name": "dance_sde",
        "sampler.sde_kernel.eta": 0.25,
        "sampler.share_noise": True,  # --use_same_noise
        "sampler.decode": "last_x0",
        "group_size": 24,
        "prompts_per_iteration": 32,  # 4 nodes x 8 GPUs x 1 prompt
        "rollout_prompts": 1,
        "rewards.0.name": "videoalign",
        "rewards.0.vq": 1.0,  # --vq_coef 1.0
        "rewards.0.mq": 0.0,  # --mq_coef 0.0
        "rewards.0.ta": 0.0,  # the TA head is never read
        "rewards.0.weight": 1.0,
        "advantage.estimator.name": "grpo",
        "advantage.estimator.std_scope": "group",
        "advantage.estimator.unbiased": True,
        "advantage.estimator.eps": 1e-8,
        "advantage.transforms.0.name": "top_bottom_k",
        "advantage.transforms.0.k": 4,  # --bestofn 8: 4 best + 4 worst
        "advantage.transforms.1.name": "clip",
        "advantage.transforms.1.max": 5.0,
        "loss.bounds.eps": 1e-4,
        "loss.kl.coef": 0.0,
        "plan.name": "full_sde",
        "plan.train_fraction": 1.0,
        "edges.per_sample_fraction": 0.6,
        "edges.exclude_last": True,
        "edges.drop_zero_advantage": False,
        "optim.lr": 1e-5,
        "optim.schedule": "constant",  # constant_with_warmup, --lr_warmup_steps 0
        "optim.warmup_steps": 0,
        "optim.weight_decay": 1e-4,
        "optim.betas": [0.9, 0.999],
        "optim.eps": 1e-8,
        "optim.max_grad_norm": 1.0,
        "train.inner_epochs": 1,
        "train.mini_batches": 2,  # 8 kept samples / --gradient_accumulation_steps 4
        "train.micro_batch_size": 1,
        "ema.enabled": False,
        "checkpoint.every": 50,
    },
    "flow_grpo_wan21": {
        "seed": 42,
        "model.family": "wan",
        "model.pretrained": "Wan-AI/Wan2.1-T2V-1.3B-Diffusers",
        "model.finetune": "lora",
        "model.dtype": "float32",
        "model.speed.autocast": "bfloat16",  # accelerate mixed_precision bf16
        "model.speed.gradient_checkpointing": True,
        "model.speed.tf32": True,
        "model.component_dtypes.text_encoder": "bfloat16",
        "model.component_dtypes.vae": "float32",
        "model.options.num_frames": 33,
        "model.lora.rank": 32,
        "model.lora.alpha": 64.0,
        "model.lora.init": "gaussian",
        "model.lora.target_modules": [
            "add_k_proj",
            "add_q_proj",
            "add_v_proj",
            "to_add_out",
            "to_k",
            "to_out.0",
            "to_q",
            "to_v",
        ],  # fmt: skip
        "data.path": "prompts/ocr_train.txt",
        "data.eval_path": "prompts/ocr_test.txt",
        "sampler.num_steps": 20,
        "sampler.guidance_scale": 4.5,
        "sampler.negative_prompt": "",
        "sampler.cfg_mode": "full",
        "sampler.train_cfg_mode": "full",  # train.cfg True
        "sampler.height": 240,
        "sampler.width": 416,
        "sampler.schedule.name": "scheduler",
        "sampler.share_noise": False,
        "sampler.sde_kernel.name": "wan_sde",  # std_dev_t = sigma_min + (sigma_1 - sigma_min) sigma
        "plan.name": "full_sde",
        "plan.train_fraction": 0.99,
        "group_size": 4,
        "prompts_per_iteration": 4,  # 1 process x 8 x 2 batches / 4
        "rollout_prompts": 2,
        "rewards.0.name": "per_frame",
        "rewards.0.reward": {"name": "ocr", "substring_match": False},
        "rewards.0.frames": [0, 4, 8, 12, 16, 20, 24, 28, 32],  # frame_interval 4
        "rewards.0.aggregate": "positive_mean",  # the mean over frames with reward > 0, else 0
        "advantage.estimator.name": "grpo",
        "advantage.estimator.std_scope": "group",  # global_std False
        "advantage.estimator.unbiased": False,
        "advantage.estimator.eps": 1e-4,
        "advantage.transforms.0.name": "clip",
        "advantage.transforms.0.max": 5.0,
        "edges.drop_zero_advantage": True,
        "loss.bounds.eps": 1e-3,  # clip_range 1e-3
        "loss.kl.estimator": "gaussian",  # / (2 (std_dev_t sqrt(dt))^2): the transition variance
        "loss.kl.coef": 0.004,
        "loss.step_weighting.name": "std_over_dt",  # policy_loss * std_dev_t.mean() / sqrt(dt).mean()
        "optim.lr": 1e-4,
        "optim.weight_decay": 1e-4,
        "optim.betas": [0.9, 0.999],
        "optim.eps": 1e-8,
        "optim.max_grad_norm": 1.0,
        "train.inner_epochs": 1,
        "train.mini_batches": 2,  # gradient_accumulation_steps 1: a step per batch of 8
        "train.micro_batch_size": 8,  # train.batch_size = sample.train_batch_size = 8
        "ema.enabled": True,
        "ema.decay": 0.9,
        "ema.update_every": 8,
        "ema.schedule": "flow_grpo",
        "ema.updates_per_step": 1,
        "eval.every": 30,
        "eval.num_steps": 50,
        "checkpoint.every": 60,
    },
}


@pytest.mark.parametrize("recipe", sorted(VIDEO_PINS))
def test_video_recipe_equals_the_published_run(recipe):
    # imported here, not at the top: test_real_configs may import VIDEO_PINS from this module for its recipe census
    from test_real_configs import assert_pinned

    cfg = load_t2i_config(REAL_DIR / f"{recipe}.yaml")  # every section and cross-check; no adapter is built
    assert_pinned(cfg, recipe, VIDEO_PINS[recipe])
    for spec in cfg.rewards:  # scorer names and settings exist, without building a scorer
        unknown = set(spec.settings) - set(get_entry(spec.name).settings)
        assert not unknown, f"{recipe}: scorer '{spec.name}' has no setting(s) {sorted(unknown)}"


def test_dance_hunyuan_launch_arithmetic_and_trained_steps():
    cfg = load_t2i_config(REAL_DIR / "dance_grpo_hunyuanvideo.yaml")
    kept = 2 * cfg.advantage.transforms[0].settings["k"]  # best-of-n keeps 8 of the 24
    assert kept == 8 and kept // 4 == cfg.train.mini_batches  # accumulation 4 per rank
    assert int(0.6 * (cfg.sampler.num_steps - 1)) == 9  # int(15 * 0.6) steps per sample, the last one dropped
    assert (cfg.model.options["num_frames"] - 1) // 4 + 1 == 14  # latent frames


def test_wan_launch_arithmetic_and_trained_steps():
    cfg = load_t2i_config(REAL_DIR / "flow_grpo_wan21.yaml")
    world, per_batch, batches = 1, 8, 2
    assert world * per_batch * batches == cfg.prompts_per_iteration * cfg.group_size
    assert cfg.rollout_prompts * cfg.group_size == per_batch
    plan = build_plan(cfg.plan.name, cfg.sampler.num_steps, 0, 0, **cfg.plan.settings)
    assert list(plan.trained_steps) == list(range(19))  # int(20 * 0.99), no time shuffle
    assert cfg.rewards[0].settings["frames"] == list(range(0, 33, 4))  # video[::4] of 33 frames
    assert (
        cfg.sampler.sde_kernel.settings == {}
    )  # the published SDE has no noise-level setting (sample.noise_level unused)
