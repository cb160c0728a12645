"""`rollout_split`: a prompt's group rolled out in parts (separate batches, each seeded by itself), so that a group
can straddle ranks, while credit assignment still sees the whole group: one set of group statistics over
group_size images, not one per part."""

from __future__ import annotations

import pytest
import torch

from flowgrpo.t2i import T2ITrainer, load_t2i_config
from flowgrpo.t2i.credit import assign_credit

from .learning_runs import RECIPES_DIR


def _config(tmp_path, *overrides: str):
    return load_t2i_config(
        RECIPES_DIR / "flow_grpo.yaml",
        [f"output_dir={tmp_path / 'run'}", "progress=false", "artifacts.tensorboard=false", "artifacts.plot=false",
         "prompts_per_iteration=2", "group_size=8", *overrides],
    )  # fmt: skip


def test_split_groups_are_credited_whole(tmp_path):
    from pipelines.plans import build_plan

    cfg = _config(tmp_path, "rollout_split=4")
    trainer = T2ITrainer(cfg)
    try:
        prompts = trainer.prompts.take([0, 1])
        plan = build_plan(cfg.plan.name, cfg.sampler.num_steps, 0, cfg.seed, **cfg.plan.settings)
        rollout = trainer._collect({}, prompts, plan, keep_images=False)
    finally:
        trainer.close()
    assert rollout.tree.leaves.shape == (8, 2)  # 2 prompts x 4 parts, 2 images each, as sampled
    assert rollout.global_tree.leaves.shape == (2, 8)  # what credit assignment sees: 2 groups of 8
    assert rollout.prompts == ["a red apple"] * 4 + ["a blue car"] * 4  # the local tree's prompt of each part
    credit = assign_credit(rollout.global_tree, rollout.leaf_values, None, None, cfg, 0)
    # a sample's advantage is its reward's z-score within its whole group of 8 (std_scope group)
    rewards = rollout.leaf_values[:, 0].view(2, 8).double()
    # the recipe's estimator: grpo with the biased std, eps 1e-4 (its clip at 5 does not bind here)
    want = (rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True, unbiased=False) + 1e-4)
    leaf_adv = credit.node_advantage[rollout.global_tree.leaves]
    # float32 rounding of a tiny reward spread; a per-part normalisation would be off by O(1)
    torch.testing.assert_close(leaf_adv.double(), want, rtol=2e-3, atol=1e-4)
    part_means = leaf_adv.view(2, 4, 2).mean(-1)
    assert part_means.abs().max() > 1e-3  # parts are not normalised on their own


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["rollout_split=3"], "must divide group_size 8"),
        (["rollout_split=2", "rollout_prompts=2"], "rollout_prompts 1"),
        (["rollout_split=2", "method=nft", "sampler.cfg_mode=none"], "method grpo"),
        (
            ["rollout_split=2", "plan={name: tree, split_steps: [0, 3]}", "advantage.estimator.name=tree_depth"],
            "chain plan",
        ),
        (["rollout_split=2", "sampler.share_noise=true"], "share_noise_size"),
    ],
)
def test_splits_that_cannot_work_are_refused(tmp_path, overrides, message):
    with pytest.raises(ValueError, match=message):
        _config(tmp_path, *overrides)
