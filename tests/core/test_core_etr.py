"""ETR (bounds `etr`) against a float64 loop re-derivation. Paper only (arXiv 2601.03723: its abstract's structure
eps_i = eps_0 g(|A_i|) h(Var_q); g and h were not recovered and are ours, flowgrpo/core/etr.py): the PPO clipped
loss with per-sample bounds [1 - eps_low s_i, 1 + eps_high s_i], s_i = (1 + alpha min(|A_i|, a_max)) (1 + beta 4 p(1-p)),
p the group's pass rate of 0 / 1 rewards, here counted from the rewards themselves."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from flowgrpo.core import AdvantageConfig, GroupBatch, LossConfig, LossInputs, compute_advantages, policy_loss
from flowgrpo.core.etr import pass_rate_variance

# 0 / 1 rewards, pass rates 1/2, 1/4, 3/4 (one group all wrong: A = 0)
REWARDS = [[1, 0, 1, 0], [0, 0, 1, 0], [1, 1, 0, 1], [0, 0, 0, 0]]
P, G, T = 4, 4, 5


def grpo_biased(rewards):
    """GRPO advantages with the biased std (eps 1e-4, as the estimator), and each sample's group pass rate."""
    adv, rate = np.zeros((P, G)), np.zeros((P, G))
    for p, row in enumerate(rewards):
        mean = sum(row) / G
        std = math.sqrt(sum((x - mean) ** 2 for x in row) / G)
        for g, x in enumerate(row):
            adv[p, g] = (x - mean) / (std + 1e-4)
            rate[p, g] = mean
    return adv, rate


def etr_loss(logp, old, adv, rate, mask, *, el, eh, alpha, beta, a_max):
    """ppo_clip with per-sample elastic bounds, loop by loop; token mean over the masked actions."""
    total, count = 0.0, 0
    for i in range(logp.shape[0]):
        a, p = adv[i], rate[i]
        scale = (1 + alpha * min(abs(a), a_max)) * (1 + beta * 4 * p * (1 - p))
        low, high = max(0.0, 1 - el * scale), 1 + eh * scale
        for t in range(logp.shape[1]):
            if mask[i, t]:
                r = math.exp(logp[i, t] - old[i, t])
                total += max(-a * r, -a * min(max(r, low), high))
                count += 1
    return total / count


def test_pass_rate_variance_is_read_exactly_from_grpo_advantages():
    r = torch.tensor(REWARDS, dtype=torch.float64)
    adv = compute_advantages(GroupBatch(rewards=r), AdvantageConfig(estimator={"name": "grpo", "unbiased": False}))
    _, rate = grpo_biased(REWARDS)
    got = pass_rate_variance(adv.advantages.double())
    live = rate * (1 - rate) > 0
    np.testing.assert_allclose(got.numpy()[live], (rate * (1 - rate))[live], rtol=1e-3)  # eps 1e-4 in the std
    assert float(got[3].abs().max()) == 0.0


@pytest.mark.parametrize(
    "settings",
    [dict(el=0.2, eh=0.2, alpha=0.1, beta=0.5, a_max=3.0), dict(el=0.1, eh=0.3, alpha=0.5, beta=1.0, a_max=1.0)],
)
def test_bounds_match_the_re_derivation(settings):
    adv, rate = grpo_biased(REWARDS)
    adv, rate = adv.reshape(-1), rate.reshape(-1)
    rng = np.random.default_rng(2)
    old = np.log(rng.uniform(0.05, 1.0, size=(P * G, T)))
    logp = old + rng.normal(0, 0.4, size=old.shape)
    mask = np.arange(T)[None, :] < rng.integers(1, T + 1, size=P * G)[:, None]
    s = settings
    cfg = LossConfig(
        bounds={
            "name": "etr",
            "eps_low": s["el"],
            "eps_high": s["eh"],
            "alpha": s["alpha"],
            "beta": s["beta"],
            "a_max": s["a_max"],
        },
        aggregation="token_mean",
    )
    inp = LossInputs(torch.tensor(logp), torch.tensor(old), torch.tensor(adv), torch.tensor(mask))
    got = float(policy_loss(inp, cfg).loss)
    assert got == pytest.approx(etr_loss(logp, old, adv, rate, mask, **settings), rel=2e-5)
    plain = LossConfig(bounds={"name": "asymmetric", "eps_low": s["el"], "eps_high": s["eh"]}, aggregation="token_mean")
    assert got != pytest.approx(float(policy_loss(inp, plain).loss), rel=1e-4)  # the elastic bounds acted


def test_wider_for_larger_advantage_and_for_the_learning_zone():
    from flowgrpo.core.etr import etr_scale

    s = etr_scale(torch.tensor([0.5, 1.0, 2.0, 8.0]), alpha=0.1, beta=0.0, a_max=3.0)
    assert s.tolist() == pytest.approx([1.05, 1.1, 1.2, 1.3])  # micro: grows with |A|, capped at a_max
    half, quarter = 1.0, math.sqrt(3.0)  # |A| of a success at p = 1/2 and of a failure at p = 3/4
    s = etr_scale(torch.tensor([half, quarter]), alpha=0.0, beta=1.0, a_max=3.0)
    assert s.tolist() == pytest.approx([2.0, 1.75])  # macro: 1 + 4 p(1-p), largest at p = 1/2
    with pytest.raises(ValueError, match="beta: must be a finite number >= 0"):
        inp = LossInputs(torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1), torch.ones(1, 2, dtype=torch.bool))
        policy_loss(inp, LossConfig(bounds={"name": "etr", "beta": -1.0}))
