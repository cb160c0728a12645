"""Per-prompt state (flowgrpo.core.prompt_state), the SPO estimator and the ACE transform (flowgrpo.core.spo): each
formula re-derived in float64 from the sources' equations, every branch, and the prompt-order hook."""

import math

import pytest
import torch

from flowgrpo.core import AdvantageConfig, GroupBatch, compute_advantages
from flowgrpo.core.config import PartSpec
from flowgrpo.core.contracts import AdvantageResult
from flowgrpo.core.prompt_state import (
    COLUMNS,
    PROMPT_SAMPLERS,
    PromptStateError,
    PromptTable,
    build_prompt_state,
    prompt_policy,
    replay,
    spo_priority,
    spo_value,
    uniform,
)
from flowgrpo.core.spo import ace
from flowgrpo.run.prompts import PromptSampler


def _spo_cfg(**settings):
    return AdvantageConfig(estimator=PartSpec(name="spo", settings=settings))


# --- the table ------------------------------------------------------------------------------------------------


def test_observe_records_rate_spread_and_step_and_skips_unscored_groups():
    t = PromptTable(5)
    r = torch.tensor([[1.0, 0.0, 1.0], [0.5, 0.5, float("nan")], [float("nan")] * 3, [0.0, 1.0, 0.0]])
    ids = torch.tensor([3, 1, 0, 3])  # row 3 twice: the later group wins
    t.observe(ids, r, torch.isfinite(r), step=4)
    assert t["seen"].tolist() == [0, 1, 0, 2, 0]
    assert t["rate"][3] == pytest.approx(1 / 3) and t["rate"][1] == 0.5
    assert t["spread"].tolist() == [0, 0, 0, 1, 0]
    assert t["observed_at"].tolist() == [0, 4, 0, 4, 0]
    assert t.latest_step == 4 and PromptTable(0).latest_step == 0


def test_state_round_trips_exactly_and_a_wrong_state_is_refused():
    t = PromptTable(3)
    t["alpha"][:] = torch.tensor([0.1, 1 / 3, math.pi], dtype=torch.float64)
    u = PromptTable(3)
    u.load_state_dict(t.state_dict())
    for c in COLUMNS:  # prior: NaN (none given)
        torch.testing.assert_close(u[c], t[c], rtol=0, atol=0, equal_nan=True)
    t["alpha"][0] = 9  # the saved state is a copy
    assert u["alpha"][0] == 0.1
    with pytest.raises(PromptStateError, match="covers 3 rows, this dataset has 4"):
        PromptTable(4).load_state_dict(t.state_dict())
    with pytest.raises(PromptStateError, match="columns"):
        PromptTable(3).load_state_dict({"alpha": torch.zeros(3)})


# --- SPO --------------------------------------------------------------------------------------------------------


def _spo_reference(steps, rho, n0, p0, low, high, eps=1e-8):
    """The paper's equations in Python floats: baseline before the step, batch whitening (unbiased std), then
    alpha <- rho alpha + r, beta <- rho beta + 1 - r per group (G observations, one forgetting step)."""
    alpha, beta, out = {}, {}, []
    for ids, rewards in steps:
        for row in ids:
            if row not in alpha:
                alpha[row], beta[row] = n0 * p0, n0 * (1 - p0)
        base = [alpha[row] / (alpha[row] + beta[row]) for row in ids]
        adv = [[(x - low) / (high - low) - b for x in grp] for grp, b in zip(rewards, base)]
        flat = [a for grp in adv for a in grp]
        mean = sum(flat) / len(flat)
        std = math.sqrt(sum((a - mean) ** 2 for a in flat) / (len(flat) - 1))
        out.append([[(a - mean) / (std + eps) for a in grp] for grp in adv])
        for row, grp in zip(ids, rewards):
            s = [(x - low) / (high - low) for x in grp]
            alpha[row] = rho * alpha[row] + sum(s)
            beta[row] = rho * beta[row] + sum(1 - x for x in s)
    return out, alpha, beta


