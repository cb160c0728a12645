"""REAL (estimator `real`, surrogate `real`, `real_group_loss`) against a float64 loop re-derivation of the source:
Red-RL/REAL @ 1c30726, verl/verl/trainer/ppo/core_algos.py `compute_policy_loss_real` (s = mean token log-ratio;
per group with both labels log(1 + sum_+ e^(-s/tau)) + log(1 + sum_- e^(s/tau)); summed, / the group count)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from flowgrpo.core import AdvantageConfig, GroupBatch, LossConfig, LossInputs, compute_advantages, policy_loss
from flowgrpo.core.real import real_group_loss

P, G, T = 3, 4, 5
# group 0: both labels; group 1: both (one positive); group 2: all negative (no loss, but counted)
REWARDS = np.array([[1.0, 0.0, 1.0, 0.0], [0.0, 0.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0]])


def source_real(logp, old, mask, rewards, tau):
    """compute_policy_loss_real, loop by loop (its rows grouped by uid: here group p is rows p*G .. p*G+G-1)."""
    total = 0.0
    for p in range(rewards.shape[0]):
        s = []
        for g in range(G):
            i = p * G + g
            m = mask[i]
            s.append(sum((logp[i, t] - old[i, t]) * m[t] for t in range(T)) / m.sum())
        pos = [s[g] for g in range(G) if rewards[p, g] == 1]
        neg = [s[g] for g in range(G) if rewards[p, g] == 0]
        if pos and neg:
            total += math.log(1 + sum(math.exp(-x / tau) for x in pos)) + math.log(
                1 + sum(math.exp(x / tau) for x in neg)
            )
    return total / rewards.shape[0]


def fixed(seed=3, spread=0.3):
    rng = np.random.default_rng(seed)
    old = np.log(rng.uniform(0.05, 1.0, size=(P * G, T)))
    logp = old + rng.normal(0, spread, size=(P * G, T))
    lengths = rng.integers(1, T + 1, size=P * G)
    mask = np.arange(T)[None, :] < lengths[:, None]
    return logp, old, mask


@pytest.mark.parametrize("tau", [0.5, 0.2, 2.0])
def test_group_loss_matches_the_source(tau):
    logp, old, mask = fixed()
    s = ((logp - old) * mask).sum(1) / mask.sum(1)
    got = real_group_loss(torch.tensor(s).view(P, G), torch.tensor(REWARDS == 1), torch.tensor(REWARDS == 0), tau=tau)
    assert float(got) == pytest.approx(source_real(logp, old, mask, REWARDS, tau), rel=1e-12)


def test_estimator_labels_and_counts():
    r = torch.tensor(REWARDS, dtype=torch.float32)
    r[0, 3] = float("nan")  # could not score: no label, out of the counts
    adv = compute_advantages(GroupBatch(rewards=r), AdvantageConfig(estimator={"name": "real"})).advantages
    assert adv.tolist() == [[2.0, -1.0, 2.0, 0.0], [-3.0, -3.0, 1.0, -3.0], [0.0] * 4]
    graded = torch.tensor([[0.2, 0.0, 0.5, 0.1]])
    mean = compute_advantages(GroupBatch(rewards=graded), AdvantageConfig(estimator={"name": "real", "labels": "mean"}))
    assert mean.advantages.tolist() == [[2.0, -2.0, 2.0, -2.0]]  # above / below the group mean 0.2
    with pytest.raises(ValueError, match="labels: must be one of"):
        compute_advantages(GroupBatch(rewards=graded), AdvantageConfig(estimator={"name": "real", "labels": "sign"}))


def _our_grad(logp, old, mask, tau):
    adv = compute_advantages(
        GroupBatch(rewards=torch.tensor(REWARDS, dtype=torch.float32)), AdvantageConfig(estimator={"name": "real"})
    )
    lp = torch.tensor(logp, dtype=torch.float64, requires_grad=True)
    inp = LossInputs(lp, torch.tensor(old), adv.advantages.reshape(-1).double(), torch.tensor(mask))
    cfg = LossConfig(surrogate={"name": "real", "tau": tau}, aggregation="seq_mean_token_mean")
    policy_loss(inp, cfg).loss.backward()
    return lp.grad.numpy()


def _source_grad(logp, old, mask, tau, h=1e-6):
    """Central differences of the source loss in every log-prob (float64)."""
    grad = np.zeros_like(logp)
    for i in range(P * G):
        for t in range(T):
            if not mask[i, t]:
                continue
            up, down = logp.copy(), logp.copy()
            up[i, t] += h
            down[i, t] -= h
            grad[i, t] = (source_real(up, old, mask, REWARDS, tau) - source_real(down, old, mask, REWARDS, tau)) / (
                2 * h
            )
    return grad


@pytest.mark.parametrize("tau", [0.5, 2.0])
def test_gradient_is_the_sources_over_g_at_the_rollout_policy(tau):
    """One update per batch (logp_old = logp): the per-row surrogate's gradient is the source's group loss's / G;
    and where only one row has moved it is still exact for that row (the others sit at the old policy)."""
    _, old, mask = fixed()
    np.testing.assert_allclose(
        _our_grad(old, old, mask, tau), _source_grad(old, old, mask, tau) / G, rtol=1e-5, atol=1e-9
    )
    moved = old.copy()
    moved[2] += 0.4  # row 2 (group 0, positive) only
    ours, src = _our_grad(moved, old, mask, tau), _source_grad(moved, old, mask, tau) / G
    np.testing.assert_allclose(ours[2], src[2], rtol=1e-5, atol=1e-9)
    assert not np.allclose(ours[0], src[0], rtol=1e-3)  # row 0 shares the group: its drift term is left out
