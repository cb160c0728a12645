"""Every tiny recipe runs end to end: on-policy ratio 1, the documented metrics, the artifacts of a run."""

from pathlib import Path

import pytest

from flowgrpo.metrics import read_metrics
from flowgrpo.t2i import train_t2i

from .learning_runs import RECIPES_DIR

RECIPES = sorted(p.stem for p in RECIPES_DIR.glob("*.yaml") if not p.stem.startswith("_"))
KEYS = [
    "iteration",
    "reward_mean",
    "reward_std",
    "adv/mean",
    "adv/std",
    "time_iteration_s",
    "nfe_nograd",
    "nfe_grad",
    "backward_passes",
    "reward_calls",
    "time_rollout_s",
    "time_reward_s",
    "time_train_s",
    "peak_memory_mb",
    "images",
]
GRPO_KEYS = [
    "approx_kl",
    "ratio/mean",
    "clip/frac",
    "clip/low_frac",
    "clip/high_frac",
    "check/first_pass_ratio_dev",
    "edges/trained",
]


def test_every_tiny_recipe_is_here():
    # a recipe lost by a rename or a move would silently leave this file's runs
    assert len(RECIPES) == 35


@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_runs(recipe_config, recipe):
    cfg = recipe_config(recipe, "iterations=2", "artifacts.grid_every=1")
    history = train_t2i(cfg)
    out = Path(cfg.output_dir)
    records = read_metrics(out / "metrics.jsonl")
    assert [r["iteration"] for r in records] == [1, 2]
    grpo = cfg.method == "grpo"
    for r in records:
        policy_step = r.get("adversarial/policy_update", 1)  # Adv-GRPO: discriminator iterations skip the policy
        missing = [k for k in KEYS + (GRPO_KEYS if grpo and policy_step else []) if k not in r]
        assert not missing, missing
        assert r["nfe_nograd"] > 0 and r["reward_calls"] > 0
        for reward in cfg.rewards:
            assert f"rewards/{reward.label}/mean" in r
    updates = [r for r in history if r.get("adversarial/policy_update", 1)]
    for r in updates:
        assert r["backward_passes"] > 0 and r["nfe_grad"] > 0
        if grpo:
            assert r["check/first_pass_ratio_dev"] < 1e-4  # the rollout re-scored by its own weights: ratio 1
    for name in (
        "config.yaml",
        "grids/eval_before.png",
        "grids/eval_after.png",
        "grids/rollout_000001.png",
        # a full fine-tune (hunyuan_dance_grpo, as its published run) saves a diffusers model folder
        "lora/pytorch_lora_weights.safetensors"
        if cfg.model.finetune == "lora"
        else "transformer/diffusion_pytorch_model.safetensors",
        "checkpoints/step_00000002/state.json",
    ):
        # a video family's grids are clips: save_grid writes them beside the .png name as .mp4 (or .webp)
        videos = [(out / name).with_suffix(s) for s in (".mp4", ".webp")] if name.endswith(".png") else []
        assert (out / name).is_file() or any(v.is_file() for v in videos), name
