"""The real recipes stay equal to the published runs: docs/recipes.md's values, pinned key by key.

Each recipe has a dict of dotted config keys -> the published value (or our stated choice where the
published code fixes nothing: those are commented). Only configs are loaded; no model is built and no
weights are needed. A later edit that drifts from the table fails here with the key that moved.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

from flowgrpo.core.config import PartSpec
from flowgrpo.t2i import load_t2i_config
from pipelines.plans import build_plan

REAL_DIR = Path(__file__).resolve().parents[2] / "configs" / "t2i" / "real"

FLOW_GRPO_LORA_TARGETS = [
    "attn.add_k_proj",
    "attn.add_q_proj",
    "attn.add_v_proj",
    "attn.to_add_out",
    "attn.to_k",
    "attn.to_out.0",
    "attn.to_q",
    "attn.to_v",
]

# yifan123/flow_grpo config/base.py + config/grpo.py:pickscore_sd3, scripts/train_sd3.py
SD35M = {
    "model.family": "sd3",
    "model.pretrained": "stabilityai/stable-diffusion-3.5-medium",
    "model.finetune": "lora",
    "model.dtype": "float32",  # transformer.to(device) without a dtype (docs/recipes.md, precision)
    "model.speed.autocast": "float16",  # accelerate mixed_precision fp16 wraps the prepared forward
    # pipeline.text_encoder*.to(device, dtype=inference_dtype), pipeline.vae.to(device, dtype=torch.float32)
    "model.component_dtypes.text_encoder": "float16",
    "model.component_dtypes.text_encoder_2": "float16",
    "model.component_dtypes.text_encoder_3": "float16",
    "model.component_dtypes.vae": "float32",
    "optim.loss_scale.mode": "dynamic",  # accelerate's native AMP under fp16: torch's GradScaler, its defaults
    "optim.loss_scale.init_scale": 65536.0,
    "optim.loss_scale.growth_interval": 2000,
    "model.options.max_sequence_length": 128,  # compute_text_embeddings(..., max_sequence_length=128)
    "seed": 42,
    "model.lora.rank": 32,
    "model.lora.alpha": 64,
    "model.lora.init": "gaussian",
    "model.lora.target_modules": FLOW_GRPO_LORA_TARGETS,
    "sampler.height": 512,
    "sampler.width": 512,
    "sampler.num_steps": 10,
    "sampler.guidance_scale": 4.5,
    "sampler.cfg_mode": "full",
    "sampler.train_cfg_mode": "full",  # compute_log_prob: no detach of the uncond branch
    "sampler.schedule.name": "scheduler",  # diffusers FlowMatchEuler, shift 3 from the checkpoint
    "sampler.sde_kernel.name": "flow_sde",
    "sampler.sde_kernel.a": 0.7,
    "sampler.share_noise": False,  # same_latent = False
    "group_size": 24,
    "prompts_per_iteration": 48,
    "train.inner_epochs": 1,
    "train.mini_batches": 2,
    "optim.lr": 3e-4,
    "optim.weight_decay": 1e-4,
    "optim.betas": [0.9, 0.999],
    "optim.eps": 1e-8,
    "optim.max_grad_norm": 1.0,
    "advantage.transforms.0.name": "clip",
    "advantage.transforms.0.max": 5.0,
    "ema.enabled": True,
    "ema.decay": 0.9,
    "ema.update_every": 8,
    "ema.schedule": "flow_grpo",  # EMAModuleWrapper: decay min((1 + g) / (10 + g), 0.9), (g + 1) % 8
    "ema.updates_per_step": 2,  # ema.step after each of the 2 batches of an optimizer step
    "ema.count_idle_iterations": False,
    "eval.num_steps": 40,
    "data.path": "prompts/pickscore_train.txt",
}
# flow_grpo/pickscore_scorer.py: scores / 26 (also in TempFlow-GRPO and TP-GRPO)
PICKSCORE = {
    "rewards.0.name": "pickscore",
    "rewards.0.dtype": "float32",
    "rewards.0.preprocess": "pil",  # pickscore_score: uint8 PIL images into the CLIP processor
    "rewards.0.weight": 1 / 26,
}
GLOBAL_STD = {
    "advantage.estimator.name": "grpo",
    "advantage.estimator.std_scope": "batch",
    "advantage.estimator.unbiased": False,
    "advantage.estimator.eps": 1e-4,
}

# The FastVideo trainer shared by DanceGRPO, MixGRPO, BranchGRPO and Pref-GRPO (fastvideo/train_grpo_flux.py)
FLUX = {
    "model.family": "flux",
    "model.pretrained": "black-forest-labs/FLUX.1-dev",
    "model.finetune": "full",
    "model.dtype": "float32",
    "model.speed.autocast": "bfloat16",
    "model.speed.gradient_checkpointing": True,  # --gradient_checkpointing in every published FLUX script
    "sampler.height": 720,
    "sampler.width": 720,
    "sampler.guidance_scale": 3.5,
    "sampler.cfg_mode": "none",
    "sampler.train_cfg_mode": "none",
    "sampler.schedule.name": "time_shift",
    "sampler.schedule.shift": 3.0,
    "sampler.schedule.integer_timesteps": True,  # timestep = int(1000 sigma), then / 1000
    "sampler.share_noise": True,  # --init_same_noise
    "train.micro_batch_size": 1,
    "optim.lr": 1e-5,
    "optim.schedule": "constant",
    "optim.warmup_steps": 0,
    "optim.weight_decay": 1e-4,
    "optim.betas": [0.9, 0.999],
    "optim.eps": 1e-8,
    "optim.max_grad_norm": 1.0,
    "advantage.transforms.0.name": "clip",
    "advantage.transforms.0.max": 5.0,
    "loss.kl.coef": 0.0,
    "edges.drop_zero_advantage": False,
    "ema.enabled": False,
    "iterations": 300,
}
HPS21 = {"rewards.0.name": "hpsv2", "rewards.0.version": "v2.1", "data.path": "prompts/hpdv2_train.txt"}
GROUP_UNBIASED = {
    "advantage.estimator.name": "grpo",
    "advantage.estimator.std_scope": "group",
    "advantage.estimator.unbiased": True,
    "advantage.estimator.eps": 1e-8,
}
TREE = {
    "sampler.num_steps": 20,
    "sampler.sde_kernel.name": "dance_sde",
    "sampler.sde_kernel.eta": 0.3,
    "sampler.decode": "last_x0",
    "group_size": 16,
    "prompts_per_iteration": 16,
    "plan.name": "tree",
    "plan.split_steps": [0, 3, 6, 9],
    "plan.branch": 2,
    "plan.noise_scale": 4.0,
    "advantage.estimator.name": "tree_depth",
    "advantage.estimator.fusion": "mean",
    "advantage.estimator.eps": 1e-8,
    "advantage.estimator.unbiased": True,
    "advantage.estimator.min_std": 1e-6,
    "loss.bounds.eps": 1e-3,
    "edges.width_pruning": None,
    "edges.depth_pruning": None,
}
MIXGRPO = {
    "sampler.num_steps": 25,
    "sampler.sde_kernel.name": "flow_sde",
    "sampler.sde_kernel.a": 0.7,
    "sampler.decode": "final",
    "group_size": 12,
    "prompts_per_iteration": 32,
    "train.mini_batches": 4,
    "plan.name": "window",
    "plan.size": 4,
    "plan.schedule": "progressive",
    "plan.stride": 1,
    "rewards.0.name": "hpsv2",
    "rewards.0.version": "v2.1",
    "rewards.1.name": "imagereward",
    "rewards.2.name": "pickscore",
    "rewards.0.weight": 1 / 3,
    "rewards.1.weight": 1 / 3,
    "rewards.2.weight": 1 / 3,
    "advantage.estimator.name": "gdpo",
    "advantage.estimator.batch_norm": False,
    "advantage.estimator.eps": 1e-8,
    "advantage.estimator.unbiased": True,
    "loss.bounds.eps": 1e-4,
    "data.path": "prompts/hpdv2_train.txt",
}
PREF = {
    "sampler.num_steps": 25,
    "sampler.sde_kernel.name": "flow_sde",
    "sampler.sde_kernel.a": 0.7,
    "sampler.decode": "last_x0",
    "group_size": 8,
    "prompts_per_iteration": 64,
    "train.mini_batches": 2,
    "plan.name": "full_sde",
    "plan.train_fraction": 1.0,
    "edges.per_sample_fraction": 0.6,
    "edges.exclude_last": True,
    "rewards.0.name": "vlm_judge_pairwise",
    "rewards.0.model": "UnifiedReward",
    "rewards.0.weight": 0.7,
    "rewards.1.name": "clip_score",
    "rewards.1.model": "apple/DFN5B-CLIP-ViT-H-14-378",  # README: wget .../DFN5B-CLIP-ViT-H-14-378/.../open_clip_pytorch_model.bin
    "rewards.1.variant": "cosine",
    "rewards.1.weight": 1.4,
    "advantage.estimator.name": "gdpo",
    "advantage.estimator.batch_norm": False,
    "advantage.estimator.eps": 1e-8,
    "advantage.estimator.unbiased": True,
    "loss.bounds.eps": 1e-4,
    "data.path": "prompts/unigenbench_train.txt",
}
# The LoRA variants: the lineage's published FLUX LoRA setting (DanceGRPO finetune_flux_grpo_8gpus_lora.sh, Pref-GRPO
# finetune_prefgrpo_flux_lora.sh): r128 / alpha 256, peft default init, 4 targets, fp32 frozen weights under bf16 autocast.
FLUX_LORA = {
    "model.finetune": "lora",
    "model.dtype": "float32",
    "model.speed.autocast": "bfloat16",
    "model.lora.rank": 128,
    "model.lora.alpha": 256,
    "model.lora.init": "default",  # init_lora_weights=True
    "model.lora.target_modules": ["to_k", "to_q", "to_v", "to_out.0"],
    "optim.lr": 1e-5,
}

# yifan123/flow_grpo editing runs (docs/recipes.md, "Editing recipes"); shared by both edit recipes
FLOW_GRPO_EDIT = {
    "model.finetune": "lora",
    "model.dtype": "float32",  # fp32 transformer (master weights), bf16 compute
    "model.speed.autocast": "bfloat16",  # mixed_precision = "bf16"
    "optim.loss_scale.mode": "none",  # bf16: no loss scaling
    "seed": 42,
    "model.lora.rank": 64,
    "model.lora.alpha": 128,
    "model.lora.init": "gaussian",
    "sampler.height": 512,
    "sampler.width": 512,
    "sampler.sde_kernel.name": "flow_sde",
    "sampler.sde_kernel.a": 0.9,
    "sampler.share_noise": False,
    "train.inner_epochs": 1,
    "train.mini_batches": 2,
    "optim.lr": 3e-4,
    "optim.weight_decay": 1e-4,
    "optim.betas": [0.9, 0.999],
    "optim.eps": 1e-8,
    "optim.max_grad_norm": 1.0,
    "advantage.estimator.name": "grpo",
    "advantage.estimator.std_scope": "batch",
    "advantage.estimator.unbiased": False,
    "advantage.estimator.eps": 1e-4,
    "advantage.transforms.0.name": "clip",
    "advantage.transforms.0.max": 5.0,
    "loss.preset": "flow_grpo",
    "loss.bounds.eps": 1e-4,
    "loss.kl.coef": 0.0,
    "rewards.0.name": "edit_preservation",
    "rewards.0.kind": "clip",
    "rewards.1.name": "geneval",
    "rewards.1.url": "http://127.0.0.1:18085",
}

PINS: dict[str, dict[str, Any]] = {
    "kontext_edit": {  # config/grpo.py:counting_flux_kontext, scripts/train_flux_kontext.py
        **FLOW_GRPO_EDIT,
        "model.family": "flux_kontext",
        "model.pretrained": "black-forest-labs/FLUX.1-Kontext-dev",
        "model.component_dtypes.text_encoder": "bfloat16",
        "model.component_dtypes.text_encoder_2": "bfloat16",
        "model.component_dtypes.vae": "bfloat16",
        "model.options.max_sequence_length": 128,
        "model.lora.target_modules": [
            "attn.to_k",
            "attn.to_q",
            "attn.to_v",
            "attn.to_out.0",
            "attn.add_k_proj",
            "attn.add_q_proj",
            "attn.add_v_proj",
            "attn.to_add_out",
            "ff.net.0.proj",
            "ff.net.2",
            "ff_context.net.0.proj",
            "ff_context.net.2",
            "proj_mlp",
        ],  # fmt: skip
        "sampler.num_steps": 6,
        "sampler.guidance_scale": 2.5,  # into the guidance embedding
        "sampler.cfg_mode": "none",
        "sampler.train_cfg_mode": "none",
        "sampler.schedule.name": "scheduler",
        "plan.name": "full_sde",
        "plan.train_fraction": 0.99,
        "group_size": 21,
        "prompts_per_iteration": 48,  # 28 GPUs x 3 x 12 batches / 21
        "edges.drop_zero_advantage": True,
        "rewards.0.source_index": 0,
        "rewards.0.weight": 0.5,
        "rewards.1.weight": 0.5,
        "ema.enabled": True,
        "ema.decay": 0.9,
        "ema.update_every": 8,
        "ema.schedule": "flow_grpo",
        "ema.updates_per_step": 6,  # 12 batches, accumulation 6
        "eval.every": 30,
        "eval.num_steps": 28,
        "checkpoint.every": 30,
    },
    "qwenimage_edit_plus": {  # config/grpo.py:repairany_qwenimage_edit_plus_fast, train_qwenimage_edit_plus.py
        **FLOW_GRPO_EDIT,
        "model.family": "qwenimage_edit_plus",
        "model.pretrained": "Qwen/Qwen-Image-Edit-2509",
        "model.component_dtypes.text_encoder": "bfloat16",
        "model.component_dtypes.vae": "float32",
        "model.speed.gradient_checkpointing": True,
        "model.options.cfg_renorm": True,
        "model.lora.target_modules": [
            "attn.to_k",
            "attn.to_q",
            "attn.to_v",
            "attn.to_out.0",
            "attn.add_k_proj",
            "attn.add_q_proj",
            "attn.add_v_proj",
            "attn.to_add_out",
            "img_mlp.net.0.proj",
            "img_mlp.net.2",
            "txt_mlp.net.0.proj",
            "txt_mlp.net.2",
        ],  # fmt: skip
        "sampler.num_steps": 10,
        "sampler.guidance_scale": 4.0,  # true_cfg_scale
        "sampler.negative_prompt": " ",
        "sampler.cfg_mode": "full",
        "sampler.train_cfg_mode": "full",
        "sampler.schedule.name": "scheduler",
        "plan.name": "window",
        "plan.size": 4,
        "plan.schedule": "random",
        "plan.range_end": 5,  # start = randint(0, 5 - 4)
        "group_size": 4,
        "prompts_per_iteration": 32,  # 2 GPUs x 4 x 16 batches / 4
        "edges.drop_zero_advantage": False,
        "rewards.0.source_index": 1,  # ref_images = the second pipeline image
        "rewards.0.weight": 0.2,
        "rewards.1.weight": 0.8,
        "ema.enabled": False,
        "eval.every": 30,
        "eval.num_steps": 50,
        "checkpoint.every": 60,
    },
    "flow_grpo": {
        **SD35M,
        **PICKSCORE,
        **GLOBAL_STD,
        "plan.name": "full_sde",
        "plan.train_fraction": 0.99,
        "loss.bounds.eps": 1e-4,
        "loss.kl.estimator": "flow_grpo",
        "loss.kl.coef": 0.01,
        "edges.drop_zero_advantage": True,
    },
    "flow_grpo_fast": {
        **SD35M,
        **PICKSCORE,
        **GLOBAL_STD,
        "sampler.sde_kernel.a": 0.8,
        "sampler.share_noise": True,
        "sampler.share_noise_size": 9,
        "group_size": 18,
        "prompts_per_iteration": 64,  # 24 // 9 calls of 9
        "plan.name": "window",
        "plan.size": 2,
        "plan.schedule": "random",
        "plan.range_end": 7,
        "loss.bounds.eps": 1e-5,
        "loss.kl.coef": 0.0,
    },
    "grpo_guard": {
        **SD35M,
        **PICKSCORE,
        **GLOBAL_STD,
        "plan.name": "full_sde",
        "plan.train_fraction": 0.99,
        "loss.ratio.name": "ratio_norm",
        "loss.step_weighting.name": "inv_dt",
        "loss.bounds.eps": 1e-4,  # GUESS (Pref-GRPO's RatioNorm clip)
        "loss.kl.estimator": "flow_grpo",
        "loss.kl.coef": 0.01,
    },  # GUESS (Flow-GRPO PickScore beta)
    "tempflow_grpo": {
        **SD35M,
        **PICKSCORE,
        "iterations": 998,  # 1000 epochs, the first 2 empty
        "plan.name": "branch_points",
        "plan.k": 6,
        "plan.fraction": 0.99,
        "group_size": 4,
        "prompts_per_iteration": 8,
        "advantage.estimator.name": "sibling",
        "advantage.estimator.eps": 1e-4,
        "advantage.estimator.unbiased": False,
        "loss.step_weighting.name": "noise_aware",
        "loss.bounds.eps": 1e-4,
        "loss.kl.estimator": "gaussian",
        "loss.kl.coef": 0.001,
    },  # transition std
    "tp_grpo": {
        **SD35M,
        **PICKSCORE,
        "data.path": "prompts/pickscore_sfw_train.txt",
        "model.dtype": "float16",  # DeepSpeed ZeRO-2 fp16 engine: module.half(), no autocast
        "model.speed.autocast": None,
        "optim.loss_scale.growth_interval": 1000,  # DeepSpeed's dynamic loss scale: loss_scale_window 1000
        "optim.loss_scale.min_scale": 1.0,  # min_loss_scale 1
        "sampler.sde_kernel.name": "cps",
        "sampler.sde_kernel.a": 0.7,
        "plan.name": "probes",
        "plan.window_start": 0,
        "plan.window_end": 9,
        "advantage.estimator.name": "turning_point",
        "advantage.estimator.eta": 1.0,
        "advantage.estimator.balance": True,
        "advantage.estimator.balance_by": "trend",
        "advantage.estimator.eps": 1e-4,
        "advantage.estimator.unbiased": False,
        "loss.bounds.eps": 1e-5,
        "loss.kl.estimator": "gaussian",
        "loss.kl.coef": 1e-4,
    },  # CPS std
    "vgpo": {
        **SD35M,
        **PICKSCORE,
        "plan.name": "probes",
        "plan.window_start": 0,
        "plan.window_end": 9,
        "plan.one_step": True,
        "advantage.estimator.name": "value_anchored",
        "advantage.estimator.gamma": 0.95,
        "advantage.estimator.k": 0.1,  # gamma and k: GUESSES (no public code)
        "advantage.estimator.absolute_steps": 5,  # Eq. 13 as quoted in the public reviews
        "loss.kl.estimator": "flow_grpo",
        "loss.kl.coef": 0.01,
    },  # GUESS
    # GARDO over Flow-GRPO (tinnerhrhe/GARDO @ 1cc77fb config/gardo.py:general_ocr_sd3; docs/recipes.md "GARDO")
    "gardo": {
        **SD35M,
        "method": "grpo_gardo",
        "data.path": "prompts/ocr_train.txt",
        "data.eval_path": "prompts/ocr_test.txt",
        "rewards.0.name": "ocr",
        "plan.name": "full_sde",
        "plan.train_fraction": 0.89,
        "loss.bounds.eps": 1e-4,
        "loss.kl.coef": 0.0,
        "gardo.main_reward": "ocr",
        "gardo.uncertainty_rewards": ["aesthetic", "imagereward"],
        "gardo.kl_coef": 0.04,
        "gardo.kl_threshold": 3e-4,
        "gardo.reset_every": 15,
        "gardo.adv_clip_max": 5.0,
        "gardo.diversity.features": "timm",
        "gardo.diversity.model": "vit_large_patch16_dinov3.lvd1689m",
    },
    "adv_grpo": {
        **SD35M,
        **GLOBAL_STD,
        "model.dtype": "bfloat16",  # DeepSpeed ZeRO-2 bf16 engine: module.bfloat16(), no autocast
        "model.speed.autocast": None,
        "model.component_dtypes.text_encoder": "bfloat16",  # inference_dtype = bf16
        "model.component_dtypes.text_encoder_2": "bfloat16",
        "model.component_dtypes.text_encoder_3": "bfloat16",
        "optim.loss_scale.mode": "none",  # bf16: no loss scale
        "sampler.sde_kernel.a": 0.8,
        "sampler.share_noise": True,
        "sampler.share_noise_size": 8,
        "group_size": 16,
        "prompts_per_iteration": 48,
        "iterations": 910,  # while global_step < 1000 (+1 per D epoch)
        "ema.updates_per_step": 6,
        "ema.count_idle_iterations": True,
        "plan.name": "window",
        "plan.size": 2,
        "plan.schedule": "fixed",
        "plan.start": 0,
        "rewards.0.name": "dino_discriminator",
        "rewards.0.model": "facebook/dinov2-base",
        "rewards.0.dtype": "bfloat16",  # scorer.to(torch.bfloat16)
        "rewards.0.head_dtype": "bfloat16",  # head.to(torch.bfloat16) before optimizer_D = Adam(head.parameters())
        "rewards.0.normalize_tokens": True,  # dino_patch_cotrain_score: x / (||x|| + 1e-6) before the head
        "rewards.1.name": "pickscore",
        "rewards.1.preprocess": "pil",
        "rewards.1.weight": 0.0,
        "adversarial.enabled": True,
        "adversarial.d_times": 10,
        "adversarial.lr": 1e-4,
        "adversarial.betas": [0.5, 0.999],
        "loss.bounds.eps": 1e-5,
        "loss.kl.coef": 0.0,
    },
    "diffusion_nft": {
        **SD35M,
        **PICKSCORE,
        **GLOBAL_STD,
        "method": "nft",
        "sampler.cfg_mode": "none",
        "sampler.guidance_scale": 1.0,
        "plan.name": "ode_only",
        "plan.solver": "dpm2m",
        "train.mini_batches": 1,
        "nft.beta": 1.0,
        "nft.adv_max": 5.0,
        "nft.timestep_fraction": 0.99,
        "nft.decay": "linear",
        "nft.kl_coef": 1e-4,
        "ema.update_every": 1,
        "ema.updates_per_step": 1,
    },  # ema.step only at the optimizer step
    "dance_grpo": {
        **FLUX,
        **HPS21,
        **GROUP_UNBIASED,
        "sampler.num_steps": 16,
        "sampler.sde_kernel.name": "dance_sde",
        "sampler.sde_kernel.eta": 0.3,
        "sampler.decode": "last_x0",
        "group_size": 12,
        "prompts_per_iteration": 16,
        "plan.name": "full_sde",
        "plan.train_fraction": 1.0,
        "edges.per_sample_fraction": 0.6,
        "edges.exclude_last": True,
        "train.mini_batches": 3,
        "loss.bounds.eps": 1e-4,
    },
    "mixgrpo": {**FLUX, **MIXGRPO, "plan.iters_per_shift": 25},
    "mixgrpo_flash": {
        **FLUX,
        **MIXGRPO,
        "plan.iters_per_shift": 20,  # finetune_flux_grpo_MixGRPO_Flash.sh (33d8f56): iters_per_group=20, overlap step 1
        "plan.post_solver": "dpm2m",
        "plan.post_compress": 0.4,
    },  # dpm_post_compress_ratio
    "branchgrpo": {
        **FLUX,
        **HPS21,
        **TREE,
        "train.mini_batches": 37,
        "loss.aggregation.name": "token_mean",
        "loss.aggregation.scale": 1 / 218,
    },  # / (12 x 218)
    "branchgrpo_mix": {
        **FLUX,
        **HPS21,
        **TREE,
        "plan.mix_window": 4,
        "train.mini_batches": 6,
        "loss.aggregation.name": "token_mean",
        "loss.aggregation.scale": 1 / 34,
    },  # / (12 x 34)
    "pref_grpo": {**FLUX, **PREF},
}
for _name in ("dance_grpo", "mixgrpo", "mixgrpo_flash", "branchgrpo", "branchgrpo_mix", "pref_grpo"):
    PINS[_name].update({"model.speed.tf32": True})  # allow_tf32 = True in every FastVideo main()
    PINS[f"{_name}_lora"] = {**PINS[_name], **FLUX_LORA}
# DanceGRPO's own LoRA run (finetune_flux_grpo_8gpus_lora.sh, ff7bee1): 8 GPUs x 2 prompts, accumulation 12, lr 3e-4
PINS["dance_grpo_lora"].update(
    {"sampler.num_steps": 12, "optim.lr": 3e-4, "train.mini_batches": 2, "iterations": 301, "prompts_per_iteration": 16}
)
for _name, _seed in (("dance_grpo", 42), ("mixgrpo", 714), ("mixgrpo_flash", 714), ("branchgrpo", 42)):
    for _r in (_name, f"{_name}_lora"):
        PINS[_r]["seed"] = _seed  # --seed (set_seed(seed + rank) there)
for _r in ("branchgrpo_mix", "branchgrpo_mix_lora", "pref_grpo", "pref_grpo_lora"):
    PINS[_r]["seed"] = 42


def _get(obj: Any, dotted: str) -> Any:
    """`a.b.0.c` on a pydantic config: fields, then a PartSpec's settings, list indices, dict keys."""
    for part in dotted.split("."):
        if isinstance(obj, (list, tuple)):
            obj = obj[int(part)]
        elif isinstance(obj, BaseModel) and part in type(obj).model_fields:
            obj = getattr(obj, part)
        elif isinstance(obj, PartSpec):
            if part not in obj.settings:
                raise KeyError(f"{dotted}: '{obj.name}' has no setting '{part}' (settings {sorted(obj.settings)})")
            obj = obj.settings[part]
        elif isinstance(obj, dict):
            obj = obj[part]
        else:
            raise KeyError(f"{dotted}: cannot resolve '{part}' on {type(obj).__name__}")
    return obj


