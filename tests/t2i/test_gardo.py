"""GARDO (flowgrpo/t2i/gardo.py, gardo_methods.py): uncertainty gate, risk controller, diversity-aware advantage and
reference schedule against float64 re-derivations; one iteration of each plug-in; the learning runs (heavy)."""

import math

import pytest
import torch

from flowgrpo.t2i.gardo import (
    GardoConfig,
    ReferenceSchedule,
    RiskController,
    RiskControllerConfig,
    ThresholdAdapt,
    gardo_advantages,
    gate,
    uncertainty,
)

from .learning_runs import learning_margin


def _ranks(xs):
    order = sorted(range(len(xs)), key=lambda i: (-xs[i], i))
    out = [0.0] * len(xs)
    for r, i in enumerate(order, 1):
        out[i] = float(r)
    return out


def _percentile(xs, q):  # numpy's linear percentile, q in [0, 100]
    s = sorted(xs)
    pos = (len(s) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def test_uncertainty_and_gate_match_the_release_rederived():
    main = [0.9, 0.1, 0.5, 0.7, 0.3, 0.8]
    aes = [0.2, 0.9, 0.5, 0.1, 0.4, 0.8]
    ir = [0.3, 0.8, 0.6, 0.2, 0.1, 0.9]
    u = uncertainty(torch.tensor(main), torch.tensor([aes, ir]).T)
    rm, ra, ri = _ranks(main), _ranks(aes), _ranks(ir)
    expect = [rm[i] - (ra[i] + ri[i]) / 2 for i in range(6)]
    assert u.tolist() == expect
    mask, thr = gate(u, 0.3)
    pos = [x for x in expect if x >= 0]
    assert thr == pytest.approx(_percentile(pos, 100 - 30))
    assert mask.tolist() == [x > thr for x in expect]


def test_risk_controller_follows_the_release():
    c = RiskController(RiskControllerConfig(window=3), 0.1)
    seq = [c.update(m) for m in (1.0, 2.0, 0.5, 0.7, 3.0, 3.5, 3.6)]
    f = [0.1]
    f.append(0.1 * 1.1)  # 2.0 > max(1.0)
    f.append(f[-1] * 0.9)  # 0.5 < min(1, 2)
    f.append(f[-1])  # 0.7 within [0.5, 2]
    f.append(f[-1] * 1.1)  # 3.0 > max(2, .5, .7)
    f.append(f[-1] * 1.1)  # 3.5 > max(.5, .7, 3)
    f.append(min(f[-1] * 1.1, 0.2))  # capped at 0.2
    assert seq == pytest.approx(f)
    assert c.buffer == [3.0, 3.5, 3.6]  # the last `window` means


def test_diversity_aware_advantage_matches_a_float64_rederivation():
    g = torch.Generator().manual_seed(0)
    rewards = torch.tensor([[0.2, 0.8, 0.5, 0.9], [0.1, float("nan"), 0.4, 0.3]])
    feats = torch.randn(2, 4, 5, generator=g, dtype=torch.float64)
    adv = gardo_advantages(rewards, feats)

    def unit(v):
        n = math.sqrt(sum(x * x for x in v))
        return [x / n for x in v]

    for p in range(2):
        ok = [i for i in range(4) if not math.isnan(float(rewards[p, i]))]
        r = {i: float(rewards[p, i]) for i in ok}
        mean_r = sum(r.values()) / len(ok)
        f = {i: unit(feats[p, i].tolist()) for i in ok}
        d = {i: min(1 - max(-1.0, min(1.0, sum(a * b for a, b in zip(f[i], f[j])))) for j in ok if j != i) for i in ok}
        mean_d = sum(d.values()) / len(ok)
        for i in range(4):
            if i not in ok:
                assert float(adv[p, i]) == 0.0
                continue
            w = 1.0 if r[i] - mean_r < 0 else d[i] / mean_d
            assert float(adv[p, i]) == pytest.approx((r[i] - mean_r) * w, rel=1e-12, abs=1e-15)
    plain = gardo_advantages(rewards[:1], None)
    assert plain[0].tolist() == pytest.approx([0.2 - 0.6, 0.2, -0.1, 0.3])  # no std division


def test_reference_schedule_resets_and_adapts_its_threshold():
    s = ReferenceSchedule(GardoConfig(reset_every=15, kl_threshold=0.15, kl_threshold_adapt=ThresholdAdapt()))
    assert not s.due(0)
    s.observe([0.1, 0.2])  # a step above 0.15 flags a reset
    assert s.due(1) and s.threshold == pytest.approx(0.05)  # gap 1 < 5: min(0.15 + 0.01, 0.05), the release's
    assert not s.due(2)
    assert not s.due(16) and s.due(17)  # gap 16 > 15: reset, threshold max(0.05 - 0.01, 0.1)
    assert s.threshold == pytest.approx(0.1) and s.last == 17
    s.load_state_dict(dict(s.state_dict(), flagged=True))
    assert s.due(18)


def test_one_grpo_gardo_iteration(recipe_config):
    from flowgrpo.t2i import train_t2i

    cfg = recipe_config(
        "gardo", "iterations=2", "group_size=4", "train.mini_batches=2", "gardo.kl_threshold=1e-12",
        "artifacts.grid_every=0",
    )  # fmt: skip
    r1, r2 = train_t2i(cfg)
    for r in (r1, r2):
        assert r["check/first_pass_ratio_dev"] < 1e-4 and r["optimizer_steps"] == 2
        assert 0 < r["gardo/gated_fraction"] <= 0.25  # at most the controller's fraction of the positive u's
        assert r["nfe_grad"] == r["edges/trained"]
        ref_rows = r["nfe_nograd"] - r["rollout_nfe_nograd"]  # the reference ran on the gated edges only
        assert 0 < ref_rows < r["edges/trained"]
    # the second step's KL (after one update) beats the threshold: a reset before iteration 2
    assert r1["gardo/reset"] == 0.0 and r1["gardo/step_kl_max"] > 1e-12 and r2["gardo/reset"] == 1.0


def test_one_nft_gardo_iteration(recipe_config):
    from flowgrpo.t2i import train_t2i

    cfg = recipe_config("gardo_nft", "iterations=1", "group_size=4", "artifacts.grid_every=0")
    (r,) = train_t2i(cfg)
    old_rows = r["nfe_grad"]  # the old policy runs on every trained row
    ref_rows = r["nfe_nograd"] - r["rollout_nfe_nograd"] - old_rows
    assert 0 < ref_rows <= old_rows  # gated rows (every row of a micro-batch without gated ones)
    assert r["gardo/kl_threshold"] == 0.005 and 0 <= r["nft/mean_r"] <= 1


@pytest.mark.heavy
def test_grpo_gardo_learns(tmp_path):
    # 12 iterations: the gain is 15 standard errors there (12 at 16 iterations), well past the margin of 4
    m = learning_margin("gardo", tmp_path, iterations=12)
    assert m["first_learn"] == pytest.approx(m["first_still"], abs=1e-7), m
    assert m["gain"] > 4.0 * m["noise"] and m["gain"] > 0, m
