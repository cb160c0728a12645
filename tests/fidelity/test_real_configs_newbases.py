"""The Edit-R1 and Flow-Factory recipes (docs/recipes.md, "Edit-R1" and "Flow-Factory recipes") against their
published runs: every tabled setting pinned from the loaded config, the batch sizes derived from the published
launches, the SDE-step draws, the EMA cadence, the reward settings, and Qwen-Image's pipeline grid.

PKU-YuanGroup/Edit-R1@4217f25 (config/{kontext,qwen_image_edit}_nft.py, scripts/train_nft_*.py) and
X-GenGroup/Flow-Factory@a0b2bc5 (examples/grpo/lora/{flux2_klein,z_image_turbo,qwen_image}/default.yaml,
src/flow_factory). Only configs are loaded, plus one tiny Qwen-Image adapter for the grid.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from flowgrpo.t2i import load_t2i_config
from pipelines.plans import build_plan
from test_real_configs import assert_pinned  # one pin reader for every real-recipe table

REAL_DIR = Path(__file__).resolve().parents[2] / "configs" / "t2i" / "real"

ATTN8 = ["attn.add_k_proj", "attn.add_q_proj", "attn.add_v_proj", "attn.to_add_out", "attn.to_k", "attn.to_out.0",
         "attn.to_q", "attn.to_v"]  # fmt: skip

# Edit-R1 _get_config + scripts/train_nft_*.py (shared by both bases)
EDIT_R1 = {
    "method": "nft",
    "seed": 42,
    "model.finetune": "lora",
    "model.speed.autocast": "bfloat16",
    "model.speed.gradient_checkpointing": True,
    "model.component_dtypes.text_encoder": "bfloat16",
    "model.component_dtypes.vae": "float32",
    "model.lora.rank": 32,
    "model.lora.alpha": 64,
    "model.lora.init": "gaussian",
    "model.lora.target_modules": ATTN8,
    "data.image_resize": "crop",  # centre crop to a square, then resize
    "sampler.num_steps": 6,
    "sampler.cfg_mode": "none",
    "sampler.train_cfg_mode": "none",
    "sampler.height": 512,
    "sampler.width": 512,
    "sampler.schedule.name": "scheduler",
    "plan.name": "ode_only",  # sample.deterministic = True
    "plan.solver": "dpm2m",  # sample.solver = "dpm2"
    "group_size": 12,
    "prompts_per_iteration": 24,
    "rewards.0.name": "edit_judge",
    "rewards.0.template": "edit_r1",
    "rewards.0.scoring": "expected_digit",
    "rewards.0.score_min": 0.0,
    "rewards.0.score_max": 5.0,
    "rewards.0.source_index": 0,
    "rewards.0.model": "Qwen2.5-VL-32B-Instruct",
    "rewards.0.jpeg_quality": 75,  # img.save(buffer, format="JPEG"): PIL's default quality
    "rewards.0.max_tokens": 3,
    "rewards.0.weight": 1.0,
    "advantage.estimator.name": "grpo",
    "advantage.estimator.std_scope": "batch",  # global_std = True
    "advantage.estimator.unbiased": False,
    "advantage.estimator.eps": 1e-4,
    "advantage.transforms.0.name": "clip",
    "advantage.transforms.0.max": 5.0,
    "nft.beta": 1.0,
    "nft.adv_max": 5.0,
    "nft.timestep_fraction": 0.99,
    "nft.decay": "linear",  # decay_type 1: min(0.001 t, 0.5)
    "nft.kl_coef": 1e-4,
    "optim.lr": 3e-4,
    "optim.weight_decay": 1e-4,
    "optim.betas": [0.9, 0.999],
    "optim.eps": 1e-8,
    "optim.max_grad_norm": 1.0,
    "optim.loss_scale.mode": "none",
    "train.inner_epochs": 1,
    "train.mini_batches": 1,  # gradient_step_per_epoch = 1
    "ema.enabled": True,
    "ema.decay": 0.9,
    "ema.update_every": 1,
    "ema.schedule": "flow_grpo",
    "ema.updates_per_step": 1,
    "eval.every": 10,
    "eval.num_steps": 15,
    "checkpoint.every": 30,
}

# Flow-Factory's GRPO trainer and the examples' shared settings
FLOW_FACTORY = {
    "seed": 42,
    "model.finetune": "lora",
    "model.dtype": "bfloat16",
    "model.speed.autocast": "bfloat16",
    "model.lora.rank": 64,
    "model.lora.alpha": 128,
    "model.lora.init": "gaussian",
    "sampler.sde_kernel.name": "flow_sde",  # dynamics_type Flow-SDE
    "sampler.share_noise": False,
    "sampler.schedule.name": "scheduler",
    "plan.name": "window",
    "plan.size": 1,  # num_sde_steps 1
    "plan.schedule": "random",
    "plan.start": 1,
    "group_size": 16,
    "prompts_per_iteration": 48,  # unique_sample_num_per_epoch
    "advantage.estimator.name": "gdpo",
    "advantage.estimator.unbiased": False,
    "advantage.transforms.0.name": "clip",
    "advantage.transforms.0.max": 5.0,
    "edges.drop_zero_advantage": False,
    "loss.preset": "flow_grpo",
    "loss.bounds.eps": 1e-4,  # clip_range
    "loss.kl.coef": 0.0,  # kl_beta 0
    "optim.lr": 3e-4,
    "optim.weight_decay": 1e-4,
    "optim.betas": [0.9, 0.999],
    "optim.eps": 1e-8,
    "optim.max_grad_norm": 1.0,
    "optim.loss_scale.mode": "none",
    "train.inner_epochs": 1,
    "train.mini_batches": 2,  # gradient_step_per_epoch 2
    "train.micro_batch_size": 1,  # per_device_batch_size 1
    "ema.enabled": True,
    "ema.decay": 0.9,
    "ema.update_every": 8,  # every 4 iterations of 2 optimizer steps
    "ema.schedule": "flow_grpo",
    "ema.updates_per_step": 1,
}

PINS: dict[str, dict[str, Any]] = {
    "edit_r1_kontext": {  # config/kontext_nft.py:kontext_mllm_reward
        **EDIT_R1,
        "model.family": "flux_kontext",
        "model.pretrained": "black-forest-labs/FLUX.1-Kontext-dev",
        "model.dtype": "float32",  # from_pretrained without torch_dtype
        "model.component_dtypes.text_encoder_2": "bfloat16",
        "model.options.max_sequence_length": 128,
        "sampler.guidance_scale": 2.5,  # into the guidance embedding
        "train.micro_batch_size": 3,
        "edges.group_filter": None,  # ban_prompt = False: every group trains, every prompt stays
        "prompt_sampling.name": "uniform",
    },
    "edit_r1_qwen_edit": {  # config/qwen_image_edit_nft.py:qwen_mllm_reward
        **EDIT_R1,
        "model.family": "qwenimage_edit_plus",
        "model.pretrained": "Qwen/Qwen-Image-Edit-2509",
        "model.dtype": "bfloat16",  # from_pretrained(..., torch_dtype=torch.bfloat16)
        "sampler.guidance_scale": 1.0,  # true_cfg_scale 1.0: no CFG
        "train.micro_batch_size": 3,
        # ban_prompt = True, ban_std_thres 0.05, ban_mean_thres 0.9 (train_nft_qwen_image_edit.py valid_mask;
        # PerPromptStatTracker.update's ban)
        "edges.group_filter.min_std": 0.05,
        "edges.group_filter.max_mean": 0.9,
        "prompt_sampling.name": "ban_saturated",
        "prompt_sampling.std_below": 0.05,
        "prompt_sampling.mean_above": 0.9,
    },
    "ff_klein_grpo": {  # examples/grpo/lora/flux2_klein/default.yaml
        **FLOW_FACTORY,
        "model.family": "flux2_edit",  # the example's rows carry source images
        "model.pretrained": "black-forest-labs/FLUX.2-klein-9B",
        "data.image_resize": "crop",
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
        "sampler.num_steps": 4,
        "sampler.guidance_scale": 1.0,
        "sampler.cfg_mode": "none",  # guidance_scale > 1.0 is False
        "sampler.height": 384,
        "sampler.width": 384,
        "sampler.sde_kernel.a": 0.5,
        "plan.range_end": 3,  # sde_steps [1, 2]
        "rewards.0.name": "pickscore",
        "rewards.0.weight": 1.0,
        "eval.every": 20,
        "eval.num_steps": 10,
        "checkpoint.every": 20,
    },
    "ff_zimage_turbo_grpo": {  # examples/grpo/lora/z_image_turbo/default.yaml
        **FLOW_FACTORY,
        "model.family": "zimage",
        "model.pretrained": "Tongyi-MAI/Z-Image-Turbo",
        "model.lora.target_modules": [
            "attention.to_k",
            "attention.to_q",
            "attention.to_v",
            "attention.to_out.0",
            "feed_forward.w1",
            "feed_forward.w2",
            "feed_forward.w3",
        ],  # fmt: skip
        "sampler.num_steps": 6,
        "sampler.guidance_scale": 0.0,
        "sampler.cfg_mode": "none",  # guidance_scale > 0 is False
        "sampler.height": 512,
        "sampler.width": 512,
        "sampler.sde_kernel.a": 0.7,
        "plan.range_end": 4,  # sde_steps [1, 2, 3]
        "rewards.0.name": "pickscore",
        "rewards.0.weight": 1.0,
        "eval.every": 40,
        "eval.num_steps": 10,
        "checkpoint.every": 40,
    },
    "ff_zimage_grpo": {  # examples/grpo/lora/z_image/default.yaml: the Turbo recipe on the base model
        **FLOW_FACTORY,
        "model.family": "zimage",
        "model.pretrained": "Tongyi-MAI/Z-Image",
        "model.lora.target_modules": [
            "attention.to_k",
            "attention.to_q",
            "attention.to_v",
            "attention.to_out.0",
            "feed_forward.w1",
            "feed_forward.w2",
            "feed_forward.w3",
        ],  # fmt: skip
        "model.options": {},  # cfg_normalization off (0), as the example's default False
        "sampler.num_steps": 10,
        "sampler.guidance_scale": 4.0,  # pos + 4 (pos - neg) at every step (cfg_truncation 1.0)
        "sampler.negative_prompt": "",
        "sampler.cfg_mode": "full",
        "sampler.train_cfg_mode": "full",
        "sampler.height": 512,
        "sampler.width": 512,
        "sampler.sde_kernel.a": 0.7,
        "plan.range_end": 4,
        "rewards.0.name": "pickscore",
        "rewards.0.weight": 1.0,
        "eval.every": 40,
        "eval.num_steps": 40,
        "checkpoint.every": 40,
    },
    "ff_qwenimage_2512_grpo": {  # examples/grpo/lora/qwen_image/default.yaml
        **FLOW_FACTORY,
        "model.family": "qwenimage",
        "model.pretrained": "Qwen/Qwen-Image-2512",
        "model.speed.gradient_checkpointing": True,
        "model.options.cfg_renorm": True,
        "model.lora.target_modules": [
            "attn.to_k",
            "attn.to_q",
            "attn.to_v",
            "attn.to_out.0",
            "attn.add_q_proj",
            "attn.add_k_proj",
            "attn.add_v_proj",
            "attn.to_add_out",
            "img_mlp.net.0.proj",
            "txt_mlp.net.0.proj",
        ],  # fmt: skip
        "sampler.num_steps": 10,
        "sampler.guidance_scale": 4.0,
        "sampler.negative_prompt": "",
        "sampler.cfg_mode": "full",
        "sampler.train_cfg_mode": "full",
        "sampler.height": 512,
        "sampler.width": 512,
        "sampler.sde_kernel.a": 1.0,
        "plan.range_end": 4,
        "rewards.0.name": "clip_score",
        "rewards.0.weight": 1.0,
        "rewards.1.name": "pickscore",
        "rewards.1.weight": 0.5,
        "eval.every": 20,
        "eval.num_steps": 28,
        "checkpoint.every": 20,
    },
}


def _cfg(recipe: str):
    return load_t2i_config(REAL_DIR / f"{recipe}.yaml")


@pytest.mark.parametrize("recipe", sorted(PINS))
def test_recipe_equals_the_published_run(recipe):
    assert_pinned(_cfg(recipe), recipe, PINS[recipe])


@pytest.mark.parametrize("recipe", sorted(PINS))
def test_reward_names_and_settings_exist(recipe):
    from reward_models import get_entry

    for spec in _cfg(recipe).rewards:
        unknown = set(spec.settings) - set(get_entry(spec.name).settings)
        assert not unknown, f"{recipe}: scorer '{spec.name}' has no setting(s) {sorted(unknown)}"


def edit_r1_launch(n_gpus: int, num_groups: int = 24, k: int = 12, steps: int = 1) -> tuple[int, int, int]:
    """Edit-R1's _get_config search: (bsz, num_batches_per_epoch, gradient_accumulation_steps)."""
    bsz = 3
    while bsz >= 1:
        if num_groups * k % (n_gpus * bsz) == 0 and bsz * n_gpus % k == 0:
            batches = num_groups * k // (n_gpus * bsz)
            if batches % steps == 0:
                return bsz, batches, batches // steps
        bsz -= 1
    raise AssertionError("no batch size")