def _same(actual: Any, expected: Any) -> bool:
    if isinstance(expected, (list, tuple)):
        return (
            isinstance(actual, (list, tuple))
            and len(actual) == len(expected)
            and all(_same(a, e) for a, e in zip(actual, expected))
        )
    if isinstance(expected, bool) or expected is None or isinstance(expected, str):
        return actual == expected and type(actual) is type(expected)
    if isinstance(expected, (int, float)):
        return (
            isinstance(actual, (int, float))
            and not isinstance(actual, bool)
            and actual == pytest.approx(expected, rel=1e-12)
        )
    return actual == expected


def assert_pinned(cfg: Any, recipe: str, pins: dict[str, Any]) -> None:
    """Every pinned dotted key of `recipe` has its published value in `cfg` (one message listing the drift)."""
    drift = {key: (_get(cfg, key), want) for key, want in pins.items() if not _same(_get(cfg, key), want)}
    assert not drift, f"{recipe}: keys that moved away from docs/recipes.md (actual, published): {drift}"


def _recipes() -> list[str]:
    return sorted(p.stem for p in REAL_DIR.glob("*.yaml") if not p.name.startswith("_"))


def test_every_recipe_is_pinned_and_every_pin_is_a_recipe():
    """Pins here, in test_real_configs_newbases.py, test_real_configs_video.py and test_real_configs_backprop.py
    (each checked there)."""
    import importlib.util

    pinned = set(PINS)
    for module, table in (
        ("test_real_configs_newbases", "PINS"),
        ("test_real_configs_video", "VIDEO_PINS"),
        ("test_real_configs_backprop", "BACKPROP_PINS"),
        ("test_real_configs_methods_awm", "METHODS_AWM_PINS"),
        ("test_real_configs_methods_dpo", "DPO_PINS"),
        ("test_real_configs_methods_nft", "METHODS_NFT_PINS"),
    ):
        spec = importlib.util.spec_from_file_location(module, Path(__file__).with_name(f"{module}.py"))
        assert spec is not None and spec.loader is not None
        loaded = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(loaded)
        pinned |= set(getattr(loaded, table))
    assert set(_recipes()) == pinned, (
        f"recipes without pins: {sorted(set(_recipes()) - pinned)}; "
        f"pins without a recipe: {sorted(pinned - set(_recipes()))}"
    )


