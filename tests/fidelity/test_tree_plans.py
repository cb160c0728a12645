"""BranchGRPO's rollout tree against the released rule (Fredreic1849/BranchGRPO fastvideo/train_branchgrpo_flux.py).

run_tree_sample_step, per step i (not per iteration):
    should_split = i in split_points                      # 2 children, noise tree_split_noise_scale
    stride = max(1, depth_pruning_slide_interval); window_start = (i // stride) * stride
    window_end = min(T - 1, window_start + max(1, window_size) - 1); in_window = window_start <= i <= window_end
    SDE (and trained) iff should_split or in_window (mix_ode_sde_tree); every step SDE without it.
"""

from __future__ import annotations

import pytest

from pipelines.plans import build_plan


def released_sde_steps(T: int, splits: set[int], window: int, stride: int) -> list[bool]:
    out = []
    for i in range(T):
        stride_ = max(1, stride)
        start = (i // stride_) * stride_
        end = min(T - 1, start + max(1, window) - 1)
        out.append(i in splits or start <= i <= end)
    return out


@pytest.mark.parametrize("T, window, stride", [(20, 4, 30), (20, 4, 1), (20, 3, 8), (16, 2, 5), (25, 4, 10)])
def test_mix_period_is_the_released_per_step_window(T, window, stride):
    splits = {0, 3, 6, 9}
    for iteration in (0, 1, 37, 500):  # the released rule does not move with the iteration
        plan = build_plan(
            "tree",
            T,
            iteration,
            split_steps=sorted(splits),
            branch=2,
            noise_scale=4.0,
            mix_window=window,
            mix_period=stride,
        )
        want = released_sde_steps(T, splits, window, stride)
        assert [s.sde for s in plan.steps] == want
        assert [s.trained for s in plan.steps] == want
        assert [s.branch for s in plan.steps] == [2 if i in splits else 1 for i in range(T)]
        assert [s.noise_scale for s in plan.steps] == [4.0 if i in splits else 1.0 for i in range(T)]
    assert plan.leaves_per_root == 16


def test_the_8gpu_script_trains_steps_0_to_3_and_the_splits():
    """MIX_SDE_WINDOW_SIZE 4 with DEPTH_PRUNING_SLIDE_INTERVAL 30 over 20 steps: SDE at 0-3, 6 and 9."""
    plan = build_plan("tree", 20, 123, split_steps=[0, 3, 6, 9], mix_window=4, mix_period=30)
    assert [i for i, s in enumerate(plan.steps) if s.sde] == [0, 1, 2, 3, 6, 9]


def test_mix_period_needs_a_window():
    with pytest.raises(ValueError, match="needs mix_window"):
        build_plan("tree", 20, split_steps=[0, 3], mix_period=30)
