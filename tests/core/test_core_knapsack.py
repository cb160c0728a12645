"""Knapsack RL budgets (flowgrpo.core.knapsack): the value against the paper's formula, the DP against brute force,
the fallback, the budgets as a pure function of the checkpointed prompt table, and ragged groups through the core's
estimators (each prompt normalised within its own group)."""

import itertools
import math

import pytest
import torch

from flowgrpo.core import AdvantageConfig, GroupBatch, compute_advantages
from flowgrpo.core.config import PartSpec
from flowgrpo.core.knapsack import (
    allocate,
    check_budget_settings,
    flatten_ragged,
    knapsack_budgets,
    ragged_groups,
    success_rates,
    task_value,
)
from flowgrpo.core.prompt_state import PromptTable, prompt_policy


def _value(n, p):  # the paper's Value(N, p), in Python floats
    return (1 - p**n - (1 - p) ** n) * p * (1 - p) ** 2


def test_task_value_is_the_papers_formula():
    for n, p in [(1, 0.3), (4, 0.5), (8, 0.1), (93, 0.01), (5, 0.0), (5, 1.0)]:
        assert float(task_value(torch.tensor(n), torch.tensor(p, dtype=torch.float64))) == pytest.approx(
            _value(n, p), rel=1e-12, abs=1e-15
        )
    assert float(task_value(torch.tensor(1), torch.tensor(0.4))) == 0.0  # one sample never has spread


def test_allocation_is_the_brute_force_optimum_and_keeps_the_total():
    p = [0.05, 0.5, 0.9, 0.3]
    low, high, total = 1, 6, 14
    best = max(
        (c for c in itertools.product(range(low, high + 1), repeat=4) if sum(c) == total),
        key=lambda c: sum(_value(n, q) for n, q in zip(c, p)),
    )
    got = allocate(torch.tensor(p), total, low, high).tolist()
    assert sum(got) == total and all(low <= n <= high for n in got)
    assert sum(_value(n, q) for n, q in zip(got, p)) == pytest.approx(sum(_value(n, q) for n, q in zip(best, p)))
    assert got[0] > got[2]  # the hard prompt gets more rollouts than the easy one


def test_unusable_budget_falls_back_to_the_lowest_success_rates():
    # p = 0 and 1 have value 0 for any N: the DP keeps them at `low`, the fallback tops up p = 0 first
    got = allocate(torch.tensor([1.0, 0.0, 0.5]), total=12, low=2, high=6).tolist()
    assert got == [2, 4, 6]  # the value fills p = 0.5 up; the 2 left go to p = 0 (unsolved), none to p = 1
    with pytest.raises(ValueError, match=r"total=30 budget cannot be split over 3 prompts within \[2, 6\]"):
        allocate(torch.tensor([0.1, 0.2, 0.3]), total=30, low=2, high=6)
    with pytest.raises(ValueError, match="low <= high"):
        allocate(torch.tensor([0.1]), total=3, low=4, high=2)


def test_budgets_come_from_the_table_alone_and_survive_a_checkpoint():
    table = PromptTable(6, prior=torch.tensor([math.nan, 0.9, math.nan, math.nan, 0.2, math.nan], dtype=torch.float64))
    r = torch.tensor([[1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    table.observe(torch.tensor([0, 3]), r, torch.isfinite(r), step=1)
    rows = [0, 1, 2, 3, 4]
    rates = success_rates(table, rows, unknown=0.5)
    assert rates.tolist() == [0.25, 0.9, 0.5, 1.0, 0.2]  # seen -> rate, else prior, else unknown
    budgets = knapsack_budgets(table, rows, total=40, low=2, high=16)
    assert sum(budgets) == 40 and budgets[3] == 2  # the solved prompt gets the minimum
    resumed = PromptTable(6)  # another process (rank), after a resume: same table -> same budgets
    resumed.load_state_dict(table.state_dict())
    assert knapsack_budgets(resumed, rows, total=40, low=2, high=16) == budgets


def test_ragged_groups_normalise_each_prompt_within_its_own_group():
    budgets = [3, 1, 5, 2]
    flat = torch.tensor([1.0, 0.0, 0.5, 0.7, 0.2, 0.9, 0.9, 0.1, 0.4, 2.0, -1.0])
    rewards, valid = ragged_groups(flat, budgets)
    assert rewards.shape == (4, 5) and valid.sum(1).tolist() == budgets
    assert torch.equal(flatten_ragged(rewards, valid), flat)
    cfg = AdvantageConfig(estimator=PartSpec(name="grpo"))
    adv = compute_advantages(GroupBatch(rewards=rewards, valid=valid), cfg)
    start = 0
    for i, n in enumerate(budgets):
        own = compute_advantages(GroupBatch(rewards=flat[start : start + n].unsqueeze(0)), cfg)
        torch.testing.assert_close(adv.advantages[i, :n], own.advantages[0], rtol=0, atol=1e-6)
        assert bool((adv.advantages[i, n:] == 0).all()) and bool((adv.sample_weight[i, n:] == 0).all())
        start += n
    assert adv.metrics["rewards/nan_count"] == 0  # padding is not an unscored sample
    with pytest.raises(ValueError, match="sum to the 11 rows"):
        ragged_groups(flat, [3, 3])


def test_only_a_trainer_that_lays_out_ragged_groups_accepts_the_sampler():
    table = PromptTable(4)
    with pytest.raises(ValueError, match="sets per-prompt rollout budgets"):
        prompt_policy(table, "knapsack", {"low": 2}, seed=1)  # e.g. the image trainer
    assert prompt_policy(table, "knapsack", {"low": 2}, seed=1, reads_budgets=True) is None  # rows: the permutation's
    with pytest.raises(ValueError, match="has no setting 'lo'"):
        prompt_policy(table, "knapsack", {"lo": 2}, seed=1, reads_budgets=True)
    with pytest.raises(ValueError, match=r"1 <= low <= group_size \(8\) <= high, got low=2, high=4"):
        check_budget_settings(8, low=2, high=4)
