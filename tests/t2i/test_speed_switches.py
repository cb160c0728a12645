"""The speed switches reach the trainer through its config alone (model.speed, sampler.inference_mode):
with every numerically neutral switch on, an iteration's records equal those of the plain run; with
bf16 autocast on fp32 weights the live on-policy check still reads ratio 1."""

import math

import pytest

from flowgrpo.t2i.trainer import T2ITrainer

NEUTRAL = [
    "sampler.inference_mode=true",
    "model.speed.gradient_checkpointing=true",
    "model.speed.cfg_forward=split",
    "model.speed.decode_batch_size=3",
    "model.speed.compile={enabled: true, backend: eager}",
]
KEYS = ("reward_mean", "grad_norm", "check/first_pass_ratio_dev")


def _first_record(recipe_config, *overrides, name):
    cfg = recipe_config("flow_grpo", "iterations=1", "eval.every=0", "ema.enabled=false", *overrides, name=name)
    trainer = T2ITrainer(cfg)
    try:
        return trainer, trainer.train_iteration()
    finally:
        trainer.rewards.close()


def test_neutral_switches_leave_the_iteration_unchanged(recipe_config):
    _, plain = _first_record(recipe_config, name="plain")
    trainer, fast = _first_record(recipe_config, *NEUTRAL, name="fast")
    assert trainer.adapter.denoiser.is_gradient_checkpointing and trainer.adapter.cfg_forward == "split"
    assert trainer.sampler.config.inference_mode
    for key in KEYS:
        assert key in plain, key
        assert fast[key] == pytest.approx(plain[key], rel=1e-4, abs=1e-6), key
    # the policy loss is a sum of O(1) terms -A * ratio that cancel to ~1e-6: compare on their scale
    assert fast["loss/policy"] == pytest.approx(plain["loss/policy"], abs=1e-5)


def test_autocast_bf16_keeps_the_on_policy_ratio(recipe_config):
    _, rec = _first_record(recipe_config, "model.speed.autocast=bfloat16", "sampler.inference_mode=true", name="bf16")
    assert math.isfinite(rec["loss/policy"]) and rec["check/first_pass_ratio_dev"] <= 1e-4
