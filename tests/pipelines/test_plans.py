"""Rollout plans: shapes of each method's plan, schedules, and bad settings."""

import pytest

from pipelines.plans import PLANS, RolloutPlan, StepPlan, build_plan, with_steps


def test_full_sde_trains_high_noise_prefix():
    plan = build_plan("full_sde", 10)
    assert all(s.sde for s in plan.steps) and plan.trained_steps == list(range(9))
    assert plan.leaves_per_root == 1 and plan.edges_per_root == 10


def test_full_sde_random_subset_is_reproducible_per_iteration():
    a = build_plan("full_sde", 20, iteration=3, seed=1, random_subset=5)
    b = build_plan("full_sde", 20, iteration=3, seed=1, random_subset=5)
    c = build_plan("full_sde", 20, iteration=4, seed=1, random_subset=5)
    assert a == b and len(a.trained_steps) == 5 and a.trained_steps != c.trained_steps


def test_flow_grpo_fast_random_window_inside_range():
    starts = set()
    for it in range(40):
        plan = build_plan("window", 10, iteration=it, size=2, range_end=5)
        trained = plan.trained_steps
        assert len(trained) == 2 and trained[1] == trained[0] + 1 and trained[-1] < 5
        assert all(plan.steps[i].sde == (i in trained) for i in range(10))
        starts.add(trained[0])
    assert starts == {0, 1, 2, 3}


def test_mixgrpo_progressive_window_moves_and_rolls_back():
    starts = [
        build_plan("window", 8, iteration=it, size=4, schedule="progressive", iters_per_shift=2).trained_steps[0]
        for it in range(12)
    ]
    assert starts == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 0, 0]


def test_mixgrpo_decay_spends_fewer_iterations_at_low_noise():
    starts = [
        build_plan("window", 6, iteration=it, size=2, schedule="decay", max_iters=4, min_iters=1).trained_steps[0]
        for it in range(12)
    ]
    counts = [starts.count(p) for p in range(5)]
    # 4 iterations at the first position, falling linearly to 1 at the last (4 - 3 p / 4, rounded)
    assert counts == [4, 3, 2, 2, 1]


def test_mixgrpo_flash_uses_second_order_after_window():
    plan = build_plan("window", 10, size=3, schedule="fixed", start=2, post_solver="dpm2m")
    assert [s.solver for s in plan.steps] == ["euler"] * 5 + ["dpm2m"] * 5
    assert plan.shared_prefix and plan.first_stochastic_step == 2


def test_branchgrpo_tree_edge_count_matches_paper():
    plan = build_plan("tree", 20, split_steps=(0, 3, 6, 9), branch=2, noise_scale=4.0)
    assert plan.leaves_per_root == 16 and plan.edges_per_root == 218
    assert plan.steps[3].noise_scale == 4.0 and plan.steps[4].noise_scale == 1.0
    assert len(plan.trained_steps) == 20


def test_branchgrpo_mix_keeps_splits_sde_and_trains_only_sde():
    plan = build_plan("tree", 20, iteration=0, split_steps=(0, 3, 6, 9), mix_window=4)
    sde = [i for i, s in enumerate(plan.steps) if s.sde]
    assert sde == [0, 1, 2, 3, 6, 9] and plan.trained_steps == sde


def test_tempflow_branch_points():
    plan = build_plan("branch_points", 10)
    assert [s.side_branches for s in plan.steps] == [6] * 9 + [0]
    assert not any(s.sde for s in plan.steps) and plan.trained_steps == list(range(9))
    assert build_plan("branch_points", 10, points=[2, 5], k=3).trained_steps == [2, 5]


def test_tp_grpo_and_vgpo_probes():
    tp = build_plan("probes", 10)
    assert tp.probe_depths == frozenset(range(9)) and tp.trained_steps == list(range(9)) and not tp.one_step_probes
    vg = build_plan("probes", 10, one_step=True, window_end=5)
    assert vg.one_step_probes and vg.trained_steps == list(range(5)) and not vg.steps[7].sde


def test_ode_only_trains_nothing():
    plan = build_plan("ode_only", 6, solver="dpm2m")
    assert plan.trained_steps == [] and plan.first_stochastic_step is None
    assert {s.solver for s in plan.steps} == {"dpm2m"}


@pytest.mark.parametrize(
    "name,settings,match",
    [
        ("window", {"size": 11}, "does not fit"),
        ("window", {"schedule": "weird"}, "schedule"),
        ("tree", {"split_steps": (12,)}, "split_steps"),
        ("branch_points", {"points": [-1]}, "points"),
        ("probes", {"window_start": 5, "window_end": 5}, "window"),
        ("ode_only", {"solver": "rk4"}, "solver"),
    ],
)
def test_bad_settings_raise(name, settings, match):
    with pytest.raises(ValueError, match=match):
        build_plan(name, 10, **settings)


def test_unknown_plan_and_setting_list_valid_names():
    with pytest.raises(ValueError, match="valid names"):
        build_plan("windw", 10)
    with pytest.raises(ValueError, match="valid settings"):
        build_plan("window", 10, sizee=2)
    with pytest.raises(ValueError, match="num_steps"):
        build_plan("full_sde", 0)


def test_invalid_hand_made_plans():
    with pytest.raises(ValueError, match="cannot be trained"):
        RolloutPlan("x", (StepPlan(sde=False, trained=True),)).validate()
    with pytest.raises(ValueError, match="need an SDE step"):
        RolloutPlan("x", (StepPlan(sde=False, trained=False, branch=2),)).validate()
    with pytest.raises(ValueError, match="probe_depths"):
        RolloutPlan("x", (StepPlan(sde=True, trained=True),), probe_depths=frozenset({3})).validate()
    plan = with_steps(build_plan("tree", 10, split_steps=(0,), noise_scale=3.0), noise_scale=1.0)
    assert {s.noise_scale for s in plan.steps} == {1.0}
    assert sorted(PLANS.names()) == ["branch_points", "full_sde", "ode_only", "probes", "tree", "window"]
