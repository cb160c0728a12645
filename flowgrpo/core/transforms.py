"""Advantage transforms, applied in order after the estimator (each selectable by name)."""

from __future__ import annotations

import torch

from .contracts import AdvantageResult, GroupBatch
from .registry import Registry

TRANSFORMS = Registry("advantage transform")


@TRANSFORMS.register("clip")
def clip(result: AdvantageResult, batch: GroupBatch, *, max: float = 5.0) -> AdvantageResult:
    """Clamp advantages to [-max, max] (flow default 5)."""
    result.metrics["adv/clipped_frac"] = float((result.advantages.abs() > max).float().mean())
    result.advantages = result.advantages.clamp(-max, max)
    return result


@TRANSFORMS.register("filter_zero_std")
def filter_zero_std(result: AdvantageResult, batch: GroupBatch, *, tol: float = 0.0) -> AdvantageResult:
    """Weight 0 for every action of a group whose advantages are all (within tol of) zero."""
    live = (result.advantages.abs() > tol) & (result.sample_weight > 0)
    keep = live.flatten(1).any(1).view(-1, *([1] * (result.advantages.dim() - 1)))
    result.metrics["adv/filtered_groups"] = float((~keep).sum())
    result.sample_weight = result.sample_weight * keep.float()
    return result


@TRANSFORMS.register("top_bottom_k")
def top_bottom_k(result: AdvantageResult, batch: GroupBatch, *, k: int = 2) -> AdvantageResult:
    """Keep the k best and k worst samples of each group by advantage (DanceGRPO best-of-N)."""
    if result.level != "sample":
        raise ValueError(f"top_bottom_k: needs sample-level advantages, got {result.level}-level")
    live = result.sample_weight > 0
    adv = result.advantages
    neg_inf = torch.full_like(adv, -torch.inf)
    k_eff = min(k, adv.shape[1])
    top = torch.where(live, adv, neg_inf).topk(k_eff, dim=1).indices
    bottom = torch.where(live, -adv, neg_inf).topk(k_eff, dim=1).indices
    keep = torch.zeros_like(live).scatter_(1, top, True).scatter_(1, bottom, True) & live
    result.sample_weight = result.sample_weight * keep.float()
    return result


@TRANSFORMS.register("nft_optimality")
def nft_optimality(result: AdvantageResult, batch: GroupBatch, *, adv_clip_max: float = 5.0) -> AdvantageResult:
    """DiffusionNFT: map advantages to an optimality probability r = clip(A / A_max / 2 + 1/2, 0, 1).

    Samples that could not be scored get weight 0: r = 0.5 would still train them.
    """
    if result.level == "sample" and batch.rewards is not None:
        scored = batch.usable(batch.scalar_rewards())
        result.sample_weight = result.sample_weight * scored.float()
    result.advantages = (result.advantages / adv_clip_max / 2 + 0.5).clamp(0.0, 1.0)
    return result
