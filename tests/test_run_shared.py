"""What the two trainers share lives once: the on-policy warning, the optimizer step, the method registry, and
the estimator needs the config checks and credit assignment read."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from flowgrpo.core import ESTIMATORS
from flowgrpo.distributed import Distributed
from flowgrpo.guards import GuardConfig, NonFiniteGuard, NonFiniteWarning
from flowgrpo.run import FirstPassCheck, OnPolicyRatioWarning, OptimConfig, OptimizerStep, build_optimizer


def test_one_on_policy_warning_for_both_trainers():
    import flowgrpo.t2i
    import flowgrpo.text

    assert flowgrpo.t2i.OnPolicyRatioWarning is flowgrpo.text.OnPolicyRatioWarning is OnPolicyRatioWarning


def test_first_pass_check_records_and_warns_past_the_tolerance():
    check = FirstPassCheck(enabled=True, tolerance=1e-4)
    check.observe(2e-5, 3)
    check.observe(1e-5, 2)
    record: dict = {}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check.report(record, "step 1", "suspects")
    assert record == {"check/first_pass_ratio_dev": 2e-5, "check/rows": 5}
    check.observe(1e-3, 1)
    with pytest.warns(OnPolicyRatioWarning, match="ON-POLICY CHECK FAILED at step 2"):
        check.report(record, "step 2", "suspects")
    off: dict = {}
    FirstPassCheck(enabled=False, tolerance=1e-4).report(off, "step 1", "")
    assert off == {}


def test_optimizer_step_clips_counts_and_zeroes():
    p = torch.nn.Parameter(torch.zeros(3))
    optimizer, scheduler = build_optimizer([p], OptimConfig(lr=0.1, max_grad_norm=1.0), 10, fused=False)
    step = OptimizerStep([p], optimizer, 1.0, Distributed())
    step.begin()
    p.grad = torch.tensor([3.0, 4.0, 0.0])
    norm = step()
    assert norm == pytest.approx(5.0) and p.grad is None and step.total == 1
    assert step.metrics() == {
        "optimizer_steps": 1,
        "grad_norm": pytest.approx(5.0),
        "grad_norm_max": pytest.approx(5.0),
    }
    assert scheduler.get_last_lr() == [pytest.approx(0.1)] and not math.isnan(float(p.detach().sum()))


def test_optimizer_step_with_a_guard_never_steps_on_a_nan_gradient():
    p = torch.nn.Parameter(torch.ones(3))
    optimizer, _ = build_optimizer([p], OptimConfig(lr=0.1), 10, fused=False)
    guard = NonFiniteGuard(GuardConfig(max_bad_updates=5), "step")
    step = OptimizerStep([p], optimizer, 1.0, Distributed(), guard=guard)
    step.begin()
    p.grad = torch.tensor([math.nan, 1.0, 0.0])
    assert math.isnan(step())
    assert torch.equal(p.detach(), torch.ones(3)) and p.grad is None and step.total == 0
    assert optimizer.state_dict()["state"] == {}  # no AdamW moment saw the NaN
    p.grad = torch.tensor([1.0, 1.0, 1.0])
    step()
    assert step.total == 1 and bool(torch.isfinite(p.detach()).all()) and not torch.equal(p.detach(), torch.ones(3))
    record: dict = {}
    with pytest.warns(NonFiniteWarning, match="1 optimizer step"):
        guard.end_update(record, 1, [p])
    assert record["guard/skipped_steps"] == 1 and record["guard/bad_streak"] == 1


def test_image_methods_are_registered_plugins():
    from flowgrpo.t2i import trainer  # noqa: F401  (imports the method modules)
    from flowgrpo.t2i.methods import METHODS, WRAPPERS

    assert METHODS.names() == ["grpo", "nft"] and WRAPPERS.names() == ["adversarial"]


def test_estimators_declare_the_plan_they_read():
    planned = {n: ESTIMATORS.get(n).plan for n in ESTIMATORS.names() if ESTIMATORS.get(n).plan}
    assert planned == {
        "sibling": "branch_points",
        "turning_point": "probes",
        "value_anchored": "probes",
        "tree_depth": "tree",
    }
    for name in ESTIMATORS.names():  # per-step and node estimators cannot read any plan's final rewards
        entry = ESTIMATORS.get(name)
        assert bool(entry.plan) == bool({"step_rewards", "tree"} & entry.requires), name