@pytest.mark.parametrize("recipe", sorted(PINS))
def test_recipe_equals_the_published_run(recipe):
    assert_pinned(load_t2i_config(REAL_DIR / f"{recipe}.yaml"), recipe, PINS[recipe])  # validates every section


@pytest.mark.parametrize("recipe", sorted(PINS))
def test_reward_names_and_settings_exist(recipe):
    """Scorer names and settings are checked against the registry without building a model."""
    from reward_models import get_entry

    cfg = load_t2i_config(REAL_DIR / f"{recipe}.yaml")
    for spec in cfg.rewards:
        valid = get_entry(spec.name).settings
        unknown = set(spec.settings) - set(valid)
        assert not unknown, f"{recipe}: scorer '{spec.name}' has no setting(s) {sorted(unknown)}"


# dance_grpo_lora is DanceGRPO's own published LoRA run (steps, lr, batch differ: PINS above)
@pytest.mark.parametrize("recipe", sorted(r for r in PINS if r.endswith("_lora") and r != "dance_grpo_lora"))
def test_lora_variant_differs_from_its_recipe_only_in_the_model(recipe):
    main = load_t2i_config(REAL_DIR / f"{recipe[: -len('_lora')]}.yaml").model_dump()
    lora = load_t2i_config(REAL_DIR / f"{recipe}.yaml").model_dump()
    assert main["model"]["finetune"] == "full" and lora["model"]["finetune"] == "lora"
    main.pop("model"), lora.pop("model")
    assert lora == main


