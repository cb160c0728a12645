"""Gaussian transition log-probs (mean over latent dims) and GRPO-Guard RatioNorm (Flow-GRPO, GRPO-Guard papers)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from _coreref import SETTINGS, np64
from flowgrpo.core import LossConfig, LossInputs, gaussian_logprob, guard_log_ratio, mean_sqdist, policy_loss


@SETTINGS
@given(
    seed=st.integers(0, 2**31 - 1),
    B=st.integers(1, 4),
    shape=st.sampled_from([(3,), (2, 3), (4, 2, 2)]),
    per_sample=st.booleans(),
)
def test_gaussian_logprob_is_the_mean_over_dims(seed, B, shape, per_sample):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(B,) + shape).astype(np.float32)
    mu = rng.normal(size=(B,) + shape).astype(np.float32)
    s = rng.uniform(0.1, 2.0, size=B).astype(np.float32) if per_sample else np.float32(0.7)
    got = np64(gaussian_logprob(torch.tensor(x), torch.tensor(mu), torch.tensor(s) if per_sample else float(s)))
    for b in range(B):
        sb = float(s[b]) if per_sample else float(s)
        xs, ms = x[b].astype(np.float64).ravel(), mu[b].astype(np.float64).ravel()
        dens = [
            -((xi - mi) ** 2) / (2 * sb * sb) - math.log(sb) - 0.5 * math.log(2 * math.pi) for xi, mi in zip(xs, ms)
        ]
        assert got[b] == pytest.approx(sum(dens) / len(dens), rel=1e-5, abs=1e-5)
    sq = np64(mean_sqdist(torch.tensor(x), torch.tensor(mu)))
    np.testing.assert_allclose(sq, ((x.astype(np.float64) - mu) ** 2).reshape(B, -1).mean(1), rtol=1e-5)


def test_gaussian_logprob_runs_in_float32():
    x = torch.randn(2, 8, dtype=torch.bfloat16)
    out = gaussian_logprob(x, torch.zeros_like(x), 0.5)
    assert out.dtype == torch.float32 and out.shape == (2,)
    assert mean_sqdist(x, torch.zeros_like(x)).dtype == torch.float32


@pytest.mark.parametrize("s", [0.05, 0.3, 1.0])
def test_grpo_guard_normalised_log_ratio_has_zero_mean(s):
    """x = mu_old + s eps: the plain log-ratio has mean -mean_d(dmu^2) / (2 s^2) (left-shifted); the
    RatioNorm log-ratio s (log r + b) = mean_d(eps * dmu) has mean 0 and the same spread at every s."""
    g = torch.Generator().manual_seed(int(s * 1000))
    n, D = 20000, 64
    mu_old = torch.randn(1, D, generator=g)
    dmu = 0.3 * s * torch.randn(1, D, generator=g)  # a policy move of the order of the step's std
    mu_new = mu_old + dmu
    x = mu_old + s * torch.randn(n, D, generator=g)
    lp_new = gaussian_logprob(x, mu_new.expand(n, D), s)
    lp_old = gaussian_logprob(x, mu_old.expand(n, D), s)
    msd = mean_sqdist(mu_new.expand(n, D), mu_old.expand(n, D))
    plain = (lp_new - lp_old).double()
    normed = guard_log_ratio(lp_new, lp_old, msd, torch.full((n,), s)).double()
    bias = float(msd[0]) / (2 * s * s)
    se_normed = float(normed.std()) / math.sqrt(n)
    se_plain = float(plain.std()) / math.sqrt(n)
    assert abs(float(normed.mean())) < 4 * se_normed
    assert float(plain.mean()) < -10 * se_plain  # clearly below zero
    assert float(plain.mean()) == pytest.approx(-bias, abs=4 * se_plain)
    # the spread of the normalised log-ratio is sqrt(sum_d dmu^2) / D, whatever the step std
    assert float(normed.std()) == pytest.approx(float(dmu.norm()) / D, rel=0.05)
    # and it equals mean_d(eps * dmu) sample by sample
    eps = (x - mu_old) / s
    np.testing.assert_allclose(np64(normed), np64((eps * dmu).mean(1)), rtol=1e-3, atol=1e-6)


def test_ratio_norm_in_the_loss_uses_the_guard_log_ratio():
    g = torch.Generator().manual_seed(0)
    N, T = 4, 3
    lp_old = torch.randn(N, T, generator=g)
    lp = lp_old + 0.01 * torch.randn(N, T, generator=g)
    std = 0.2 + torch.rand(N, T, generator=g)
    msd = 0.001 * torch.rand(N, T, generator=g)
    li = LossInputs(
        lp, lp_old, torch.randn(N, generator=g), torch.ones(N, T, dtype=torch.bool), mean_sqdist_old=msd, std=std
    )
    out = policy_loss(li, LossConfig(ratio="ratio_norm", bounds={"name": "symmetric", "eps": 1.0}))
    r = np.exp(np64(std) * (np64(lp) - np64(lp_old) + np64(msd) / (2 * np64(std) ** 2)))
    assert out.metrics["ratio/mean"] == pytest.approx(r.mean(), rel=1e-5)
    np.testing.assert_allclose(np64(torch.exp(guard_log_ratio(lp, lp_old, msd, std))), r, rtol=1e-5)
    expected = (-np64(li.advantages) * r).mean()
    assert float(out.loss) == pytest.approx(expected, rel=1e-5)
