"""CANON and Stratified GRPO against float64 re-derivations of their source code, as plain loops:
biuboomc/CANON @ 7d6f814 verl/trainer/ppo/core_algos.py (`compute_dr_length_on_mean_group_outcome_advantage`,
`compute_dr_entropy_per_token_group_outcome_advantage`, the cosine-restart and `annel` variants,
`cosine_annealing_with_restart`) and Wodlfvllf/grpo-composer @ 2c98d7e stratified.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from _coreref import np64, random_rewards, t32, tb
from flowgrpo.core import PRESETS, AdvantageConfig, GroupBatch, LossConfig
from flowgrpo.core.conditional import canon, cosine_restart, reads_entropy
from flowgrpo.core.stages import compute_advantages


def source_cosine_restart(epoch, total_epochs, max_lr, min_lr, warmup_epochs, cycles=3):
    if epoch < warmup_epochs:
        return max_lr * (epoch + 1) / warmup_epochs
    epoch -= warmup_epochs
    total_epochs -= warmup_epochs
    cycle_length = total_epochs // cycles
    return min_lr + 0.5 * (max_lr - min_lr) * (1 + np.cos(np.pi * (epoch % cycle_length) / cycle_length))


def source_canon(r, valid, key, metric, lam, alpha=1.0, beta=0.0, max_length=8192.0):
    """One group at a time over its usable samples: sort by the metric (stable), low half = the first n // 2."""
    P, G = r.shape
    out = np.zeros((P, G))
    for p in range(P):
        idx = [g for g in range(G) if valid[p, g] and np.isfinite(r[p, g])]
        if len(idx) < 2:
            continue
        paired = sorted(zip([key[p, g] for g in idx], [r[p, g] for g in idx], idx), key=lambda x: x[0])
        mid = len(paired) // 2
        short = [s for _, s, _ in paired[:mid]]
        long_ = [s for _, s, _ in paired[mid:]]
        is_long = {i: k >= mid for k, (_, _, i) in enumerate(paired)}
        m_s, m_l = float(np.mean(short)), float(np.mean(long_))
        for g in idx:
            s = r[p, g]
            if metric == "length":
                if is_long[g]:
                    a = lam * (alpha * s - m_s + beta) + (1 - lam) * (s - m_l)
                else:
                    a = lam * (s - alpha * m_l - beta) + (1 - lam) * (s - m_s)
            else:
                if is_long[g]:
                    a = lam * (s - alpha * m_s + beta) + (1 - lam) * (s - m_l)
                else:
                    a = lam * (alpha * s - m_l - beta) + (1 - lam) * (s - m_s)
            out[p, g] = a / max_length
    return out


def canon_batch(seed=3, P=10, G=8, kind="binary", step=None):
    rng = np.random.default_rng(seed)
    r, valid = random_rewards(rng, P, G, kind=kind, nan_frac=0.1, invalid_frac=0.1)
    ent = rng.uniform(0, 2, size=(P, G)).astype(np.float32).astype(np.float64)
    ent[0, :4] = 0.5  # ties: the stable sort keeps group order
    lengths = rng.integers(1, 20, size=(P, G)).astype(np.float64)
    batch = GroupBatch(rewards=t32(r), valid=tb(valid), entropy=t32(ent), lengths=t32(lengths), step=step)
    return batch, r, valid, ent, lengths


@pytest.mark.parametrize("metric", ["entropy", "length"])
@pytest.mark.parametrize("lam,alpha,beta", [(1.0, 1.0, 0.0), (0.3, 1.5, 0.2), (0.0, 0.7, -0.1)])
@pytest.mark.parametrize("kind", ["binary", "normal"])
def test_canon_matches_the_source(metric, lam, alpha, beta, kind):
    batch, r, valid, ent, lengths = canon_batch(kind=kind)
    settings = {"metric": metric, "lam": lam, "alpha": alpha, "beta": beta, "max_length": 16.0}
    res = compute_advantages(batch, AdvantageConfig(estimator={"name": "canon", **settings}))
    want = source_canon(r, valid, ent if metric == "entropy" else lengths, metric, lam, alpha, beta, 16.0)
    np.testing.assert_allclose(np64(res.advantages), want, rtol=1e-5, atol=1e-6)
    assert np.abs(want).max() > 0.01  # non-trivial


