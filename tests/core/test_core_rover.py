"""ROVER (estimator `rover`, surrogate `rover`) against float64 loop re-derivations of the source:
yuxiaooye/ROVER @ ea5ce63, Math/verl/workers/actor/dp_actor.py `update_policy` (Q = rover_t (log pi - log pi_old),
the optional log-space clip, target = A + rover_t (m_{t+1} - m_{t+1}^old), loss = token mean of (Q - target)^2) and
Countdown/verl/trainer/ppo/core_algos.py `compute_rover_reward` (r - group mean; a lone sample's mean 0)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from flowgrpo.core import AdvantageConfig, GroupBatch, LossConfig, LossInputs, compute_advantages, policy_loss


def fixed(seed=7, N=5, T=6, spread=0.3):
    rng = np.random.default_rng(seed)
    old = np.log(rng.uniform(0.05, 1.0, size=(N, T)))
    logp = old + rng.normal(0, spread, size=(N, T))
    adv = np.repeat(rng.normal(size=(N, 1)), T, 1)
    lengths = rng.integers(1, T + 1, size=N)
    mask = np.arange(T)[None, :] < lengths[:, None]
    return logp, old, adv, mask


def source_rover(logp, old, adv, mask, next_mean=None, next_mean_old=None, *, rover_t=1.0, clip=None):
    """The ROVER block of update_policy, token by token; next_mean / next_mean_old: the vocabulary mean of the
    log-softmax at each position under the current / old policy (None: the source's target_adv_only)."""
    N, T = logp.shape
    total, count = 0.0, 0
    for i in range(N):
        for t in range(T):
            if not mask[i, t]:
                continue
            target = adv[i, t]
            if next_mean is not None and t + 1 < T:
                target += rover_t * (next_mean[i, t + 1] - next_mean_old[i, t + 1]) * mask[i, t + 1]
            q = rover_t * (logp[i, t] - old[i, t])
            if clip is not None:
                hi, lo = math.log(1 + clip), math.log(1 - clip)
                if target > q > hi:
                    q = hi
                elif target < q < lo:
                    q = lo
            total += (q - target) ** 2
            count += 1
    return total / count


def ours(logp, old, adv, mask, next_mean=None, next_mean_old=None, **surrogate):
    """Our loss; next_mean / next_mean_old None: the same m under both policies (one update per batch: term 0)."""
    lp = torch.tensor(logp, requires_grad=True)
    bounds = {"name": "symmetric", "eps": surrogate.pop("eps", 0.2)}
    cfg = LossConfig(surrogate={"name": "rover", **surrogate}, bounds=bounds, aggregation="token_mean")
    m = np.random.default_rng(1).normal(size=logp.shape) if next_mean is None else next_mean
    m_old = m if next_mean_old is None else next_mean_old
    inputs = LossInputs(lp, torch.tensor(old), torch.tensor(adv), torch.tensor(mask))
    inputs.vocab_mean_logp, inputs.vocab_mean_logp_old = torch.tensor(m), torch.tensor(m_old)
    out = policy_loss(inputs, cfg)
    return out.loss.detach(), lp, out.loss


@pytest.mark.parametrize("rover_t", [1.0, 0.5])
def test_loss_matches_the_source_with_target_adv_only(rover_t):
    logp, old, adv, mask = fixed()
    got, *_ = ours(logp, old, adv, mask, temperature=rover_t)
    assert float(got) == pytest.approx(source_rover(logp, old, adv, mask, rover_t=rover_t), rel=1e-6)
    # the source's next-state term is 0 when the current and old passes are the same weights (one update per batch)
    m = np.random.default_rng(0).normal(size=logp.shape)
    assert source_rover(logp, old, adv, mask, m, m, rover_t=rover_t) == pytest.approx(float(got), rel=1e-6)


@pytest.mark.parametrize("rover_t", [1.0, 0.5])
def test_next_state_term_matches_the_source(rover_t):
    """Several updates per batch: the current and old passes differ, target = A + rover_t (m_{t+1} - m_old_{t+1})
    (0 after a row's last token); its value is in the loss, never in the gradient."""
    logp, old, adv, mask = fixed(spread=0.5)
    rng = np.random.default_rng(11)
    m_old = -np.log(50.0) + rng.normal(0, 0.3, size=logp.shape)
    m = m_old + rng.normal(0, 0.2, size=logp.shape)
    got, lp, loss = ours(logp, old, adv, mask, m, m_old, temperature=rover_t)
    want = source_rover(logp, old, adv, mask, m, m_old, rover_t=rover_t)
    assert float(got) == pytest.approx(want, rel=1e-6)
    assert want != pytest.approx(source_rover(logp, old, adv, mask, rover_t=rover_t), rel=1e-3)  # the term acted
    loss.backward()
    target = adv.copy()
    target[:, :-1] += rover_t * (m[:, 1:] - m_old[:, 1:]) * mask[:, 1:]
    want_grad = np.where(mask, 2 * rover_t * (rover_t * (logp - old) - target) / mask.sum(), 0.0)
    np.testing.assert_allclose(lp.grad.numpy(), want_grad, rtol=1e-5, atol=1e-9)
    with pytest.raises(ValueError, match="needs LossInputs.vocab_mean_logp"):
        policy_loss(
            LossInputs(lp, torch.tensor(old), torch.tensor(adv), torch.tensor(mask)), LossConfig(surrogate="rover")
        )


def test_clip_matches_the_source():
    logp, old, adv, mask = fixed(spread=0.6)
    adv = adv * 2
    for eps in (0.2, 0.1):
        got, *_ = ours(logp, old, adv, mask, clip=True, eps=eps)
        want = source_rover(logp, old, adv, mask, clip=eps)
        assert float(got) == pytest.approx(want, rel=1e-6)
        assert want != pytest.approx(source_rover(logp, old, adv, mask), rel=1e-3)  # the clip acted


def test_gradient_at_the_rollout_policy_is_reinforce():
    """At logp = logp_old the gradient of the token mean of (Q - A)^2 is -2 rover_t A / (token count) per token."""
    _, old, adv, mask = fixed()
    _, lp, loss = ours(old, old, adv, mask, temperature=0.5)
    loss.backward()
    want = np.where(mask, -2 * 0.5 * adv / mask.sum(), 0.0)
    np.testing.assert_allclose(lp.grad.numpy(), want, rtol=1e-6, atol=1e-12)


def test_estimator_matches_compute_rover_reward():
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.5, float("nan"), float("nan"), float("nan")]], dtype=torch.float64)
    batch = GroupBatch(rewards=r)
    plain = compute_advantages(batch, AdvantageConfig(estimator={"name": "rover"})).advantages
    assert plain.tolist() == [[0.5, -0.5, -0.5, 0.5], [0.5, 0.0, 0.0, 0.0]]  # a lone sample keeps r (mean 0)
    normed = compute_advantages(batch, AdvantageConfig(estimator={"name": "rover", "std_normalize": True})).advantages
    a = 0.5 / (float(np.std([1.0, 0.0, 0.0, 1.0], ddof=1)) + 1e-6)
    np.testing.assert_allclose(normed[0].numpy(), [a, -a, -a, a], rtol=1e-6)
    assert float(normed[1, 0]) == pytest.approx(0.5 / (1 + 1e-6))  # std 1 for a lone sample
    with pytest.raises(ValueError, match="temperature: must be a finite number > 0"):
        ours(*fixed(), temperature=0.0)