def test_spo_matches_the_paper_equations_in_float64_over_steps():
    g = torch.Generator().manual_seed(0)
    steps = []
    for _ in range(4):
        ids = torch.randint(0, 6, (3,), generator=g).tolist()
        rewards = (torch.randint(0, 3, (3, 2), generator=g).double() - 0.5).tolist()  # in [-0.5, 1.5]
        steps.append((ids, rewards))
    want, alpha, beta = _spo_reference(steps, rho=0.9, n0=3.0, p0=0.4, low=-0.5, high=1.5)
    table = PromptTable(6)
    cfg = _spo_cfg(rho=0.9, prior_count=3.0, prior_value=0.4, low=-0.5, high=1.5)
    for (ids, rewards), w in zip(steps, want):
        batch = GroupBatch(rewards=torch.tensor(rewards), prompt_ids=torch.tensor(ids), prompt_state=table, step=1)
        got = compute_advantages(batch, cfg).advantages
        torch.testing.assert_close(got.double(), torch.tensor(w, dtype=torch.float64), rtol=1e-6, atol=1e-6)
    for row in alpha:
        assert table["alpha"][row].item() == pytest.approx(alpha[row], rel=1e-12)
        assert table["beta"][row].item() == pytest.approx(beta[row], rel=1e-12)
    assert spo_value(table)[[r for r in range(6) if r not in alpha]].eq(0.5).all()  # never seen: 0.5


def test_spo_without_normalisation_leaves_unscored_samples_out_and_checks_the_range():
    table = PromptTable(2)
    r = torch.tensor([[1.0, float("nan")], [0.0, 0.0]])
    batch = GroupBatch(rewards=r, prompt_ids=torch.tensor([0, 1]), prompt_state=table)
    res = compute_advantages(batch, _spo_cfg(normalize=False, prior_count=2.0, prior_value=0.5))
    assert res.advantages.tolist() == [[0.5, 0.0], [-0.5, -0.5]]
    assert table["alpha"].tolist() == [0.96 * 1 + 1, 0.96 * 1] and table["beta"].tolist() == [0.96, 0.96 + 2]
    assert res.metrics["spo/new_prompts"] == 2 and table["seen"].tolist() == [1, 1]  # observed after the estimator
    with pytest.raises(ValueError, match=r"rewards must lie in \[low, high\]"):
        compute_advantages(GroupBatch(rewards=r + 1, prompt_ids=torch.tensor([0, 1]), prompt_state=table), _spo_cfg())
    with pytest.raises(ValueError, match="high must exceed low"):
        compute_advantages(
            GroupBatch(rewards=r, prompt_ids=torch.tensor([0, 1]), prompt_state=table), _spo_cfg(high=0.0)
        )
    with pytest.raises(ValueError, match="needs GroupBatch.prompt_state"):
        compute_advantages(GroupBatch(rewards=r, prompt_ids=torch.tensor([0, 1])), _spo_cfg())
    with pytest.raises(ValueError, match="prompt_ids: expected shape"):
        GroupBatch(rewards=r, prompt_ids=torch.tensor([0, 1, 2]))
    with pytest.raises(ValueError, match=r"estimator.rho: must be a finite number in \(0, 1\]"):
        _spo_cfg(rho=0.0)


# --- ACE --------------------------------------------------------------------------------------------------------