def test_canon_half_and_half_is_dr_grpo_over_max_length():
    """lambda 0.5, alpha 1, beta 0, even groups: [(r - m_other) + (r - m_own)] / 2 = r - group mean."""
    rng = np.random.default_rng(4)
    r = rng.normal(size=(5, 6)).astype(np.float32).astype(np.float64)
    batch = GroupBatch(rewards=t32(r), entropy=t32(rng.uniform(size=(5, 6))))
    res = compute_advantages(batch, AdvantageConfig(estimator={"name": "canon", "lam": 0.5, "max_length": 4.0}))
    np.testing.assert_allclose(np64(res.advantages), (r - r.mean(1, keepdims=True)) / 4.0, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("step", [1, 17, 30, 31, 55, 70, 71, 149, 150, 400])
def test_cosine_restart_matches_the_source(step):
    for high, low in [(0.6, 0.0), (1.0, 0.4)]:
        got = cosine_restart(step, high=high, low=low, warmup=30, total=150, cycles=3)
        assert got == pytest.approx(source_canon_schedule := source_cosine_restart(step, 150, high, low, 30))
        assert (0 if step < 30 else low) - 1e-12 <= source_canon_schedule <= high + 1e-12  # warm-up from 0


@pytest.mark.parametrize("variant", ["cosine_restart", "cosine_restart_r", "annel"])
def test_scheduled_canon_matches_the_source(variant):
    """Source variants: intra weight = cos(0.6 -> 0) ("cosine_restart"), inter weight = cos(1 -> 0.4) ("_r"),
    inter weight = the batch's mean reward ("annel"); alpha 1, beta 0."""
    step = 42
    batch, r, valid, ent, _ = canon_batch(step=step)
    if variant == "cosine_restart":
        settings = {"schedule": "cosine_restart", "scheduled": "intra"}
        lam = 1 - source_cosine_restart(step, 150, 0.6, 0.0, 30)
    elif variant == "cosine_restart_r":
        settings = {"schedule": "cosine_restart", "scheduled": "inter", "sched_high": 1.0, "sched_low": 0.4}
        lam = source_cosine_restart(step, 150, 1.0, 0.4, 30)
    else:
        settings = {"schedule": "batch_accuracy"}
        lam = float(r[valid & np.isfinite(r)].mean())
    res = compute_advantages(batch, AdvantageConfig(estimator={"name": "canon", **settings}))
    assert res.metrics["canon/inter_weight"] == pytest.approx(lam, rel=1e-6)
    np.testing.assert_allclose(np64(res.advantages), source_canon(r, valid, ent, "entropy", lam), rtol=1e-5, atol=1e-9)


def test_canon_errors_and_edge_cases():
    r = torch.tensor([[1.0, 0.0, 1.0], [1.0, float("nan"), float("nan")]])
    with pytest.raises(ValueError, match="GroupBatch.entropy"):
        canon(GroupBatch(rewards=r))
    with pytest.raises(ValueError, match="GroupBatch.step"):
        canon(GroupBatch(rewards=r, entropy=torch.zeros(2, 3)), schedule="cosine_restart")
    with pytest.raises(ValueError, match="metric"):
        canon(GroupBatch(rewards=r, lengths=torch.ones(2, 3)), metric="perplexity")
    with pytest.raises(ValueError, match="schedule"):
        canon(GroupBatch(rewards=r, entropy=torch.zeros(2, 3)), schedule="linear")
    out = canon(GroupBatch(rewards=r, entropy=torch.zeros(2, 3)), max_length=1.0)
    assert out.advantages[1].abs().sum() == 0  # one usable sample: nothing to compare with
    empty = canon(
        GroupBatch(rewards=torch.full((1, 2), float("nan")), entropy=torch.zeros(1, 2)), schedule="batch_accuracy"
    )
    assert empty.metrics["canon/inter_weight"] == 0.0
    assert (
        reads_entropy("canon", {})
        and not reads_entropy("canon", {"metric": "length"})
        and not reads_entropy("grpo", {})
    )


def test_canon_preset_is_the_sources_loss():
    cfg = LossConfig(preset="canon")
    assert cfg.bounds.settings == {"eps_low": 0.2, "eps_high": 0.28} and cfg.aggregation.name == "seq_mean_token_sum"
    assert "canon" in PRESETS


# --- Stratified GRPO ------------------------------------------------------------------------------


def source_stratified(r, valid, keys, alpha, eps=1e-8):
    P, G = r.shape
    out = np.zeros((P, G))
    for p in range(P):
        idx = [g for g in range(G) if valid[p, g] and np.isfinite(r[p, g])]
        if not idx:
            continue
        vals = np.array([r[p, g] for g in idx])
        sd = vals.std(ddof=1) if len(idx) > 1 else 0.0
        for g in idx:
            gn = (r[p, g] - vals.mean()) / (sd + eps)
            same = [h for h in idx if keys[p, h] == keys[p, g] or (np.isnan(keys[p, h]) and np.isnan(keys[p, g]))]
            if len(same) < 2:
                san = 0.0  # the source gives NaN here
            else:
                sv = np.array([r[p, h] for h in same])
                san = (r[p, g] - sv.mean()) / (sv.std(ddof=1) + eps)
            out[p, g] = alpha * san + (1 - alpha) * gn
    return out


@pytest.mark.parametrize("alpha", [1.0, 0.6, 0.0])
def test_stratified_grpo_matches_the_source(alpha):
    rng = np.random.default_rng(21)
    r, valid = random_rewards(rng, 9, 8, kind="normal", nan_frac=0.05, invalid_frac=0.1)
    keys = rng.integers(0, 3, size=(9, 8)).astype(np.float64)
    keys[0, 0] = np.nan
    heads = np.stack([r, keys], axis=-1)
    batch = GroupBatch(rewards=t32(heads), valid=tb(valid), reward_weights=[1.0, 0.0], reward_names=["acc", "stratum"],
                       head_nan_policy="ignore_head")  # fmt: skip
    res = compute_advantages(
        batch, AdvantageConfig(estimator={"name": "stratified_grpo", "stratum_head": "stratum", "alpha": alpha})
    )
    want = source_stratified(r, valid, keys, alpha)
    np.testing.assert_allclose(np64(res.advantages), want, rtol=1e-4, atol=1e-5)
    assert res.metrics["stratified/strata"] > 9
    if alpha == 1.0:  # within every stratum the advantages sum to zero
        for p in range(9):
            for k in range(3):
                members = (keys[p] == k) & valid[p] & np.isfinite(r[p])
                assert abs(np64(res.advantages)[p][members].sum()) < 1e-4


def test_stratified_grpo_needs_a_stratum_head():
    batch = GroupBatch(rewards=torch.zeros(1, 2, 2), reward_names=["acc", "searches"])
    with pytest.raises(ValueError, match=r"stratum_head must name a reward head, one of \['acc', 'searches'\]"):
        compute_advantages(batch, AdvantageConfig(estimator={"name": "stratified_grpo", "stratum_head": "strata"}))
    with pytest.raises(ValueError, match="stratum_head"):
        compute_advantages(batch, AdvantageConfig(estimator="stratified_grpo"))
