"""Summary statistics and run comparison, numpy only.

- Non-finite scores (NaN = could not score) are counted and left out of every statistic.
- std is the sample standard deviation (ddof = 1; NaN for fewer than two values).
- The confidence interval of a mean is a percentile bootstrap: `resamples` resamples of the n values
  with replacement, drawn as `numpy.random.default_rng(seed).integers(0, n, size=(resamples, n))`,
  and the (1 - c)/2 and (1 + c)/2 quantiles (numpy's default linear rule) of the resampled means.
  One value gives [v, v]; none gives NaN.
- A comparison matches run A and run B by (prompt, index). Per scorer, over pairs where both scores
  are finite: mean difference = mean(B - A) (with the bootstrap interval of that mean), and the win
  rate = the fraction of pairs where B scores higher than A, ties counting 0.5.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

CI_METHOD = "percentile bootstrap of the mean"
_MAX_DRAWS = 4_000_000  # resampled values held at once; larger problems are drawn in row chunks


def finite(values) -> np.ndarray:
    values = np.asarray(values, dtype=np.float64)
    return values[np.isfinite(values)]


def bootstrap_ci(values, confidence: float = 0.95, resamples: int = 2000, seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean of the finite `values` (see the module docstring)."""
    x = finite(values)
    n = len(x)
    if n == 0:
        return (float("nan"), float("nan"))
    if n == 1:
        return (float(x[0]), float(x[0]))
    rng = np.random.default_rng(seed)
    rows = max(1, _MAX_DRAWS // n)
    means = np.concatenate(
        [x[rng.integers(0, n, size=(min(rows, resamples - r), n))].mean(axis=1) for r in range(0, resamples, rows)]
    )
    alpha = (1.0 - confidence) / 2.0
    lo, hi = np.quantile(means, [alpha, 1.0 - alpha])
    return (float(lo), float(hi))


def describe(values, confidence: float = 0.95, resamples: int = 2000, seed: int = 0) -> dict[str, float | int]:
    """mean, std (ddof 1), count (finite), nan_count, ci_low / ci_high, min, median, max."""
    values = np.asarray(values, dtype=np.float64)
    x = finite(values)
    n = len(x)
    lo, hi = bootstrap_ci(x, confidence, resamples, seed)
    nan = float("nan")
    return {
        "mean": float(x.mean()) if n else nan,
        "std": float(x.std(ddof=1)) if n > 1 else nan,
        "count": int(n),
        "nan_count": int(values.size - n),
        "ci_low": lo,
        "ci_high": hi,
        "min": float(x.min()) if n else nan,
        "median": float(np.median(x)) if n else nan,
        "max": float(x.max()) if n else nan,
    }


def match(keys_a: Sequence[tuple], keys_b: Sequence[tuple]) -> tuple[np.ndarray, np.ndarray]:
    """Indices (ia, ib) of the keys present in both runs, in run B's order."""
    where_a = {k: i for i, k in enumerate(keys_a)}
    pairs = [(where_a[k], j) for j, k in enumerate(keys_b) if k in where_a]
    ia = np.array([p[0] for p in pairs], dtype=np.int64)
    ib = np.array([p[1] for p in pairs], dtype=np.int64)
    return ia, ib


def win_rate(a, b) -> float:
    """Fraction of pairs where b > a, ties 0.5, over pairs where both are finite (NaN if none)."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    ok = np.isfinite(a) & np.isfinite(b)
    if not ok.any():
        return float("nan")
    a, b = a[ok], b[ok]
    return float(np.mean(np.where(b > a, 1.0, np.where(b == a, 0.5, 0.0))))


def compare_scores(a, b, confidence: float = 0.95, resamples: int = 2000, seed: int = 0) -> dict[str, float | int]:
    """Paired comparison of matched scores a (run A) and b (run B)."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    ok = np.isfinite(a) & np.isfinite(b)
    diff = b[ok] - a[ok]
    lo, hi = bootstrap_ci(diff, confidence, resamples, seed)
    nan = float("nan")
    return {
        "mean_a": float(a[ok].mean()) if ok.any() else nan,
        "mean_b": float(b[ok].mean()) if ok.any() else nan,
        "mean_diff": float(diff.mean()) if ok.any() else nan,
        "diff_ci_low": lo,
        "diff_ci_high": hi,
        "win_rate": win_rate(a, b),
        "pairs": int(ok.sum()),
        "nan_pairs": int((~ok).sum()),
    }


def describe_preferences(p) -> dict[str, float | int]:
    """A pairwise scorer's P(B beats A) over matched pairs: mean and how many could be scored."""
    p = np.asarray(p, dtype=np.float64)
    x = finite(p)
    return {
        "mean_p_b_beats_a": float(x.mean()) if len(x) else float("nan"),
        "pairs": int(len(x)),
        "nan_pairs": int(p.size - len(x)),
    }