def test_ace_scales_negative_advantages_by_one_plus_alpha_softplus_of_the_confidence():
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.0, 1.0, 0.0, 0.0]])
    c = torch.tensor([[3.0, -2.0, 40.0, 0.0], [0.5, 1.0, -30.0, 2.0]])
    cfg = AdvantageConfig(estimator="dr_grpo", transforms=[{"name": "ace", "alpha": 0.7, "offset": 0.25}])
    got = compute_advantages(GroupBatch(rewards=r, confidence=c), cfg)
    for p in range(2):
        mean = sum(r[p].tolist()) / 4
        for i in range(4):
            a = r[p, i].item() - mean
            if a < 0:
                a *= 1 + 0.7 * math.log1p(math.exp(c[p, i].item() - 0.25))
            assert got.advantages[p, i].item() == pytest.approx(a, rel=1e-6), (p, i)
    assert got.metrics["ace/penalty_mean"] > 1
    with pytest.raises(ValueError, match="advantage transform 'ace' needs GroupBatch.confidence"):
        compute_advantages(GroupBatch(rewards=r), cfg)
    none_negative = compute_advantages(GroupBatch(rewards=torch.ones(1, 2), confidence=torch.ones(1, 2)), cfg)
    assert none_negative.metrics["ace/penalty_mean"] == 1.0
    step = AdvantageResult(torch.zeros(1, 2, 3), torch.ones(1, 2, 3), "step")
    with pytest.raises(ValueError, match="sample-level"):
        ace(step, GroupBatch(rewards=torch.ones(1, 2), confidence=torch.ones(1, 2)))


# --- the prompt samplers -----------------------------------------------------------------------------------------


def test_spo_priority_is_seeded_without_replacement_and_prefers_uncertain_prompts():
    t = PromptTable(40)
    t["alpha"][:] = 50.0  # v ~ 1: weight ~ 0
    t["beta"][:] = 1e-9
    t["alpha"][[5, 17]] = 1.0  # v = 0.5: the largest weight
    t["beta"][[5, 17]] = 1.0
    a = spo_priority(t, 4, 3, seed=7, floor=1e-6)
    assert a == spo_priority(t, 4, 3, seed=7, floor=1e-6) and len(set(a)) == 4
    assert {5, 17} <= set(a)
    counts = sum(torch.bincount(torch.tensor(spo_priority(t, 2, d, 7, floor=1e-6)), minlength=40) for d in range(30))
    assert counts[5] + counts[17] >= 55  # nearly every draw takes both
    assert sorted(spo_priority(t, 99, 0, 1)) == list(range(40))  # more than the rows: each once
    assert spo_priority(t, 0, 0, 1) == [] and spo_priority(PromptTable(0), 3, 0, 1) == []
    solved = PromptTable(3)
    solved["alpha"][:] = torch.tensor([4.0, 1.0, 0.0])  # v = 1, 0.5, 0
    solved["beta"][:] = torch.tensor([0.0, 1.0, 4.0])
    assert spo_priority(solved, 3, 0, 1, floor=0.0) == [1]  # weight 0 is never drawn
    assert uniform(t, 5, 0, 1) == []
    with pytest.raises(ValueError, match="needs the run's prompt state"):
        spo_priority(None, 2, 0, 1)


def test_replay_serves_medium_prompts_nearest_the_target_within_cooldown_and_reuse_bounds():
    t = PromptTable(6)
    r = torch.tensor([[1.0, 0.0], [1.0, 1.0], [0.0, 1.0], [0.0, 0.0], [1.0, 0.0], [0.25, 0.75]])
    t.observe(torch.arange(6), r, torch.ones_like(r, dtype=torch.bool), step=1)
    t["rate"][4] = 0.8  # farther from 0.5 than rows 0, 2, 5
    assert replay(t, 8, 0, 0, fraction=0.5, cooldown=1) == []  # observed at the latest step: cooling down
    t.observe(torch.tensor([3]), torch.zeros(1, 2), torch.ones(1, 2, dtype=torch.bool), step=2)
    assert replay(t, 6, 0, 0, fraction=0.5, cooldown=1) == [0, 2, 5]  # spread, closest to 0.5, lower row on ties
    assert replay(t, 6, 1, 0, fraction=1.0, cooldown=1) == [4]  # the others were served for this step already
    t.observe(torch.tensor([1]), torch.zeros(1, 2), torch.ones(1, 2, dtype=torch.bool), step=3)
    assert replay(t, 6, 2, 0, fraction=1.0, cooldown=1, max_reuse=1) == []  # each used once
    assert replay(t, 6, 2, 0, fraction=1.0, cooldown=1, max_reuse=2) == [0, 2, 5, 4]
    assert replay(t, 1, 3, 0, fraction=0.5) == []  # floor(0.5 * 1) = 0
    assert t["replays"].tolist() == [2, 0, 2, 0, 2, 2]


