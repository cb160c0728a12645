"""Summary statistics, bootstrap intervals, matching and win rates against numpy and hand-computed values."""

import math

import numpy as np
import pytest

from flowgrpo.evaluation.stats import bootstrap_ci, compare_scores, describe, match, win_rate


def test_describe_matches_numpy_and_counts_nan():
    rng = np.random.default_rng(3)
    values = rng.normal(2.0, 1.5, size=57)
    values[[4, 9, 30]] = np.nan
    s = describe(values, confidence=0.9, resamples=500, seed=7)
    x = values[np.isfinite(values)]
    assert s["count"] == 54 and s["nan_count"] == 3
    assert s["mean"] == pytest.approx(np.nanmean(values), abs=1e-12)
    assert s["std"] == pytest.approx(np.nanstd(values, ddof=1), abs=1e-12)
    assert s["median"] == pytest.approx(np.nanmedian(values))
    assert (s["min"], s["max"]) == (pytest.approx(x.min()), pytest.approx(x.max()))
    # The documented bootstrap, recomputed with numpy: same draws, same quantiles.
    draws = np.random.default_rng(7).integers(0, 54, size=(500, 54))
    lo, hi = np.quantile(x[draws].mean(axis=1), [0.05, 0.95])
    assert (s["ci_low"], s["ci_high"]) == (pytest.approx(lo, abs=1e-12), pytest.approx(hi, abs=1e-12))
    assert s["ci_low"] < s["mean"] < s["ci_high"]


def test_bootstrap_interval_agrees_with_the_normal_interval_for_large_samples():
    x = np.random.default_rng(0).normal(0.0, 2.0, size=2000)
    lo, hi = bootstrap_ci(x, 0.95, 4000, seed=1)
    half = 1.96 * x.std(ddof=1) / math.sqrt(len(x))
    assert hi - lo == pytest.approx(2 * half, rel=0.1)
    assert (lo + hi) / 2 == pytest.approx(x.mean(), abs=0.1 * half)
    # seeded: the same interval again, another seed another interval
    assert bootstrap_ci(x, 0.95, 4000, seed=1) == (lo, hi)
    assert bootstrap_ci(x, 0.95, 4000, seed=2) != (lo, hi)


def test_bootstrap_chunked_draws_stay_valid(monkeypatch):
    import flowgrpo.evaluation.stats as stats

    x = np.random.default_rng(5).random(300)
    monkeypatch.setattr(stats, "_MAX_DRAWS", 1000)  # 3 resamples per chunk
    lo, hi = stats.bootstrap_ci(x, 0.95, 200, seed=0)
    half = 1.96 * x.std(ddof=1) / math.sqrt(len(x))
    assert lo < x.mean() < hi and hi - lo == pytest.approx(2 * half, rel=0.3)


def test_degenerate_samples():
    assert bootstrap_ci([3.5]) == (3.5, 3.5)
    assert all(math.isnan(v) for v in bootstrap_ci([np.nan, np.nan]))
    s = describe([np.nan, 1.0])
    assert s["count"] == 1 and s["nan_count"] == 1 and s["mean"] == 1.0 and math.isnan(s["std"])
    empty = describe([])
    assert empty["count"] == 0 and math.isnan(empty["mean"])


def test_win_rate_and_mean_difference_by_hand():
    a = np.array([1.0, 2.0, 3.0, 4.0, np.nan, 7.0])
    b = np.array([2.0, 2.0, 1.0, 6.0, 5.0, np.nan])
    # finite pairs: win, tie, loss, win -> (1 + 0.5 + 0 + 1) / 4; differences 1, 0, -2, 2 -> mean 0.25
    assert win_rate(a, b) == 0.625
    assert win_rate(b, a) == 0.375
    c = compare_scores(a, b, resamples=300)
    assert c["win_rate"] == 0.625 and c["mean_diff"] == 0.25
    assert c["mean_a"] == 2.5 and c["mean_b"] == 2.75
    assert c["pairs"] == 4 and c["nan_pairs"] == 2
    assert c["diff_ci_low"] <= 0.25 <= c["diff_ci_high"]
    assert math.isnan(win_rate([np.nan], [1.0]))


def test_match_by_prompt_and_index():
    keys_a = [("cat", 0), ("cat", 1), ("dog", 0), ("fox", 0)]
    keys_b = [("dog", 0), ("cat", 1), ("cow", 0), ("cat", 0)]
    ia, ib = match(keys_a, keys_b)
    assert ia.tolist() == [2, 1, 0] and ib.tolist() == [0, 1, 3]
