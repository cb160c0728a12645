"""Advantages conditioned on a split of each group: CANON (halves by entropy or length) and Stratified GRPO
(strata by a structural key).

CANON (conditional advantage estimation), read from biuboomc/CANON @ 7d6f814fb71f3d6a30e5312f68973c5207bd142c,
verl/trainer/ppo/core_algos.py: `compute_dr_length_on_mean_group_outcome_advantage` (metric length),
`compute_dr_entropy_per_token_group_outcome_advantage` (metric entropy), the `..._cosine_with_restart_...`
and `..._annel_...` variants (schedules) and `cosine_annealing_with_restart`.

Stratified GRPO (SAN; "Stratified GRPO: Handling Structural Heterogeneity in RL of LLM Search Agents"), read from Wodlfvllf/grpo-composer @ 2c98d7e,
grpo_composer/core/advantages/stratified.py `StratifiedAdvantageFunction.compute_advantages`; the paper's blend
weight alpha and stratum scope are unverified (docs/text_trainer.md).
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
from torch import Tensor

from .advantages import ESTIMATORS, _sample_result
from .contracts import AdvantageResult, GroupBatch, given
from .offpolicy import add_presets
from .stats import masked_count, masked_mean, masked_std

SCHEDULES = ("constant", "cosine_restart", "batch_accuracy")


def cosine_restart(step: int, *, high: float, low: float, warmup: int, total: int, cycles: int) -> float:
    """CANON's `cosine_annealing_with_restart`: linear warm-up to `high` over `warmup` steps, then `cycles`
    cosine decays from `high` to `low`, each (total - warmup) // cycles steps long."""
    if step < warmup:
        return high * (step + 1) / warmup
    length = max((total - warmup) // cycles, 1)
    phase = (step - warmup) % length
    return low + 0.5 * (high - low) * (1 + math.cos(math.pi * phase / length))


def canon_inter_weight(batch: GroupBatch, r: Tensor, ok: Tensor, settings: dict[str, Any]) -> float:
    """The weight lambda of the inter-half comparison (1 - lambda: the intra-half one) by the schedule."""
    schedule = settings["schedule"]
    if schedule == "constant":
        return float(settings["lam"])
    if schedule == "batch_accuracy":  # the `annel` variant: lambda = the batch's mean reward
        return float(r[ok].mean()) if bool(ok.any()) else 0.0
    if schedule != "cosine_restart":
        raise ValueError(f"schedule: expected one of {SCHEDULES}, got {schedule!r}")
    step = given(batch.step, "GroupBatch.step (CANON's cosine_restart schedule)")
    c = cosine_restart(
        step,
        high=settings["sched_high"],
        low=settings["sched_low"],
        warmup=settings["warmup_steps"],
        total=settings["total_steps"],
        cycles=settings["cycles"],
    )
    return c if settings["scheduled"] == "inter" else 1.0 - c


@ESTIMATORS.register("canon")
def canon(
    batch: GroupBatch,
    *,
    metric: str = "entropy",
    lam: float = 1.0,
    alpha: float = 1.0,
    beta: float = 0.0,
    max_length: float = 8192.0,
    schedule: str = "constant",
    scheduled: str = "intra",
    sched_high: float = 0.6,
    sched_low: float = 0.0,
    warmup_steps: int = 30,
    total_steps: int = 150,
    cycles: int = 3,
) -> AdvantageResult:
    """CANON: split each group at the median of a metric (mean token entropy or length) into a low and a high
    half; A_i = [lam (r_i - mean of the other half) + (1 - lam) (r_i - mean of its own half)] / max_length.

    alpha scales one side and beta adds a bias, as the source places them per metric (alpha = 1, beta = 0:
    neutral). lam: constant, the batch's mean reward (batch_accuracy), or a cosine with restarts over the
    training step (cosine_restart: its value is the `scheduled` half's weight, from sched_high down to sched_low).
    Groups with fewer than two usable samples get A = 0.
    """
    if metric not in ("entropy", "length"):
        raise ValueError(f"metric: expected 'entropy' or 'length', got {metric!r}")
    r = batch.scalar_rewards()
    ok = batch.usable(r)
    key = given(batch.entropy if metric == "entropy" else batch.lengths, f"GroupBatch.{metric} (CANON)").float()
    settings = dict(
        lam=lam, schedule=schedule, scheduled=scheduled, sched_high=sched_high, sched_low=sched_low,
        warmup_steps=warmup_steps, total_steps=total_steps, cycles=cycles,
    )  # fmt: skip
    lam_t = canon_inter_weight(batch, r, ok, settings)
    n = masked_count(ok, dim=1)
    order = torch.sort(torch.where(ok, key, torch.full_like(key, math.inf)), dim=1, stable=True).indices
    rank = torch.empty_like(order).scatter_(1, order, torch.arange(key.shape[1]).expand_as(order).contiguous())
    high = ok & (rank >= n // 2)
    low = ok & ~high
    mean_low, mean_high = masked_mean(r, low, dim=1), masked_mean(r, high, dim=1)
    if metric == "length":  # source: alpha on the high half's own reward / on the low half's other mean
        inter_high = alpha * r - mean_low + beta
        inter_low = r - alpha * mean_high - beta
    else:  # entropy: alpha on the other mean for the high half / on the own reward for the low half
        inter_high = r - alpha * mean_low + beta
        inter_low = alpha * r - mean_high - beta
    adv_high = lam_t * inter_high + (1 - lam_t) * (r - mean_high)
    adv_low = lam_t * inter_low + (1 - lam_t) * (r - mean_low)
    adv = torch.where(high, adv_high, adv_low) / max_length
    return _sample_result(adv, ok & (n >= 2), batch, **{"canon/inter_weight": lam_t})


def reads_entropy(estimator: str, settings: dict[str, Any]) -> bool:
    """Whether the estimator needs GroupBatch.entropy (the trainer then scores the rollout before the advantages)."""
    return estimator == "canon" and settings.get("metric", "entropy") == "entropy"


@ESTIMATORS.register("stratified_grpo")
def stratified_grpo(
    batch: GroupBatch, *, stratum_head: Optional[str] = None, alpha: float = 1.0, eps: float = 1e-8
) -> AdvantageResult:
    """Stratified GRPO (SAN): z-score within each stratum of a group, blended alpha SAN + (1 - alpha) group z-score.

    The stratum of a sample is the value of the reward head `stratum_head` (a reward function that returns a
    structural key, e.g. the number of searches; give it weight 0 so it adds nothing to the reward); NaN keys
    form one stratum. Unbiased std, as the source; a stratum of one sample gets A_SAN = 0 (the source: NaN).
    """
    names = list(given(batch.reward_names, "GroupBatch.reward_names"))
    if stratum_head is None or stratum_head not in names:
        raise ValueError(f"stratified_grpo: stratum_head must name a reward head, one of {names}; got {stratum_head!r}")
    r = batch.scalar_rewards()
    ok = batch.usable(r)
    keys = torch.nan_to_num(batch.head_rewards()[..., names.index(stratum_head)].float(), nan=math.inf)
    gn = (r - masked_mean(r, ok, dim=1)) / (masked_std(r, ok, dim=1, unbiased=True) + eps)
    san = torch.zeros_like(r)
    same = ok.unsqueeze(2) & ok.unsqueeze(1) & (keys.unsqueeze(2) == keys.unsqueeze(1))  # [P, G, G]
    for g in range(r.shape[1]):  # sample g's stratum statistics (G is small: a group)
        members = same[:, g, :]
        mu = masked_mean(r, members, dim=1).squeeze(1)
        sd = masked_std(r, members, dim=1, unbiased=True).squeeze(1)
        single = members.sum(1) < 2
        san[:, g] = torch.where(single, torch.zeros_like(mu), (r[:, g] - mu) / (sd + eps))
    strata = float(sum(len(torch.unique(keys[p][ok[p]])) for p in range(r.shape[0])))
    return _sample_result(alpha * san + (1 - alpha) * gn, ok, batch, **{"stratified/strata": strata})


# CANON's runs (scripts/setups.sh of the source): clip 0.2 / 0.28, verl's seq-mean-token-sum (the advantage
# carries the 1 / max_length)
add_presets(
    {"canon": {"bounds": {"name": "asymmetric", "eps_low": 0.2, "eps_high": 0.28}, "aggregation": "seq_mean_token_sum"}}
)