@pytest.mark.parametrize("recipe,gpus", [("edit_r1_kontext", 24), ("edit_r1_qwen_edit", 48)])
def test_edit_r1_batch_sizes_follow_from_the_launch(recipe, gpus):
    cfg = _cfg(recipe)
    bsz, batches, accumulation = edit_r1_launch(gpus)
    assert (bsz, batches) == ((3, 4) if gpus == 24 else (3, 2))
    assert gpus * bsz * batches == cfg.prompts_per_iteration * cfg.group_size == 288
    assert cfg.train.mini_batches == batches // accumulation == 1 and cfg.train.micro_batch_size == bsz
    # int(6 * 0.99) = 5 of the 6 grid times per sample
    assert int(cfg.sampler.num_steps * cfg.nft.timestep_fraction) == 5


@pytest.mark.parametrize("recipe,sde_steps", [
    ("ff_klein_grpo", {1, 2}), ("ff_zimage_turbo_grpo", {1, 2, 3}), ("ff_zimage_grpo", {1, 2, 3}),
    ("ff_qwenimage_2512_grpo", {1, 2, 3}),
])  # fmt: skip
def test_flow_factory_batches_sde_step_draws_and_ema(recipe, sde_steps):
    from flowgrpo.run.ema import flow_grpo_decay

    cfg = _cfg(recipe)
    # num_batches_per_epoch = 48 x 16 / (8 GPUs x 1); gradient_accumulation_steps auto = 96 // 2
    batches = cfg.prompts_per_iteration * cfg.group_size // (8 * cfg.train.micro_batch_size)
    accumulation = batches // 2  # gradient_step_per_epoch 2
    assert batches == 96 and batches // accumulation == cfg.train.mini_batches
    drawn = [build_plan(cfg.plan.name, cfg.sampler.num_steps, it, 0, **cfg.plan.settings) for it in range(60)]
    assert all([i for i, s in enumerate(p.steps) if s.sde] == p.trained_steps for p in drawn)
    assert {p.trained_steps[0] for p in drawn} == sde_steps  # one SDE step, ODE elsewhere, only it trained
    # ema_update_interval 4 epochs: our clock counts 2 optimizer steps per iteration; the updates fall in
    # iterations 3, 7, 11, ... as Flow-Factory's (epoch + 1) % 4 == 0
    updated = {(clock - 1) // 2 for clock in range(1, 200) if flow_grpo_decay(cfg.ema, clock) is not None}
    assert updated == {e for e in range(100) if (e + 1) % 4 == 0}


def test_qwenimage_grid_is_the_pipeline_s():
    """Qwen-Image(-2512) at the recipe's 10 steps and 512 px, and at eval's 28 / 1024 px: the adapter's grid (Qwen-Image's
    scheduler config: dynamic exponential shift, shift_terminal 0.02) equals QwenImagePipeline's
    retrieve_timesteps(sigmas=linspace(1, 1/n, n), mu=calculate_shift(tokens, ...))."""
    import numpy as np
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.pipelines.qwenimage import pipeline_qwenimage as qp

    from types import SimpleNamespace

    from pipelines.adapters.qwenimage import QwenImageAdapter

    qwen_scheduler = {
        "base_image_seq_len": 256, "base_shift": 0.5, "max_image_seq_len": 8192, "max_shift": 0.9,
        "num_train_timesteps": 1000, "shift": 1.0, "shift_terminal": 0.02, "time_shift_type": "exponential",
        "use_dynamic_shifting": True,
    }  # fmt: skip
    # the grid reads only the scheduler config and the token count: no model needed
    a = SimpleNamespace(
        family="qwenimage", scheduler_config=qwen_scheduler, image_seq_len=lambda h, w: (h // 16) * (w // 16)
    )
    for steps, px in ((10, 512), (28, 1024), (4, 512)):
        tokens = (px // 16) ** 2  # 8x VAE, 2x2 packing
        ours = QwenImageAdapter.flow_grid(a, steps, px, px, None)  # type: ignore[arg-type]
        ref = FlowMatchEulerDiscreteScheduler.from_config(qwen_scheduler)
        c = ref.config
        mu = qp.calculate_shift(tokens, c.base_image_seq_len, c.max_image_seq_len, c.base_shift, c.max_shift)
        qp.retrieve_timesteps(ref, steps, "cpu", sigmas=np.linspace(1.0, 1 / steps, steps), mu=mu)
        assert float((ours.sigmas - ref.sigmas.float()).abs().max()) < 1e-6, (steps, px)
    with pytest.raises(ValueError, match="sampler.shift does not apply"):
        QwenImageAdapter.flow_grid(a, 4, 512, 512, 3.0)  # type: ignore[arg-type]
