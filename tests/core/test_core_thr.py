"""THR (step weighting `thr`; flowgrpo/core/thr.py) against float64 loop re-derivations of the recovered equations
(arXiv 2510.03669's reviews and its predecessor NTHR, arXiv 2505.18830, Sec. 5 and App. 7.2):

    alpha = <e_y - pi, e_y' - pi'>,   s_{j,k} = sum_{i correct in j's group, k'} alpha <h_{i,k'}, h_{j,k}>,
    THR_{j,k} = A_j s_{j,k},          tau = beta min_{i correct} mean_k s_{i,k}   (NTHR Eq. 7-8)
    dominant tokens |s| > tau (mixed groups only); reweight: A (1 + p sign(THR)) on them; only: train on them alone.

The trainer's proxy feature phi = 1 - pi_old (one shared direction) is re-derived in the loss test."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from flowgrpo.core import LossConfig, LossInputs, policy_loss
from flowgrpo.core.thr import anchor_threshold, influence, select_top, thr_weights, token_hidden_reward

N, T = 6, 5
GROUP = np.array([0, 0, 0, 1, 1, 1])
ADV = np.array([1.2, -0.4, -0.8, 0.7, 0.7, -1.4])  # each group has correct (A > 0) and incorrect rows
LENGTHS = np.array([5, 3, 4, 2, 5, 4])


def mask_of(lengths=LENGTHS):
    return np.arange(T)[None, :] < lengths[:, None]


def loop_influence(dot, correct, mask, group):
    """s_{j,k} = sum over the masked tokens (i, u) of the correct rows of j's group of dot(i, u, j, k)."""
    s = np.zeros(mask.shape)
    for j in range(N):
        for k in range(T):
            if mask[j, k]:
                s[j, k] = sum(
                    dot(i, u, j, k)
                    for i in range(N)
                    for u in range(T)
                    if correct[i] and mask[i, u] and group[i] == group[j]
                )
    return s


def loop_tau(s, correct, mask, group, beta):
    tau = np.full(N, math.inf)
    for g in set(group.tolist()):
        rows = [i for i in range(N) if group[i] == g and mask[i].any()]
        pos = [i for i in rows if correct[i]]
        if pos and len(pos) < len(rows):  # both kinds of rows
            least = min(sum(s[i, k] for k in range(T) if mask[i, k]) / mask[i].sum() for i in pos)
            tau[[i for i in range(N) if group[i] == g]] = beta * least
    return tau


def test_influence_is_the_nthr_double_sum_of_alpha_times_hidden_similarity():
    """With the real gradient features (e_y - pi) h^T flattened, <phi, phi'> = alpha <h, h'>: the influence is the
    NTHR sum over the group's correct tokens, and THR = A s."""
    rng = np.random.default_rng(3)
    V, d = 7, 4
    logits = rng.normal(size=(N, T, V))
    pi = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    y = rng.integers(0, V, size=(N, T))
    h = rng.normal(size=(N, T, d))
    err = np.eye(V)[y] - pi  # e_y - pi
    feats = np.einsum("ntv,ntd->ntvd", err, h).reshape(N, T, V * d)
    mask, correct = mask_of(), ADV > 0

    def dot(i, u, j, k):
        return float(err[i, u] @ err[j, k]) * float(h[i, u] @ h[j, k])  # alpha <h, h'>

    want = loop_influence(dot, correct, mask, GROUP)
    args = (torch.tensor(correct), torch.tensor(mask), torch.tensor(GROUP))
    got = influence(torch.tensor(feats), *args)
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-12, atol=1e-12)
    thr = token_hidden_reward(torch.tensor(feats), torch.tensor(ADV), *args)
    np.testing.assert_allclose(thr.numpy(), ADV[:, None] * want, rtol=1e-12, atol=1e-12)
    assert (want < 0).any() and (want > 0).any()  # real features: both signs (the proxy has only s >= 0)
    one = influence(torch.tensor(feats), torch.tensor(correct), torch.tensor(mask))  # no groups: other anchors
    assert not np.allclose(one.numpy(), want)


@pytest.mark.parametrize("beta", [1.0, 0.1, -1.0])
def test_anchor_threshold_is_beta_times_the_least_mean_self_influence(beta):
    rng = np.random.default_rng(5)
    s = rng.normal(size=(N, T))
    correct = ADV > 0
    correct_only = correct.copy()
    correct_only[3:] = True  # group 1 all correct: not scored
    for c in (correct, correct_only):
        got = anchor_threshold(
            torch.tensor(s), torch.tensor(c), torch.tensor(mask_of()), torch.tensor(GROUP), beta=beta
        )
        np.testing.assert_allclose(got.numpy(), loop_tau(s, c, mask_of(), GROUP, beta), rtol=1e-12)
    assert math.isinf(float(got[3])) and math.isfinite(float(got[0]))


