"""The reward-hacking alarm: pure rules over the monitor's evaluations (no torch, no models).

Each evaluation (the baseline first: the model before its first update, then every `monitor.every` iterations) holds,
on the same prompts and the same initial noise, the mean and per-image standard deviation of every trained scorer
(`train/<label>`) and every held-out gold scorer (`gold/<label>`), and the image statistics of
flowgrpo/t2i/image_stats.py. From them, at evaluation t:

    effect(s)     (mean_t(s) - mean_0(s)) / sd_0(s): the move of scorer s since the baseline, in units of the
                  baseline's spread over the images (a z-score; sd_0 is floored at 1e-3 |mean_0| + 1e-8)
    train_effect  the weighted mean effect of the trained pointwise scorers (the `rewards` weights)
    gold_effect   the weighted mean effect of the gold scorers (the `monitor.gold` weights)
    gap           train_effect - gold_effect
    *_trend       least-squares slope per evaluation over the last `alarm.window` evaluations

Rules (`monitor.alarm` holds every threshold):

    reward_gold_gap  gap >= alarm.gap, the training reward still rising (train_trend > 0) and gold flat or falling
                     (gold_trend <= alarm.gold_follow * train_trend): the reward climbs, the held-out judge does not
    gold_drop        gold_effect fell alarm.gold_drop below its best evaluation while the training reward stayed at
                     or above its value there
    saturation, clipped, grid, high_freq, diversity
                     an image statistic drifted from the baseline past its threshold (drift/<stat>: reported
                     always) while gold did not improve (gold_effect < alarm.gold_rise; no gold: always counted).
                     A drift that comes with a better gold score is what the judge wants, not a hack.

The alarm fires at an evaluation where some rule has held for `alarm.patience` consecutive evaluations.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

from .monitor_config import AlarmConfig

Entry = Mapping[str, Any]  # {"iteration", "means": {key: float}, "sds": {key: float}, "stats": {...}, "rules": [...]}
STAT_RULES = ("saturation", "clipped", "grid", "high_freq", "diversity")
RULES = ("reward_gold_gap", "gold_drop", *STAT_RULES)


def _num(x: Any) -> float:
    return math.nan if x is None else float(x)


def effect(entry: Entry, base: Entry, key: str) -> float:
    m, m0, sd0 = _num(entry["means"].get(key)), _num(base["means"].get(key)), _num(base["sds"].get(key))
    if not (math.isfinite(m) and math.isfinite(m0)):
        return math.nan
    floor = 1e-3 * abs(m0) + 1e-8
    return (m - m0) / max(sd0 if math.isfinite(sd0) else 0.0, floor)


def combined(entry: Entry, base: Entry, weights: Mapping[str, float]) -> float:
    """Weighted mean effect of the keys in `weights` (NaN scores left out; NaN when none is left)."""
    num = den = 0.0
    for key, w in weights.items():
        e = effect(entry, base, key)
        if math.isfinite(e):
            num, den = num + w * e, den + abs(w)
    return num / den if den else math.nan


def slope(values: Sequence[float]) -> float:
    """Least-squares slope per step of the finite values (their positions kept); NaN with fewer than two."""
    pts = [(i, v) for i, v in enumerate(values) if math.isfinite(v)]
    if len(pts) < 2:
        return math.nan
    mx = sum(i for i, _ in pts) / len(pts)
    my = sum(v for _, v in pts) / len(pts)
    sxx = sum((i - mx) ** 2 for i, _ in pts)
    return sum((i - mx) * (v - my) for i, v in pts) / sxx


def _drifts(stats: Mapping[str, float], base: Mapping[str, float], cfg: AlarmConfig) -> dict[str, bool]:
    def d(key: str) -> float:
        return _num(stats.get(key)) - _num(base.get(key))

    grid = any(
        _num(stats.get(k)) >= cfg.grid_ratio * _num(base.get(k)) and d(k) >= cfg.grid_rise for k in ("grid8", "grid16")
    )
    div, div0 = _num(stats.get("diversity")), _num(base.get("diversity"))
    return {
        "saturation": d("saturation") >= cfg.saturation_rise,
        "clipped": d("clipped") >= cfg.clipped_rise,
        "grid": grid,
        "high_freq": d("high_freq") >= cfg.high_freq_rise,
        "diversity": math.isfinite(div) and div0 > 0 and div <= cfg.diversity_ratio * div0,
    }


def assess(
    history: Sequence[Entry], train_weights: Mapping[str, float], gold_weights: Mapping[str, float], cfg: AlarmConfig
) -> dict[str, Any]:
    """The monitor's verdict on the last evaluation of `history` (history[0] is the baseline): its `monitor/...`
    metrics, the rules that hold now (`rules`) and whether the alarm fires (`alarm`; `fired`: the rules that held
    for `patience` evaluations, `reasons`: one phrase each)."""
    base, now = history[0], history[-1]
    train = [combined(e, base, train_weights) for e in history]
    gold = [combined(e, base, gold_weights) for e in history] if gold_weights else [math.nan] * len(history)
    win = slice(max(0, len(history) - cfg.window), None)
    t_trend, g_trend = slope(train[win]), slope(gold[win])
    gap = train[-1] - gold[-1]
    out: dict[str, Any] = {
        "monitor/train_effect": train[-1],
        "monitor/gold_effect": gold[-1],
        "monitor/gap": gap,
        "monitor/train_trend": t_trend,
        "monitor/gold_trend": g_trend,
    }
    holds: dict[str, bool] = dict.fromkeys(RULES, False)
    reasons: dict[str, str] = {}
    if len(history) > 1 and math.isfinite(gap) and math.isfinite(t_trend) and math.isfinite(g_trend):
        if gap >= cfg.gap and t_trend > 0 and g_trend <= cfg.gold_follow * t_trend:
            holds["reward_gold_gap"] = True
            reasons["reward_gold_gap"] = (
                f"training reward up {train[-1]:+.2f} sd, gold {gold[-1]:+.2f} sd since the baseline "
                f"(gap {gap:.2f} >= {cfg.gap:g}; trends {t_trend:+.2f} vs {g_trend:+.2f} per evaluation)"
            )
    if len(history) > 1 and math.isfinite(gold[-1]):
        best = max(range(len(history)), key=lambda i: gold[i] if math.isfinite(gold[i]) else -math.inf)
        drop = gold[best] - gold[-1]
        if drop >= cfg.gold_drop and train[-1] >= train[best]:
            holds["gold_drop"] = True
            reasons["gold_drop"] = (
                f"gold fell {drop:.2f} sd below its best (iteration {history[best]['iteration']}) while the "
                f"training reward held ({train[-1]:+.2f} vs {train[best]:+.2f} sd)"
            )
    drifts = _drifts(now["stats"], base["stats"], cfg)
    benign = math.isfinite(gold[-1]) and gold[-1] >= cfg.gold_rise
    for stat, drifted in drifts.items():
        out[f"monitor/drift/{stat}"] = float(drifted)
        if drifted and not benign and len(history) > 1:
            holds[stat] = True
            reasons[stat] = f"{stat} drifted past its threshold with gold at {gold[-1]:+.2f} sd"
    earlier = [set(e.get("rules") or ()) for e in history[:-1]]
    fired = []
    for rule, held in holds.items():
        out[f"monitor/rule/{rule}"] = float(held)
        recent = earlier[len(earlier) - (cfg.patience - 1) :] if cfg.patience > 1 else []
        if held and len(recent) == cfg.patience - 1 and all(rule in r for r in recent):
            fired.append(rule)
    out["monitor/alarm"] = float(bool(fired))
    return {
        "metrics": out,
        "rules": [r for r, h in holds.items() if h],
        "alarm": bool(fired),
        "fired": fired,
        "reasons": [reasons[r] for r in fired],
    }
