"""THR (step weighting `thr`, `token_hidden_reward`, `thr_weights`) against float64 loop re-derivations. Paper only
(arXiv 2510.03669; its sections 3-4 not read, the note anchors_text_grpo.md 2.23): THR_{i,t} = A_i <phi_{i,t},
sum_{j correct, t'} phi_{j,t'}>, and A <- A (1 + p sign(THR)) on the top-|THR| tokens. The trainer's proxy feature
phi = 1 - pi_old (flowgrpo/core/thr.py) is re-derived here too."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from flowgrpo.core import LossConfig, LossInputs, policy_loss
from flowgrpo.core.thr import thr_weights, token_hidden_reward

N, T, D = 4, 5, 3


def loop_thr(phi, adv, correct, mask):
    out = np.zeros(mask.shape)
    for i in range(N):
        for t in range(T):
            if not mask[i, t]:
                continue
            dot = 0.0
            for j in range(N):
                for u in range(T):
                    if correct[j] and mask[j, u]:
                        dot += sum(phi[i, t, d] * phi[j, u, d] for d in range(phi.shape[2]))
            out[i, t] = adv[i] * dot
    return out


def loop_weights(thr, mask, p, top_frac):
    cells = [(abs(thr[i, t]), i * T + t) for i in range(N) for t in range(T) if mask[i, t]]
    k = min(len(cells), math.ceil(len(cells) * top_frac - 1e-9))
    chosen = sorted(cells, key=lambda c: (-c[0], c[1]))[:k]  # largest |THR|, ties: the earlier
    w = np.ones(mask.shape)
    for _, flat in chosen:
        i, t = divmod(flat, T)
        w[i, t] = 1 + p * np.sign(thr[i, t])
    return w


def fixed(seed=4):
    rng = np.random.default_rng(seed)
    phi = rng.normal(size=(N, T, D))
    adv = np.array([1.2, -0.4, 0.7, -1.5])
    mask = np.arange(T)[None, :] < np.array([5, 3, 4, 2])[:, None]
    return phi, adv, mask


def test_token_hidden_reward_matches_the_definition():
    phi, adv, mask = fixed()
    correct = adv > 0
    got = token_hidden_reward(torch.tensor(phi), torch.tensor(adv), torch.tensor(correct), torch.tensor(mask))
    np.testing.assert_allclose(got.numpy(), loop_thr(phi, adv, correct, mask), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("p, top_frac", [(0.1, 0.2), (-0.3, 0.5), (0.5, 1.0)])
def test_reweighting_matches_the_loop(p, top_frac):
    phi, adv, mask = fixed()
    thr = loop_thr(phi, adv, adv > 0, mask)
    got = thr_weights(torch.tensor(thr), torch.tensor(mask), p=p, top_frac=top_frac)
    np.testing.assert_array_equal(got.numpy(), loop_weights(thr, mask, p, top_frac))
    assert int((got != 1).sum()) == math.ceil(mask.sum() * top_frac)  # THR is nowhere 0 here


def test_step_weighting_scales_the_advantage_of_the_top_tokens():
    """The `thr` part with the proxy phi = 1 - pi_old: the clipped loss with A (1 + p sign(THR)) on the top tokens."""
    _, adv, mask = fixed()
    rng = np.random.default_rng(1)
    old = np.log(rng.uniform(0.05, 0.95, size=(N, T)))
    logp = old + rng.normal(0, 0.3, size=old.shape)
    phi = (1 - np.exp(old))[..., None]
    w = loop_weights(loop_thr(phi, adv, adv > 0, mask), mask, 0.2, 0.3)
    total, count = 0.0, 0
    for i in range(N):
        for t in range(T):
            if mask[i, t]:
                a, r = adv[i] * w[i, t], math.exp(logp[i, t] - old[i, t])
                total += max(-a * r, -a * min(max(r, 0.8), 1.2))
                count += 1
    cfg = LossConfig(
        bounds={"name": "symmetric", "eps": 0.2},
        aggregation="token_mean",
        step_weighting={"name": "thr", "p": 0.2, "top_frac": 0.3},
    )
    got = policy_loss(LossInputs(torch.tensor(logp), torch.tensor(old), torch.tensor(adv), torch.tensor(mask)), cfg)
    assert float(got.loss) == pytest.approx(total / count, rel=2e-5)
    assert set(np.unique(w)) == {0.8, 1.0, 1.2}  # both signs reweighted
    with pytest.raises(ValueError, match=r"p must lie in \[-1, 1\]"):
        policy_loss(LossInputs(torch.tensor(logp), torch.tensor(old), torch.tensor(adv), torch.tensor(mask)),
                    LossConfig(step_weighting={"name": "thr", "p": 1.5}))  # fmt: skip
