"""Sample-level advantage estimators against independent loop formulas, and the invariants every
group-relative estimator keeps (each its own test)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from _coreref import (
    FEW,
    SETTINGS,
    np64,
    random_rewards,
    ref_a_grae,
    ref_batch_whiten,
    ref_dgpo,
    ref_gdpo,
    ref_group_z,
    ref_grpo,
    ref_mc_grpo,
    ref_ngrpo,
    ref_rloo,
    ref_scalar,
    ref_sign_reinforce,
    ref_win_rates,
    t32,
    tb,
)
from flowgrpo.core import ESTIMATORS, AdvantageConfig, GroupBatch, compute_advantages

SAMPLE_ESTIMATORS = [
    "grpo",
    "dr_grpo",
    "rloo",
    "batch_whiten",
    "mc_grpo",
    "ngrpo",
    "dgpo",
    "a_grae",
    "w_reinforce",
    "nsr",
    "psr",
    "gdpo",
]


def run(r, valid=None, estimator="grpo", **settings):
    batch = GroupBatch(rewards=t32(r), valid=None if valid is None else tb(valid))
    return compute_advantages(batch, AdvantageConfig(estimator={"name": estimator, **settings}))


def close(actual, expected, rtol=1e-4, atol=1e-4):
    np.testing.assert_allclose(
        np64(actual) if isinstance(actual, torch.Tensor) else actual, expected, rtol=rtol, atol=atol
    )


dims = dict(
    seed=st.integers(0, 2**31 - 1),
    P=st.integers(1, 4),
    G=st.integers(2, 9),
    nan=st.sampled_from([0.0, 0.2]),
    invalid=st.sampled_from([0.0, 0.25]),
)


# --- every estimator vs. its formula on random inputs ------------------------------------------


@SETTINGS
@given(
    kind=st.sampled_from(["normal", "binary"]),
    eps=st.sampled_from([1e-4, 1e-6]),
    unbiased=st.booleans(),
    scope=st.sampled_from(["group", "batch", "none"]),
    **dims,
)
def test_grpo_formula(seed, P, G, nan, invalid, kind, eps, unbiased, scope):
    r, valid = random_rewards(np.random.default_rng(seed), P, G, kind, nan, invalid)
    out = run(r, valid, "grpo", eps=eps, unbiased=unbiased, std_scope=scope)
    close(out.advantages, ref_grpo(r, valid, eps, unbiased, scope), rtol=1e-3, atol=1e-3 if kind == "normal" else 1e-4)
    close(out.sample_weight, valid.astype(float))
    assert out.level == "sample"


@SETTINGS
@given(**dims)
def test_dr_grpo_formula(seed, P, G, nan, invalid):
    r, valid = random_rewards(np.random.default_rng(seed), P, G, "normal", nan, invalid)
    close(run(r, valid, "dr_grpo").advantages, ref_grpo(r, valid, scope="none"), atol=1e-5)


@SETTINGS
@given(**dims)
def test_rloo_formula(seed, P, G, nan, invalid):
    r, valid = random_rewards(np.random.default_rng(seed), P, G, "normal", nan, invalid)
    close(run(r, valid, "rloo").advantages, ref_rloo(r, valid), atol=1e-5)


@SETTINGS
@given(**dims)
def test_batch_whiten_formula(seed, P, G, nan, invalid):
    r, valid = random_rewards(np.random.default_rng(seed), P, G, "normal", nan, invalid)
    close(run(r, valid, "batch_whiten").advantages, ref_batch_whiten(r, valid), rtol=1e-3, atol=1e-3)


@SETTINGS
@given(rescale=st.booleans(), floor=st.sampled_from([1e-3, 0.1]), **dims)
def test_mc_grpo_formula(seed, P, G, nan, invalid, rescale, floor):
    r, valid = random_rewards(np.random.default_rng(seed), P, G + 1, "normal", nan, invalid)
    out = run(r, valid, "mc_grpo", nonzero_rescale=rescale, mad_floor=floor)
    adv, weight = ref_mc_grpo(r, valid, floor, rescale)
    close(out.advantages, adv, rtol=1e-3, atol=1e-3)
    close(out.sample_weight, weight)


@SETTINGS
@given(max_reward=st.sampled_from([1.0, 2.0]), num_virtual=st.integers(1, 3), **dims)
def test_ngrpo_formula(seed, P, G, nan, invalid, max_reward, num_virtual):
    r, valid = random_rewards(np.random.default_rng(seed), P, G, "binary", nan, invalid)
    out = run(r, valid, "ngrpo", max_reward=max_reward, num_virtual=num_virtual)
    close(out.advantages, ref_ngrpo(r, valid, max_reward, num_virtual), atol=1e-4)


@SETTINGS
@given(kind=st.sampled_from(["binary", "unit"]), qw=st.booleans(), temp=st.sampled_from([2.0, 0.5]), **dims)
def test_dgpo_formula(seed, P, G, nan, invalid, kind, qw, temp):
    r, valid = random_rewards(np.random.default_rng(seed), P, G, kind, nan, invalid)
    out = run(r, valid, "dgpo", question_weights=qw, temperature=temp)
    close(out.advantages, ref_dgpo(r, valid, question_weights=qw, temperature=temp), rtol=1e-3, atol=1e-4)


@SETTINGS
@given(alpha=st.sampled_from([1.0, 0.5]), **dims)
def test_a_grae_formula(seed, P, G, nan, invalid, alpha):
    r, valid = random_rewards(np.random.default_rng(seed), P, G, "binary", nan, invalid)
    out = run(r, valid, "a_grae", alpha=alpha)
    close(out.advantages, ref_a_grae(r, valid, alpha), rtol=1e-3, atol=1e-3)
    has = [p for p in range(P) if any(valid[p, g] and np.isfinite(r[p, g]) for g in range(G))]
    acc = [np.nanmean(np.where(valid[p], r[p], np.nan)) for p in has]
    assert out.metrics["a_grae/batch_accuracy"] == pytest.approx(float(np.mean(acc)) if acc else 0.0, abs=1e-6)


@SETTINGS
@given(lam=st.sampled_from([0.1, 0.5]), **dims)
def test_sign_asymmetric_reinforce_formulas(seed, P, G, nan, invalid, lam):
    r, valid = random_rewards(np.random.default_rng(seed), P, G, "binary", nan, invalid)
    close(run(r, valid, "w_reinforce", positive_weight=lam).advantages, ref_sign_reinforce(r, valid, lam), atol=1e-6)
    close(run(r, valid, "nsr").advantages, ref_sign_reinforce(r, valid, 0.0), atol=1e-6)
    psr = np.where(valid & np.isfinite(r), r, 0.0)
    close(run(r, valid, "psr").advantages, psr, atol=1e-6)


def test_w_reinforce_values_on_binary_rewards():
    """W-REINFORCE: A = lambda (0.1) for a correct sample, -1 for a wrong one; NSR: 0 / -1; PSR: 1 / 0."""
    r = [[1.0, 0.0, 1.0, 0.0]]
    close(run(r, None, "w_reinforce").advantages, [[0.1, -1.0, 0.1, -1.0]], atol=1e-7)
    close(run(r, None, "nsr").advantages, [[0.0, -1.0, 0.0, -1.0]], atol=1e-7)
    close(run(r, None, "psr").advantages, [[1.0, 0.0, 1.0, 0.0]], atol=1e-7)


@SETTINGS
@given(K=st.integers(1, 3), policy=st.sampled_from(["propagate", "ignore_head"]), unbiased=st.booleans(), **dims)
def test_gdpo_formula(seed, P, G, nan, invalid, K, policy, unbiased):
    rng = np.random.default_rng(seed)
    heads, valid = random_rewards(rng, P, G, "normal", nan, invalid, K=K)
    weights = rng.uniform(0.2, 2.0, size=K).astype(np.float32).astype(np.float64)
    batch = GroupBatch(rewards=t32(heads), valid=tb(valid), reward_weights=t32(weights))
    out = compute_advantages(
        batch, AdvantageConfig(estimator={"name": "gdpo", "unbiased": unbiased}, head_nan_policy=policy)
    )
    close(out.advantages, ref_gdpo(heads, valid, weights, unbiased=unbiased, policy=policy), rtol=1e-3, atol=1e-3)


@SETTINGS
@given(nan_pairs=st.integers(0, 3), **dims)
def test_win_rate_formula(seed, P, G, nan, invalid, nan_pairs):
    rng = np.random.default_rng(seed)
    pref = rng.uniform(size=(P, G, G))
    pref = np.where(rng.uniform(size=pref.shape) < 0.3, np.round(pref * 2) / 2, pref)  # some ties / certain verdicts
    for _ in range(nan_pairs):
        p, i, j = rng.integers(P), rng.integers(G), rng.integers(G)
        pref[p, i, j] = np.nan
    _, valid = random_rewards(rng, P, G, "normal", 0.0, invalid)
    pref = pref.astype(np.float32).astype(np.float64)
    batch = GroupBatch(preferences=t32(pref), valid=tb(valid))
    out = compute_advantages(batch, AdvantageConfig(estimator="win_rate"))
    rates = ref_win_rates(pref, valid)
    close(out.advantages, ref_group_z(rates, 1e-8, True), rtol=1e-3, atol=2e-3)
    live = np.isfinite(rates)
    assert out.metrics["win_rate/mean"] == pytest.approx(rates[live].mean() if live.any() else 0.0, abs=1e-5)
    unreadable = sum(
        1
        for p in range(P)
        for i in range(G)
        for j in range(G)
        if i != j and valid[p, i] and valid[p, j] and math.isnan(pref[p, i, j])
    )
    assert out.metrics["win_rate/unreadable_pairs"] == unreadable / 2


def test_every_estimator_has_a_formula_test():
    tested = set(SAMPLE_ESTIMATORS) | {"win_rate", "sibling", "turning_point", "value_anchored", "tree_depth"}
    tested |= {"rec", "canon", "stratified_grpo"}  # test_core_offpolicy.py, test_core_conditional.py
    tested |= {"spo"}  # test_core_prompt_state.py
    tested |= {"real", "rover", "egae", "spae"}  # test_core_{real,rover,egae,spae}.py
    assert set(ESTIMATORS.names()) == tested


# --- invariants, one test each --------------------- --------------------------------------


@SETTINGS
@given(**dims)
def test_invariant_grpo_without_std_equals_dr_grpo(seed, P, G, nan, invalid):
    r, valid = random_rewards(np.random.default_rng(seed), P, G, "normal", nan, invalid)
    a = run(r, valid, "grpo", std_scope="none").advantages
    b = run(r, valid, "dr_grpo").advantages
    assert torch.equal(a, b)
    close(a, ref_grpo(r, valid, scope="none"), atol=1e-5)


CONSTANT_OK = ["grpo", "dr_grpo", "rloo", "batch_whiten", "mc_grpo", "dgpo", "a_grae", "gdpo"]


@pytest.mark.parametrize("estimator", CONSTANT_OK)
@pytest.mark.parametrize("value", [0.0, 1.0, 0.7, 0.1, 22.3])
@pytest.mark.parametrize("G", [3, 7, 24])
def test_invariant_constant_group_gives_zero_advantage(estimator, value, G):
    """A constant group next to a non-constant one: its advantages are 0 (not float noise)."""
    rng = np.random.default_rng(G)
    other = np.clip(rng.uniform(0, 1, size=G), 0, 1) if value <= 1 else rng.normal(20, 2, size=G)
    r = np.stack([np.full(G, value), other]).astype(np.float32).astype(np.float64)
    out = run(r, None, estimator)
    assert np.abs(np64(out.advantages[0])).max() <= 1e-6, np64(out.advantages[0])
    assert np.abs(np64(out.advantages[1])).max() > 0.01  # the other group does train


@pytest.mark.parametrize("value", [0.7, 22.3, 1.0])
def test_invariant_constant_group_is_filtered_and_counted(value):
    """filter_zero_std (tol 0) must drop a constant group and zero_std_frac must count it."""
    r = [[value] * 7, [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.9]]
    cfg = AdvantageConfig(estimator="grpo", transforms=["filter_zero_std"])
    out = compute_advantages(GroupBatch(rewards=t32(r)), cfg)
    assert out.metrics["adv/filtered_groups"] == 1.0
    assert out.metrics["zero_std_frac"] == 0.5
    close(out.sample_weight, [[0.0] * 7, [1.0] * 7])


NAN_ESTIMATORS = [
    "grpo",
    "dr_grpo",
    "rloo",
    "batch_whiten",
    "mc_grpo",
    "ngrpo",
    "dgpo",
    "a_grae",
    "gdpo",
    "w_reinforce",
    "nsr",
    "psr",
]


@pytest.mark.parametrize("estimator", NAN_ESTIMATORS)
@FEW
@given(seed=st.integers(0, 2**31 - 1), G=st.integers(3, 8), n_nan=st.integers(1, 2))
def test_invariant_nan_reward_is_left_out_and_gets_zero(estimator, seed, G, n_nan):
    """A NaN reward does not move the group statistics (same result as without that sample),
    gets advantage 0, and is counted in rewards/nan_count."""
    rng = np.random.default_rng(seed)
    kind = "binary" if estimator in ("w_reinforce", "nsr", "psr", "ngrpo", "a_grae") else "unit"
    r, _ = random_rewards(rng, 2, G + 1 if estimator == "mc_grpo" else G, kind)
    cols = rng.choice(r.shape[1], size=n_nan, replace=False)
    with_nan = r.copy()
    with_nan[0, cols] = np.nan
    keep = [g for g in range(r.shape[1]) if g not in cols]
    out = run(with_nan, None, estimator)
    # the same batch where the NaN samples are padding at the end instead
    packed = np.concatenate([r[0, keep], np.full(n_nan, 123.0)])
    valid = np.ones((2, r.shape[1]), dtype=bool)
    valid[0, len(keep) :] = False
    ref = run(np.stack([packed, r[1]]), valid, estimator)
    close(out.advantages[0, keep], np64(ref.advantages[0, : len(keep)]), rtol=1e-5, atol=1e-6)
    close(out.advantages[1], np64(ref.advantages[1]), rtol=1e-5, atol=1e-6)
    assert np.all(np64(out.advantages[0, cols]) == 0.0)
    assert out.metrics["rewards/nan_count"] == float(n_nan)
    assert ref.metrics["rewards/nan_count"] == 0.0  # padding is not a NaN reward


def test_invariant_nan_does_not_move_group_mean_dr_grpo():
    r = [[1.0, float("nan"), 3.0, 5.0]]
    out = run(r, None, "dr_grpo")
    close(out.advantages, [[-2.0, 0.0, 0.0, 2.0]], atol=1e-6)
    assert out.metrics["rewards/nan_count"] == 1.0
    assert out.metrics["reward_mean"] == pytest.approx(3.0)


RAGGED = [
    "grpo",
    "dr_grpo",
    "rloo",
    "batch_whiten",
    "mc_grpo",
    "ngrpo",
    "dgpo",
    "a_grae",
    "gdpo",
    "w_reinforce",
    "nsr",
    "psr",
    "win_rate",
]


@pytest.mark.parametrize("estimator", RAGGED)
@FEW
@given(
    seed=st.integers(0, 2**31 - 1),
    G=st.integers(3, 8),
    pad=st.integers(1, 3),
    garbage=st.sampled_from([float("nan"), 1e6, -3.0]),
)
def test_invariant_ragged_group_behaves_like_smaller_group(estimator, seed, G, pad, garbage):
    rng = np.random.default_rng(seed)
    kind = "binary" if estimator in ("w_reinforce", "nsr", "psr", "ngrpo", "a_grae") else "unit"
    r, _ = random_rewards(rng, 1, G, kind)
    pref = rng.uniform(size=(1, G, G))
    big_r = np.concatenate([r, np.full((1, pad), garbage)], axis=1)
    big_pref = np.full((1, G + pad, G + pad), garbage)
    big_pref[:, :G, :G] = pref
    valid = np.ones((1, G + pad), dtype=bool)
    valid[0, G:] = False
    if estimator == "win_rate":
        small = GroupBatch(preferences=t32(pref))
        big = GroupBatch(preferences=t32(big_pref), valid=tb(valid))
    else:
        small = GroupBatch(rewards=t32(r))
        big = GroupBatch(rewards=t32(big_r), valid=tb(valid))
    cfg = AdvantageConfig(estimator=estimator)
    a, b = compute_advantages(small, cfg), compute_advantages(big, cfg)
    # float32 sums in another order: a value near 0 after the mean is taken and the std divided keeps ~1e-6 of the
    # inputs' rounding (win_rate, seed 2542417: 1.5e-6); a masking fault is off by O(0.1)
    close(b.advantages[:, :G], np64(a.advantages), rtol=1e-5, atol=1e-5)
    close(b.sample_weight[:, :G], np64(a.sample_weight), atol=0)
    assert np.all(np64(b.advantages[:, G:]) == 0) and np.all(np64(b.sample_weight[:, G:]) == 0)


@FEW
@given(seed=st.integers(0, 2**31 - 1))
def test_invariant_ragged_groups_per_group_estimators_in_one_batch(seed):
    """Groups of sizes 5, 3 and 8 in one padded batch: each equals its own unpadded run."""
    rng = np.random.default_rng(seed)
    sizes = [5, 3, 8]
    groups = [rng.uniform(size=n).astype(np.float32).astype(np.float64) for n in sizes]
    r = np.full((3, 8), np.nan)
    valid = np.zeros((3, 8), dtype=bool)
    for p, g in enumerate(groups):
        r[p, : len(g)] = g
        valid[p, : len(g)] = True
    for est in ["grpo", "rloo", "mc_grpo", "ngrpo", "dr_grpo"]:
        out = run(r, valid, est)
        for p, g in enumerate(groups):
            alone = run(g[None], None, est)
            close(out.advantages[p, : len(g)], np64(alone.advantages[0]), rtol=1e-5, atol=1e-6)
        assert out.metrics["rewards/nan_count"] == 0.0


@pytest.mark.parametrize("G", [3, 5, 9])
def test_invariant_mc_grpo_pivot_has_zero_weight_and_advantage(G):
    rng = np.random.default_rng(G)
    for kind in ["normal", "binary"]:
        r, _ = random_rewards(rng, 4, G, kind)
        out = run(r, None, "mc_grpo")
        adv, w = np64(out.advantages), np64(out.sample_weight)
        for p in range(4):
            pivots = np.nonzero(w[p] == 0)[0]
            assert len(pivots) == 1
            assert adv[p, pivots[0]] == 0.0
            assert r[p, pivots[0]] == sorted(r[p])[(G - 1) // 2]  # the pivot is the median sample
        # G contributing samples out of G + 1 (weights), as in the paper
        assert w.sum() == 4 * (G - 1)


def test_invariant_ngrpo_all_zero_group_of_eight():
    out = run([[0.0] * 8, [1.0, 0, 0, 0, 1, 1, 0, 1]], None, "ngrpo")
    close(out.advantages[0], [-1.0 / 3.0] * 8, rtol=1e-5, atol=1e-5)
    # mu' = 1/9, sigma' = 1/3 exactly (NGRPO's example: G = 8 all-wrong gives A = -1/3; nangongrui-ngr/NGRPO)
    assert float(out.advantages[0, 0]) == pytest.approx((0 - 1 / 9) / (1 / 3 + 1e-6), rel=1e-6)


@SETTINGS
@given(
    seed=st.integers(0, 2**31 - 1), P=st.integers(1, 5), G=st.integers(2, 10), kind=st.sampled_from(["binary", "unit"])
)
def test_invariant_dgpo_abs_sum_is_group_size(seed, P, G, kind):
    r, _ = random_rewards(np.random.default_rng(seed), P, G, kind)
    adv = np64(run(r, None, "dgpo", question_weights=False).advantages)
    for p in range(P):
        spread = np.abs(r[p] - r[p].mean()).sum()
        if spread > 1e-3:
            assert np.abs(adv[p]).sum() == pytest.approx(G * spread / (spread + 1e-4), rel=1e-4)
            if spread > 0.5:  # the eps of the denominator is negligible
                assert np.abs(adv[p]).sum() == pytest.approx(G, rel=1e-3)
        elif spread == 0:
            assert np.abs(adv[p]).sum() == 0.0


def test_dgpo_question_weights_average_one_and_favour_hard_groups():
    r = [[1.0, 1, 1, 0], [1.0, 0, 0, 0], [1.0, 1, 1, 1]]  # easy, hard, degenerate
    out = run(r, None, "dgpo")
    base = np64(run(r, None, "dgpo", question_weights=False).advantages)
    adv = np64(out.advantages)
    w = [adv[p, 0] / base[p, 0] for p in range(2)]
    assert sum(w) == pytest.approx(2.0, rel=1e-5)  # |V| * softmax: average 1 over live groups
    assert w[1] > w[0]
    assert w[1] / w[0] == pytest.approx(math.exp((0.75 - 0.25) / 2.0), rel=1e-5)
    assert np.all(adv[2] == 0)
    assert out.metrics["dgpo/weight_max"] == pytest.approx(max(w), rel=1e-5)


@SETTINGS
@given(seed=st.integers(0, 2**31 - 1), P=st.integers(1, 5), G=st.integers(2, 9), nan=st.sampled_from([0.0, 0.2]))
def test_invariant_gdpo_one_reward_is_group_then_batch_zscore(seed, P, G, nan):
    r, valid = random_rewards(np.random.default_rng(seed), P, G, "normal", nan, 0.0)
    group = ref_group_z(np.where(valid, r, np.nan), 1e-4, True)
    usable = valid & np.isfinite(r)
    flat = group[usable]
    mean = flat.mean() if len(flat) else 0.0
    sd = np.std(flat, ddof=1) if len(flat) > 1 else 0.0
    expected = np.where(usable, (group - mean) / (sd + 1e-4), 0)
    close(run(r, valid, "gdpo").advantages, expected, rtol=1e-3, atol=1e-3)


@SETTINGS
@given(seed=st.integers(0, 2**31 - 1), P=st.integers(1, 4), G=st.integers(2, 9))
def test_invariant_win_rates_sum_to_half_group(seed, P, G):
    """With P[i,j] + P[j,i] = 1 the win rates of a group sum to G/2 (mean 1/2)."""
    rng = np.random.default_rng(seed)
    pref = rng.uniform(size=(P, G, G))
    pref = np.triu(pref, 1) + np.tril(1 - pref.transpose(0, 2, 1), -1)
    batch = GroupBatch(preferences=t32(pref))
    out = compute_advantages(batch, AdvantageConfig(estimator="win_rate"))
    rates = ref_win_rates(pref, np.ones((P, G), dtype=bool))
    np.testing.assert_allclose(rates.sum(1), G / 2)
    assert out.metrics["win_rate/mean"] == pytest.approx(0.5, abs=1e-6)
    close(out.advantages, ref_group_z(rates, 1e-8, True), rtol=1e-3, atol=1e-3)


def test_invariant_win_rate_nan_verdict_counts_half():
    """Sample 0 beats 1 surely, its verdict against 2 is unreadable (NaN): w_0 = (1 + 0.5) / 2."""
    nan = float("nan")
    pref = [[[nan, 1.0, nan], [0.0, nan, 1.0], [nan, 0.0, nan]]]
    out = compute_advantages(GroupBatch(preferences=t32(pref)), AdvantageConfig(estimator="win_rate"))
    rates = np.array([(1 + 0.5) / 2, (0 + 1) / 2, (0.5 + 0) / 2])
    close(out.advantages[0], (rates - rates.mean()) / (rates.std(ddof=1) + 1e-8), rtol=1e-5, atol=1e-5)
    assert out.metrics["win_rate/unreadable_pairs"] == 1.0
    # the same verdict given as 0.5 on both sides is identical
    half = [[[nan, 1.0, 0.5], [0.0, nan, 1.0], [0.5, 0.0, nan]]]
    same = compute_advantages(GroupBatch(preferences=t32(half)), AdvantageConfig(estimator="win_rate"))
    assert torch.allclose(out.advantages, same.advantages)


# --- helpers of the contract ------------------------------------------------------------------


@SETTINGS
@given(seed=st.integers(0, 2**31 - 1), K=st.integers(1, 3), policy=st.sampled_from(["propagate", "ignore_head"]))
def test_scalar_rewards_nan_policies(seed, K, policy):
    rng = np.random.default_rng(seed)
    heads, _ = random_rewards(rng, 3, 5, "normal", 0.3, 0.0, K=K)
    w = rng.uniform(0.5, 2, size=K).astype(np.float32).astype(np.float64)
    batch = GroupBatch(rewards=t32(heads), reward_weights=w.tolist(), head_nan_policy=policy)
    got = np64(batch.scalar_rewards())
    ref = ref_scalar(heads if heads.ndim == 3 else heads[..., None], w, policy)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(ref))
    np.testing.assert_allclose(got[~np.isnan(got)], ref[~np.isnan(ref)], rtol=1e-5, atol=1e-6)


def test_reward_metrics_per_head_and_counts():
    heads = np.array([[[1.0, 0.0], [3.0, np.nan], [5.0, 2.0]]])
    batch = GroupBatch(
        rewards=t32(heads),
        reward_names=["acc", "fmt"],
        step_rewards=t32([[[1.0, np.nan], [0.0, 1.0], [np.nan, np.nan]]]),
    )
    m = compute_advantages(batch).metrics
    assert m["rewards/acc/mean"] == pytest.approx(3.0)
    assert m["rewards/acc/std"] == pytest.approx(np.std([1, 3, 5]))
    assert m["rewards/fmt/mean"] == pytest.approx(1.0)
    assert m["reward_mean"] == pytest.approx((1 + 7) / 2)
    assert m["rewards/nan_count"] == 1.0
    assert m["rewards/step_nan_count"] == 3.0
    assert m["adv/num_live"] == 3.0 and m["adv/num_positive"] == 1.0 and m["adv/num_negative"] == 1.0
    # a batch where nothing is usable reports NaN means and no live advantages
    empty = compute_advantages(
        GroupBatch(rewards=t32([[np.nan, np.nan]]), valid=tb([[True, False]])),
        AdvantageConfig(transforms=["filter_zero_std"]),
    )
    assert math.isnan(empty.metrics["reward_mean"]) and math.isnan(empty.metrics["rewards/reward/mean"])
    assert empty.metrics["adv/num_live"] == 0.0


def test_grpo_rejects_unknown_std_scope():
    with pytest.raises(ValueError, match="std_scope"):
        run([[1.0, 2.0]], None, "grpo", std_scope="global")


def test_group_of_one_and_all_padding_give_zero():
    r = [[1.0, np.nan, np.nan], [np.nan, np.nan, np.nan]]
    for est in ["grpo", "rloo", "batch_whiten", "mc_grpo", "dgpo", "gdpo"]:
        out = run(r, None, est)
        assert np.all(np64(out.advantages) == 0), est