def _plan(recipe: str, iteration: int, seed: int = 0):
    cfg = load_t2i_config(REAL_DIR / f"{recipe}.yaml")
    return build_plan(cfg.plan.name, cfg.sampler.num_steps, iteration, seed, **cfg.plan.settings)


def test_trained_steps_of_the_chain_recipes():
    assert _plan("flow_grpo", 0).trained_steps == list(range(9))  # int(10 * 0.99)
    assert _plan("tp_grpo", 0).trained_steps == list(range(9))  # window (0, 9)
    assert _plan("adv_grpo", 0).trained_steps == _plan("adv_grpo", 137).trained_steps == [0, 1]
    starts = {_plan("flow_grpo_fast", it, seed).trained_steps[0] for it in range(200) for seed in (0, 1)}
    assert starts == set(range(6)), starts  # randint(0, 10 // 2)
    assert all(len(_plan("flow_grpo_fast", it).trained_steps) == 2 for it in range(50))
    tempflow = _plan("tempflow_grpo", 0)
    assert [i for i, s in enumerate(tempflow.steps) if s.side_branches == 6] == list(range(9))


def test_mixgrpo_window_over_the_published_300_iterations():
    """GRPOTrainingStates: start 0, +1 every 25 iterations (Flash: every 20, then a DPM tail of int((25 - L) 0.4))."""
    for it in (0, 24, 25, 299):
        start = it // 25
        assert _plan("mixgrpo", it).trained_steps == list(range(start, start + 4)), it
    for it in (0, 20, 299):
        flash, start = _plan("mixgrpo_flash", it), it // 20
        assert flash.trained_steps == list(range(start, start + 4))
        last = start + 3  # the tail after the window rebuilt with max(int((25 - L) * 0.4), 1) points
        post = max(int((25 - last) * 0.4), 1) - 1
        assert [s.solver for s in flash.steps[last + 1 :]] == ["dpm2m"] * post and flash.steps[last].solver == "euler"
        assert flash.num_steps == last + 1 + post and flash.grid_steps == 25


def test_branchgrpo_trees():
    tree = _plan("branchgrpo", 0)
    assert tree.leaves_per_root == 16 and tree.edges_per_root == 218
    assert tree.trained_steps == list(range(20))
    assert {i for i, s in enumerate(tree.steps) if s.branch == 2} == {0, 3, 6, 9}
    assert all(s.noise_scale == 4.0 for s in tree.steps if s.branch == 2)
    for it in (0, 150, 299):  # the published Mix window never moves: SDE = splits + steps 0..3
        mix = _plan("branchgrpo_mix", it)
        assert [i for i, s in enumerate(mix.steps) if s.sde] == [0, 1, 2, 3, 6, 9]
        width, trained_edges = 1, 0
        for s in mix.steps:
            width *= s.branch
            trained_edges += width if s.trained else 0
        assert trained_edges == 34
