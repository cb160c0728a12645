"""AWM (flowgrpo/t2i/awm.py): the weighted matching log-prob, the clipped surrogate and the time draws against a
float64 re-derivation on fixed inputs; one tiny iteration's counts; the learning run (heavy)."""

import math

import pytest
import torch

from flowgrpo.t2i.awm import (
    AWMConfig,
    MatchingTimes,
    awm_advantage,
    awm_policy_loss,
    draw_times,
    ema_kl_decay,
    matching_error,
    weighted_log_prob,
)

from .learning_runs import learning_margin


def _fixed():
    g = torch.Generator().manual_seed(3)
    v, eps, x0 = (torch.randn(3, 2, 4, 4, generator=g) for _ in range(3))
    t = torch.tensor([0.2, 0.5, 0.9])
    return v, eps, x0, t


def _err64(v, eps, x0):
    out = []
    for i in range(v.shape[0]):
        d = [float(a) - (float(b) - float(c)) for a, b, c in zip(v[i].flatten(), eps[i].flatten(), x0[i].flatten())]
        out.append(sum(x * x for x in d) / len(d))
    return out


@pytest.mark.parametrize("weighting", ["uniform", "t", "t**2", "huber", "ghuber"])
def test_weighted_log_prob_matches_a_float64_derivation(weighting):
    v, eps, x0, t = _fixed()
    err = matching_error(v, eps, x0)
    assert err.dtype == torch.float64
    expect_err = _err64(v, eps, x0)
    assert err.tolist() == pytest.approx(expect_err, rel=1e-12)
    p = 0.25
    expect = []
    for e, tt in zip(expect_err, t.double().tolist()):
        w = {
            "uniform": e,
            "t": e * tt,
            "t**2": e * tt * tt,
            "huber": (math.sqrt(e + 1e-10) - 1e-5) * tt,
            "ghuber": ((e + 1e-10) ** p - 1e-10**p) * tt / p,
        }[weighting]
        expect.append(-w)
    assert weighted_log_prob(err, t, weighting, p).tolist() == pytest.approx(expect, rel=1e-12)


def test_clipped_surrogate_and_advantage_scaling():
    logp = torch.tensor([-1.0, -1.0, -1.0, -1.0], dtype=torch.float64)
    old = torch.tensor([-1.5, -0.5, -1.5, -1.0], dtype=torch.float64)
    adv = awm_advantage(torch.tensor([10.0, 2.5, -10.0, 1.0]), adv_clip_max=5.0, advantage_max=1.0)
    assert adv.tolist() == pytest.approx([1.0, 0.5, -1.0, 0.2], rel=1e-6)  # clip at 5, then / 5 * 1
    assert torch.equal(awm_advantage(torch.tensor([7.0]), 5.0, None), torch.tensor([5.0]))
    per, ratio = awm_policy_loss(logp, old, adv, clip_range=0.2)
    expect = []
    for lp, lo, a in zip(logp.tolist(), old.tolist(), adv.double().tolist()):
        r = math.exp(lp - lo)
        expect.append(max(-a * r, -a * min(max(r, 0.8), 1.2)))
    assert per.tolist() == pytest.approx(expect, rel=1e-12)
    assert ratio.tolist() == pytest.approx([math.exp(0.5), math.exp(-0.5), math.exp(0.5), 1.0], rel=1e-12)


def test_on_policy_gradient_is_the_advantage_weighted_matching_gradient():
    """logp_old = logp (first mini-batch): r = 1 and d loss / d v = A' dW/dv, the weighted flow-matching gradient."""
    v, eps, x0, t = _fixed()
    v = v.double().requires_grad_(True)
    adv = torch.tensor([0.5, -1.0, 0.25], dtype=torch.float64)
    logp = weighted_log_prob(matching_error(v, eps, x0), t, "t")
    per, ratio = awm_policy_loss(logp, logp.detach(), adv, clip_range=1.0)
    assert torch.equal(ratio, torch.ones(3, dtype=torch.float64))
    (g,) = torch.autograd.grad(per.sum(), v)
    n = v[0].numel()
    expect = adv.view(-1, 1, 1, 1) * t.double().view(-1, 1, 1, 1) * 2 * (v - (eps.double() - x0.double())) / n
    assert torch.allclose(g, expect.detach(), rtol=1e-12, atol=0)


def test_time_draws_stratify_the_grid():
    sig = torch.linspace(1, 0, 15)  # 14 steps
    g = torch.Generator().manual_seed(0)
    times = MatchingTimes(timesteps=6, time_sampling="discrete_wo_init", timestep_fraction=0.9)
    t = draw_times(g, times, sig)
    idx = [int(torch.isclose(sig, x).nonzero()) for x in t]  # grid indices: one per stratum of [1, 12)
    bounds = torch.linspace(1, 12, 7).long().tolist()
    assert [bounds[i] <= k < max(bounds[i + 1], bounds[i] + 1) for i, k in enumerate(idx)] == [True] * 6
    t0 = draw_times(g, times.model_copy(update={"time_sampling": "discrete"}), sig)
    assert all(0 < x <= 1 for x in t0.tolist())
    ln = draw_times(g, times.model_copy(update={"time_sampling": "logit_normal", "timesteps": 4}), sig)
    assert ln.shape == (4,) and all(0.01 <= x < 1 for x in ln.tolist())


def test_ema_kl_decay_clocks():
    """The authors: min(0.3, 0.001 x optimizer steps taken); Flow-Factory: min(0.3, 0.3 / 1000 x iteration index)."""
    awm = AWMConfig()
    assert [ema_kl_decay(awm, k, k - 1) for k in (1, 150, 300, 301, 5000)] == pytest.approx([1e-3, 0.15, 0.3, 0.3, 0.3])
    ff = AWMConfig(ema_kl_decay_rate=0.3 / 1000, ema_kl_clock="iterations")
    assert [ema_kl_decay(ff, 7 * k + 7, k) for k in (0, 1, 500, 1000, 4000)] == pytest.approx(
        [0.0, 3e-4, 0.15, 0.3, 0.3]
    )
    assert ema_kl_decay(AWMConfig(ema_kl_decay_type="constant"), 1, 0) == 0.3


def test_one_iteration_counts_forwards_and_keeps_ratio_one(recipe_config):
    from flowgrpo.t2i import train_t2i

    cfg = recipe_config(
        "awm", "iterations=1", "group_size=4", "awm.timesteps=2", "train.mini_batches=2", "artifacts.grid_every=0"
    )
    (r,) = train_t2i(cfg)
    n = cfg.prompts_per_iteration * cfg.group_size  # every sample kept (the KL terms are on)
    T = cfg.awm.timesteps
    assert r["awm/samples"] == n and r["optimizer_steps"] == 2
    assert r["nfe_grad"] == n * T  # one forward with grad per (sample, time)
    # rollout + reference + EMA forwards for every term + the rollout weights' logp of the second mini-batch's terms
    assert r["nfe_nograd"] == r["rollout_nfe_nograd"] + 2 * n * T + n // 2 * T
    assert r["backward_passes"] == 2 * T  # one micro-batch per mini-batch here, one backward per time
    assert r["ratio/min"] > 0.5 and r["ratio/max"] < 2.0


@pytest.mark.heavy
def test_awm_learns(tmp_path):
    m = learning_margin("awm", tmp_path, iterations=16)
    assert m["first_learn"] == pytest.approx(m["first_still"], abs=1e-7), m
    assert m["gain"] > 4.0 * m["noise"] and m["gain"] > 0, m
