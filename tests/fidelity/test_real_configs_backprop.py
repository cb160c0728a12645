"""The ReFL and AlignProp recipes (docs/recipes.md, "ReFL and AlignProp") against their published runs: every tabled
setting pinned from the loaded config, the batch sizes derived from the published launches, the grad windows the
recipes draw, ReFL's EMA decays next to diffusers' EMAModel, and ReFL's prompt file from its "text" rows.

THUDM/ImageReward@1beb4e4 (ImageReward/ReFL.py, refl.py, scripts/train_refl.sh, data/refl_data.json) and
mihirp1998/AlignProp@185d154 (main.py, config/align_prop.py `aesthetic`, prompts.py, assets/*simple_animals.txt).
Only configs are loaded; no model is built.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from flowgrpo.t2i import load_t2i_config
from test_real_configs import assert_pinned  # one pin reader for every real-recipe table

ROOT = Path(__file__).resolve().parents[2]
REAL_DIR = ROOT / "configs" / "t2i" / "real"

# ImageReward/ReFL.py parse_args defaults + scripts/train_refl.sh + refl.py
REFL = {
    "method": "reward_backprop",
    "model.family": "sd15",
    "model.pretrained": "CompVis/stable-diffusion-v1-4",  # refl.py Trainer("CompVis/stable-diffusion-v1-4", ...)
    "model.finetune": "full",  # AdamW over unet.parameters()
    "model.dtype": "float32",  # the UNet is prepared in fp32; accelerate fp16 autocasts its forward
    "model.speed.autocast": "float16",  # --mixed_precision=fp16
    "model.speed.gradient_checkpointing": True,  # --gradient_checkpointing: unet.enable_gradient_checkpointing()
    "model.speed.tf32": False,  # no --allow_tf32
    "model.component_dtypes.text_encoder": "float16",  # .to(device, dtype=weight_dtype)
    "model.component_dtypes.vae": "float16",
    "data.path": "prompts/refl_train.txt",  # data/refl_data.json, caption_column "text"
    "sampler.num_steps": 40,  # noise_scheduler.set_timesteps(40)
    "sampler.cfg_mode": "none",  # the prompt embedding alone, no unconditional branch
    "sampler.guidance_scale": 1.0,
    "sampler.height": 512,  # latents (B, 4, 64, 64)
    "sampler.width": 512,
    "plan.name": "ode_only",
    "iterations": 100,  # --max_train_steps=100
    "group_size": 2,
    "prompts_per_iteration": 32,  # 8 GPUs x 2 x 4 accumulation = 64 images per optimizer step
    "rewards.0.name": "imagereward",  # RM.load("ImageReward-v1.0")
    "rewards.0.dtype": "float16",  # reward_model.to(device, dtype=weight_dtype)
    "rewards.0.max_length": 35,  # blip.tokenizer(..., max_length=35)
    "rewards.0.weight": 1.0,
    "reward_backprop.form": "refl",
    "reward_backprop.refl_steps": [30, 39],  # mid_timestep = random.randint(30, 39): 0-based grid step with grad
    "reward_backprop.margin": 2.0,  # F.relu(-rewards + 2)
    "reward_backprop.loss_scale": 1e-3,  # --grad_scale 0.001
    "reward_backprop.checkpointing": False,  # the grad call is not wrapped; the UNet checkpoints itself
    "train.mini_batches": 1,
    "train.micro_batch_size": 2,  # --train_batch_size=2
    "train.inner_epochs": 1,
    "optim.lr": 1e-5,  # --learning_rate=1e-05
    "optim.schedule": "constant",  # --lr_scheduler="constant" --lr_warmup_steps=0
    "optim.warmup_steps": 0,
    "optim.weight_decay": 1e-2,  # adam_weight_decay default
    "optim.betas": [0.9, 0.999],
    "optim.eps": 1e-8,
    "optim.max_grad_norm": 1.0,  # --max_grad_norm=1
    "optim.loss_scale.mode": "dynamic",  # accelerate's fp16 GradScaler
    "ema.enabled": True,  # --use_ema
    "ema.decay": 0.9999,  # EMAModel default
    "ema.schedule": "flow_grpo",  # (1 + s) / (10 + s) warm-up: see test_refl_ema_is_diffusers_shifted_by_one_step
    "ema.update_every": 1,
    "eval.every": 0,  # no --validation_prompts
    "checkpoint.every": 100,  # --checkpointing_steps 100
}

# AlignProp config/align_prop.py aesthetic() over general(), main.py
ALIGNPROP = {
    "method": "reward_backprop",
    "seed": 42,
    "model.family": "sd15",
    "model.pretrained": "runwayml/stable-diffusion-v1-5",
    "model.finetune": "lora",
    "model.dtype": "float16",  # pipeline.unet / vae / text_encoder .to(device, dtype=inference_dtype)
    "model.speed.autocast": "float16",  # mixed_precision = "fp16"
    "model.speed.gradient_checkpointing": False,  # checkpoint.checkpoint per UNet call instead (grad_checkpoint)
    "model.speed.tf32": True,  # allow_tf32 = True
    "model.lora.rank": 4,  # LoRAAttnProcessor default rank
    "model.lora.alpha": 4,  # network_alpha None: scale 1
    "model.lora.init": "gaussian",  # LoRALinearLayer: down ~ N(0, 1 / rank), up = 0
    "model.lora.target_modules": ["to_q", "to_k", "to_v", "to_out.0"],
    "data.path": "prompts/simple_animals_train.txt",  # prompt_fn = "simple_animals"
    "data.eval_path": "prompts/simple_animals_test.txt",  # eval_prompt_fn = "eval_simple_animals"
    "sampler.num_steps": 50,  # config.steps = 50, DDIMScheduler
    "sampler.cfg_mode": "full",  # both branches with grad inside the window
    "sampler.guidance_scale": 7.5,  # sd_guidance_scale
    "sampler.negative_prompt": "",  # neg_prompt_embed of [""]
    "sampler.height": 512,
    "sampler.width": 512,
    "plan.name": "ode_only",
    "iterations": 7,  # num_epochs = 7, one optimizer step each
    "group_size": 2,
    "prompts_per_iteration": 4,  # total_samples_per_epoch = total_batch_size = 8
    "rewards.0.name": "aesthetic",  # reward_fn = 'aesthetic': AestheticScorerDiff
    "rewards.0.dtype": "float16",  # AestheticScorerDiff(dtype=inference_dtype)
    "rewards.0.weight": 1.0,
    "reward_backprop.form": "alignprop",
    "reward_backprop.truncation": [1, 50],  # truncated_backprop_minmax (0, 50) without K = 0
    "reward_backprop.margin": 10.0,  # aesthetic_target = 10, |r - 10|
    "reward_backprop.loss_scale": 0.01,  # train.loss_coeff = 0.01 (grad_scale 1)
    "reward_backprop.checkpointing": True,  # grad_checkpoint = True
    "train.mini_batches": 1,
    "train.micro_batch_size": 2,  # per_gpu_capacity = 2
    "train.inner_epochs": 1,
    "optim.lr": 1e-3,
    "optim.schedule": "constant",  # no scheduler
    "optim.weight_decay": 0.1,
    "optim.betas": [0.9, 0.999],
    "optim.eps": 1e-8,
    "optim.max_grad_norm": 5.0,
    "optim.loss_scale.mode": "dynamic",
    "ema.enabled": False,
    "eval.every": 1,  # vis_freq = 1 at every optimizer step
    "eval.use_ema": False,
    "eval.seed": 42,  # same_evaluation: torch.cuda.manual_seed(config.seed)
    "checkpoint.every": 1,  # save_freq = 1
}

BACKPROP_PINS: dict[str, dict[str, Any]] = {"refl": REFL, "alignprop": ALIGNPROP}


def _cfg(recipe: str):
    return load_t2i_config(REAL_DIR / f"{recipe}.yaml")


@pytest.mark.parametrize("recipe", sorted(BACKPROP_PINS))
def test_recipe_equals_the_published_run(recipe):
    assert_pinned(_cfg(recipe), recipe, BACKPROP_PINS[recipe])


@pytest.mark.parametrize("recipe", sorted(BACKPROP_PINS))
def test_reward_names_and_settings_exist(recipe):
    from reward_models import get_entry

    for spec in _cfg(recipe).rewards:
        unknown = set(spec.settings) - set(get_entry(spec.name).settings)
        assert not unknown, f"{recipe}: scorer '{spec.name}' has no setting(s) {sorted(unknown)}"


@pytest.mark.parametrize(
    "recipe, gpus, per_gpu, accumulation",
    [("refl", 8, 2, 4), ("alignprop", 4, 2, 1)],  # train_refl.sh; README's 4 A100s: 8 / 4 per GPU, no accumulation
)
def test_images_per_optimizer_step_follow_from_the_launch(recipe, gpus, per_gpu, accumulation):
    cfg = _cfg(recipe)
    images = cfg.group_size * cfg.prompts_per_iteration
    assert images == gpus * per_gpu * accumulation
    assert cfg.train.mini_batches == 1 and cfg.train.micro_batch_size == per_gpu  # one optimizer step per iteration


def test_grad_windows_the_recipes_draw():
    from flowgrpo.t2i.reward_backprop import expected_grad_steps, grad_window

    g = torch.Generator().manual_seed(0)
    refl = _cfg("refl")
    starts = {grad_window(refl.reward_backprop, 40, g) for _ in range(400)}
    assert {s for s, _, _ in starts} == set(range(30, 40))  # randint(30, 39), inclusive
    assert all(n == 1 and x0 for _, n, x0 in starts)  # one grad call, its predicted x0 scored
    align = _cfg("alignprop")
    windows = [grad_window(align.reward_backprop, 50, g) for _ in range(400)]
    assert {k for _, k, _ in windows} <= set(range(1, 51)) and all(s + k == 50 for s, k, _ in windows)
    # main.py keeps step i's grad when randint(0, 50) <= i: sum_i (i + 1) / 51 = 25 grad steps per image, ours 25.5
    published = sum((i + 1) / 51 for i in range(50))
    assert published == pytest.approx(25.0)
    assert expected_grad_steps(align.reward_backprop, 50) == pytest.approx(published + 0.5)


def test_refl_ema_is_diffusers_shifted_by_one_step():
    """ReFL's EMAModel (decay 0.9999, no warm-up flag) after optimizer step k: 0 (a copy) at k = 1, then
    k / (9 + k); ours (flow_grpo) (1 + k) / (10 + k): the published decay one step later."""
    from diffusers.training_utils import EMAModel

    from flowgrpo.run.ema import flow_grpo_decay

    cfg = _cfg("refl").ema
    published = EMAModel([torch.nn.Parameter(torch.zeros(1))], decay=cfg.decay)
    theirs = [published.get_decay(k) for k in range(1, 102)]
    ours = [flow_grpo_decay(cfg, k) for k in range(1, 101)]
    assert theirs[0] == 0.0
    assert ours == pytest.approx(theirs[1:], rel=1e-12)


def test_refl_prompts_are_the_text_rows(tmp_path):
    """fetch_prompts reads data/refl_data.json's {"text", "image"} rows (stripped, first occurrence kept)."""
    rows = [{"text": " a red fox ", "image": "000001-0001"}, {"text": "a red fox", "image": "2"}, {"text": "owl"}]
    (tmp_path / "refl_data.json").write_text(json.dumps(rows), encoding="utf-8")
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts/fetch_prompts.py"),
            "refl_train",
            "--from",
            str(tmp_path / "refl_data.json"),
            "--out",
            str(tmp_path / "prompts"),
        ],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "prompts/refl_train.txt").read_text(encoding="utf-8").splitlines() == ["a red fox", "owl"]
