"""The editing recipes' batch sizes, EMA calls and SDE window follow from the published launches.

yifan123/flow_grpo config/grpo.py@31c71b9: counting_flux_kontext (28 GPUs, 3 images x 12 batches, group 21) and
repairany_qwenimage_edit_plus_fast (2 GPUs, torchrun, 4 images x 16 batches, group 4); docs/recipes.md,
"Editing recipes". Only configs are loaded.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from flowgrpo.t2i import load_t2i_config
from pipelines.plans import build_plan

REAL_DIR = Path(__file__).resolve().parents[2] / "configs" / "t2i" / "real"

# recipe: (world size, images per batch, group, prompts budget of num_batches_per_epoch)
LAUNCHES = {"kontext_edit": (28, 3, 21, 48), "qwenimage_edit_plus": (2, 4, 4, 32)}


@pytest.mark.parametrize("recipe", sorted(LAUNCHES))
def test_batch_sizes_follow_from_the_launch(recipe):
    world, per_batch, group, budget = LAUNCHES[recipe]
    batches = int(budget / (world * per_batch / group))  # num_batches_per_epoch as config/grpo.py computes it
    accumulation = batches // 2
    cfg = load_t2i_config(REAL_DIR / f"{recipe}.yaml")
    assert world * per_batch * batches == cfg.prompts_per_iteration * cfg.group_size
    assert cfg.group_size == group and cfg.train.mini_batches == batches // accumulation == 2
    if cfg.ema.enabled:
        assert cfg.ema.updates_per_step == accumulation  # ema.step after every training batch


def test_qwenimage_edit_plus_window_starts_at_0_or_1():
    cfg = load_t2i_config(REAL_DIR / "qwenimage_edit_plus.yaml")
    plans = [
        build_plan(cfg.plan.name, cfg.sampler.num_steps, it, s, **cfg.plan.settings) for it in range(60) for s in (0, 1)
    ]
    assert {p.trained_steps[0] for p in plans} == {0, 1}  # randint(0, 5 - 4)
    assert all(len(p.trained_steps) == 4 for p in plans)


def test_kontext_trains_the_first_five_of_six_steps():
    cfg = load_t2i_config(REAL_DIR / "kontext_edit.yaml")
    plan = build_plan(cfg.plan.name, cfg.sampler.num_steps, 0, 0, **cfg.plan.settings)
    assert list(plan.trained_steps) == [0, 1, 2, 3, 4]  # int(6 * 0.99) = 5, range(num_train_timesteps)