@pytest.mark.parametrize("top_frac", [0.2, 0.5, 1.0])
def test_top_fraction_option_and_the_two_modes(top_frac):
    rng = np.random.default_rng(4)
    thr, mask = rng.normal(size=(N, T)), mask_of()
    cells = sorted(((-abs(thr[i, t]), i * T + t) for i in range(N) for t in range(T) if mask[i, t]))
    k = math.ceil(len(cells) * top_frac - 1e-9)
    want = np.zeros(N * T, dtype=bool)
    want[[flat for _, flat in cells[:k]]] = True  # largest |THR|, ties: the earlier
    sel = select_top(torch.tensor(thr), torch.tensor(mask), top_frac=top_frac)
    np.testing.assert_array_equal(sel.numpy().reshape(-1), want)
    w = thr_weights(torch.tensor(thr), sel, p=-0.3).numpy()
    np.testing.assert_array_equal(w, np.where(sel.numpy(), 1 - 0.3 * np.sign(thr), 1.0))
    np.testing.assert_array_equal(thr_weights(torch.tensor(thr), sel, p=0.3, mode="only").numpy(), sel.numpy())


def loop_thr_loss(logp, old, mask, *, p, beta, mode, eps=0.2):
    """The clipped GRPO loss (token mean) with the THR weights of the proxy phi = 1 - pi_old, loop by loop."""
    phi, correct = 1 - np.exp(old), ADV > 0
    s = loop_influence(lambda i, u, j, k: phi[i, u] * phi[j, k], correct, mask, GROUP)
    tau = loop_tau(s, correct, mask, GROUP, beta)
    total, count, chosen = 0.0, 0, 0
    for i in range(N):
        for t in range(T):
            if not mask[i, t]:
                continue
            on = abs(s[i, t]) > tau[i]
            chosen += on
            if mode == "reweight":
                w = 1 + p * np.sign(ADV[i] * s[i, t]) if on else 1.0
            else:
                w = 1.0 if on or math.isinf(tau[i]) else 0.0
            r = math.exp(logp[i, t] - old[i, t])
            total += w * max(-ADV[i] * r, -ADV[i] * min(max(r, 1 - eps), 1 + eps))
            count += 1
    return total / count, chosen


@pytest.mark.parametrize("mode", ["reweight", "only"])
def test_step_weighting_is_the_loss_with_the_paper_form(mode):
    rng = np.random.default_rng(1)
    old = np.log(rng.uniform(0.05, 0.95, size=(N, T)))
    logp = old + rng.normal(0, 0.3, size=old.shape)
    mask = mask_of()
    args = (torch.tensor(logp), torch.tensor(old), torch.tensor(ADV), torch.tensor(mask))
    inp = LossInputs(*args, group_index=torch.tensor(GROUP))
    weighting = {"name": "thr", "p": 0.2, "beta": 1.0, "mode": mode}
    cfg = LossConfig(bounds={"name": "symmetric", "eps": 0.2}, aggregation="token_mean", step_weighting=weighting)
    got = float(policy_loss(inp, cfg).loss)
    want, chosen = loop_thr_loss(logp, old, mask, p=0.2, beta=1.0, mode=mode)
    assert got == pytest.approx(want, rel=1e-6)
    assert 0 < chosen < mask.sum()  # the threshold kept some tokens and left others
    plain = LossConfig(bounds={"name": "symmetric", "eps": 0.2}, aggregation="token_mean")
    assert got != pytest.approx(float(policy_loss(inp, plain).loss), rel=1e-4)


def test_bad_settings_and_missing_groups_are_refused():
    inp = LossInputs(
        torch.zeros(2, 3), torch.zeros(2, 3), torch.tensor([1.0, -1.0]), torch.ones(2, 3, dtype=torch.bool)
    )
    with pytest.raises(ValueError, match=r"step_weighting.p: must be a finite number in \[-1, 1\], got 1.5"):
        LossConfig(step_weighting={"name": "thr", "p": 1.5})
    with pytest.raises(ValueError, match="select: must be one of 'tau', 'top_frac', got 'all'"):
        LossConfig(step_weighting={"name": "thr", "select": "all"})
    with pytest.raises(ValueError, match="needs LossInputs.group_index"):
        policy_loss(inp, LossConfig(step_weighting={"name": "thr"}))
    with pytest.raises(ValueError, match=r"p must lie in \[-1, 1\]"):
        thr_weights(torch.ones(1, 1), torch.ones(1, 1, dtype=torch.bool), p=2.0)
