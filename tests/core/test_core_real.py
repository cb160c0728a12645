"""REAL (estimator `real`, surrogate `real`, `real_group_loss`) against a float64 loop re-derivation of the source:
Red-RL/REAL @ 1c30726, verl/verl/trainer/ppo/core_algos.py `compute_policy_loss_real` (s = mean token log-ratio;
per group with both labels log(1 + sum_+ e^(-s/tau)) + log(1 + sum_- e^(s/tau)); summed, / the group count)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from flowgrpo.core import (
    AdvantageConfig,
    GroupBatch,
    LossConfig,
    LossInputs,
    LossNormalizer,
    compute_advantages,
    policy_loss,
)
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


def _ours(logp, old, mask, tau, rows=None):
    """Our loss and its gradient in logp (float64 inputs) over `rows` (default all, in order), each row's group id."""
    adv = compute_advantages(
        GroupBatch(rewards=torch.tensor(REWARDS, dtype=torch.float32)), AdvantageConfig(estimator={"name": "real"})
    )
    rows = torch.arange(P * G) if rows is None else torch.as_tensor(rows)
    lp = torch.tensor(logp, dtype=torch.float64, requires_grad=True)
    full = LossInputs(
        lp,
        torch.tensor(old),
        adv.advantages.reshape(-1).double(),
        torch.tensor(mask),
        group_index=torch.arange(P * G) // G,
    )
    cfg = LossConfig(surrogate={"name": "real", "tau": tau}, aggregation="seq_mean_token_mean")
    out = policy_loss(full.split(rows), cfg, LossNormalizer.from_inputs(full))
    out.loss.backward()
    return float(out.loss.detach()), lp.grad.numpy()


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
def test_loss_and_gradient_are_the_sources_over_g_after_the_policy_moved(tau):
    """With each row's group id the loss is the source's group loss / G (seq_mean_token_mean over P G rows) and so
    is its gradient: at the rollout policy and after every row has moved (several updates per batch), in any row
    order and in micro-batches of whole groups."""
    _, old, mask = fixed()
    loss, grad = _ours(old, old, mask, tau)
    assert loss == pytest.approx(source_real(old, old, mask, REWARDS, tau) / G, rel=1e-6)
    np.testing.assert_allclose(grad, _source_grad(old, old, mask, tau) / G, rtol=1e-5, atol=1e-9)
    moved = old + np.random.default_rng(5).normal(0, 0.4, size=old.shape)
    loss, grad = _ours(moved, old, mask, tau)
    assert loss == pytest.approx(source_real(moved, old, mask, REWARDS, tau) / G, rel=1e-6)
    np.testing.assert_allclose(grad, _source_grad(moved, old, mask, tau) / G, rtol=1e-5, atol=1e-9)
    shuffled = [6, 4, 7, 5, 1, 3, 0, 2]  # groups 1 and 0, rows in any order
    parts = [_ours(moved, old, mask, tau, rows) for rows in (shuffled, list(range(8, 12)))]
    assert sum(p[0] for p in parts) == pytest.approx(loss, rel=1e-6)
    np.testing.assert_allclose(sum(p[1] for p in parts), grad, rtol=1e-6, atol=1e-12)


def test_a_labelled_row_left_out_counts_at_the_old_policy():
    """A micro-batch without some labelled rows of a group (their tokens all masked out): they are samples at the
    old policy (s = 0), as their label's count says; the group id is required."""
    _, old, mask = fixed()
    moved = old + np.random.default_rng(6).normal(0, 0.4, size=old.shape)
    at_old = moved.copy()
    at_old[[0, 5]] = old[[0, 5]]  # row 0 (group 0, positive) and row 5 (group 1, negative) at the old policy
    loss, _ = _ours(moved, old, mask, 0.5, [1, 2, 3, 4, 6, 7])
    assert loss == pytest.approx(source_real(at_old, old, mask, REWARDS[:2], 0.5) * 2 / (P * G), rel=1e-6)
    with pytest.raises(ValueError, match="surrogate 'real' needs LossInputs.group_index"):
        policy_loss(LossInputs(torch.tensor(old), torch.tensor(old), torch.ones(P * G), torch.tensor(mask)),
                    LossConfig(surrogate="real"))  # fmt: skip
    with pytest.raises(ValueError, match=r"group_index: expected shape \[12\]"):
        LossInputs(
            torch.tensor(old), torch.tensor(old), torch.ones(P * G), torch.tensor(mask), group_index=torch.zeros(3)
        )