def test_build_and_policy_only_where_a_part_reads_the_state():
    assert build_prompt_state(4, "grpo", "uniform") is None
    assert isinstance(build_prompt_state(4, "spo", "uniform"), PromptTable)
    assert isinstance(build_prompt_state(4, "grpo", "replay"), PromptTable)
    with pytest.raises(ValueError, match="unknown prompt sampler 'spoo'"):
        build_prompt_state(4, "grpo", "spoo")
    assert prompt_policy(None, "uniform", {}, 0) is None
    with pytest.raises(ValueError, match="has no setting 'flor'"):
        prompt_policy(PromptTable(3), "spo", {"flor": 1}, 0)
    with pytest.raises(ValueError, match="needs the run's prompt state"):
        prompt_policy(None, "replay", {}, 0)
    hook = prompt_policy(PromptTable(3), "spo", {"floor": 0.1}, 5)
    assert hook is not None and hook(2, 0) == spo_priority(PromptTable(3), 2, 0, 5, floor=0.1)
    assert sorted(PROMPT_SAMPLERS.names()) == ["ban_saturated", "knapsack", "replay", "spo", "uniform"]


def test_prompt_order_takes_the_policy_rows_then_fills_from_its_permutation():
    plain = PromptSampler(10, seed=3)
    assert "draws" not in plain.state_dict()
    hooked = PromptSampler(10, seed=3, policy=lambda n, draw: [9, draw][: n // 2])
    assert hooked.next(4) == [9, 0, *PromptSampler(10, seed=3).next(2)]
    assert hooked.next(4)[:2] == [9, 1] and hooked.state_dict()["draws"] == 2
    again = PromptSampler(10, seed=3, policy=lambda n, draw: [draw])
    again.load_state_dict(hooked.state_dict())
    assert again.draws == 2 and again.next(1) == [2]
    again.load_state_dict(plain.state_dict())  # a state saved without a policy: draw 0
    assert again.draws == 0


def test_an_offline_prior_starts_the_tracker_and_ranks_unseen_prompts():
    prior = torch.tensor([0.9, math.nan, 0.0], dtype=torch.float64)
    table = build_prompt_state(3, "spo", "uniform", prior=prior)
    assert table is not None and torch.equal(spo_value(table), torch.tensor([0.9, 0.5, 0.0], dtype=torch.float64))
    r = torch.tensor([[1.0], [1.0], [0.0]])
    batch = GroupBatch(rewards=r, prompt_ids=torch.arange(3), prompt_state=table)
    res = compute_advantages(batch, _spo_cfg(normalize=False, prior_count=4.0, prior_value=0.25))
    assert res.advantages.flatten().tolist() == pytest.approx([0.1, 0.75, 0.0])  # r - p0 (NaN: prior_value)
    want_alpha = [0.96 * 4 * 0.9 + 1, 0.96 * 4 * 0.25 + 1, 0.0]
    want_beta = [0.96 * 4 * 0.1, 0.96 * 4 * 0.75, 0.96 * 4 + 1]
    assert table["alpha"].tolist() == pytest.approx(want_alpha, rel=1e-15)
    assert table["beta"].tolist() == pytest.approx(want_beta, rel=1e-15)
    ranked = build_prompt_state(3, "grpo", "spo", prior=prior)
    assert sorted(spo_priority(ranked, 3, 0, 1, floor=0.0)) == [0, 1]  # prior 0: weight 0, never drawn
    with pytest.raises(ValueError, match="success rates in"):
        PromptTable(3, torch.tensor([0.5, 1.5, 0.0]))
    with pytest.raises(ValueError, match="read by the estimators"):
        build_prompt_state(3, "grpo", "uniform", prior=prior)
