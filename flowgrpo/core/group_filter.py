"""Saturated groups: Edit-R1's group mask and prompt ban, as parts any method can use.

Edit-R1 (PKU-YuanGroup/Edit-R1@4217f25: scripts/train_nft_qwen_image_edit.py, flow_grpo/stat_tracking.py) gives each
prompt of a step the mean and the biased std (np.std) of its rewards (`avg`: the weighted sum of the scorers). A
group enters the loss only when std > 0.05 and mean < 0.9 (`valid_mask`; the loss is a mean over the valid samples),
and a prompt whose group had std < 0.05 and mean > 0.9 is banned: from the next step on the batch sampler
(`DistributedKRepeatSampler`) draws from the prompts not banned, a fresh seeded permutation of them per batch.

Here the mask is `group_keep` (the image trainer's `edges.group_filter`, read by credit.py for grpo and nft.py for
nft) and the ban is the prompt sampler `ban_saturated` (registered in prompt_state.py), which reads each prompt's
latest group mean and std from the run's PromptTable (`rate`, `std`). A banned prompt is never drawn again, so its
latest statistics never change: the ban lasts, and is checkpointed with the table. Both read float64 statistics of
the usable rewards (NaN / inf left out; a group without one is masked and never banned).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
from torch import Tensor

# a GroupBatch (contracts.py) is read by duck type: contracts -> prompt_state -> this module would be a cycle
GroupBatch = Any


def scalar_rewards64(batch: GroupBatch, weights: Optional[Sequence[float]] = None) -> Tensor:
    """The weighted sum of the reward heads [P, G] in float64 (GroupBatch.scalar_rewards rounds to float32), NaN
    where the batch's head NaN policy makes a sample unscored. `weights`: the heads' weights as given (the batch
    holds them in float32), else the batch's."""
    r = batch.head_rewards().double()
    w = torch.as_tensor(weights if weights is not None else batch.weights, dtype=torch.float64)
    nan = torch.isnan(r)
    total = torch.where(nan, torch.zeros_like(r), r * w).sum(-1)
    missing = nan.any(-1) if batch.head_nan_policy == "propagate" else nan.all(-1)
    return torch.where(missing, torch.full_like(total, float("nan")), total)


def group_stats(batch: GroupBatch, weights: Optional[Sequence[float]] = None) -> tuple[Tensor, Tensor]:
    """Each group's mean and biased std (np.std, ddof 0) [P] of its usable rewards, float64; NaN for a group
    without one."""
    r = scalar_rewards64(batch, weights)
    ok = batch.usable(r)
    n = ok.sum(-1).double()
    mean = torch.where(ok, r, torch.zeros_like(r)).sum(-1) / n
    dev = torch.where(ok, r - mean.unsqueeze(-1), torch.zeros_like(r))
    return mean, (dev.square().sum(-1) / n).sqrt()


def group_keep(batch: GroupBatch, min_std: float, max_mean: float, weights: Optional[Sequence[float]] = None) -> Tensor:
    """[P] bool: the groups that enter the loss, std > min_std and mean < max_mean (Edit-R1's `valid_mask`; NaN
    statistics compare False, so a group without a usable reward is left out)."""
    mean, std = group_stats(batch, weights)
    return (std > min_std) & (mean < max_mean)


def saturated(mean: Tensor, std: Tensor, std_below: float, mean_above: float) -> Tensor:
    """Edit-R1's ban rule: std < std_below and mean > mean_above (strict, as `PerPromptStatTracker.update`)."""
    return (std < std_below) & (mean > mean_above)


def banned_rows(table: Any, std_below: float, mean_above: float) -> Tensor:
    """[rows] bool: the prompts of a PromptTable whose latest group met the ban rule (std -1: unknown, as a
    checkpoint written before the column; never banned)."""
    std: Tensor = table["std"]
    seen: Tensor = table["seen"] > 0
    return seen & (std >= 0) & saturated(table["rate"], std, std_below, mean_above)


def ban_saturated(
    table: Any, n: int, draw: int, seed: int, *, std_below: float = 0.05, mean_above: float = 0.9
) -> list[int]:
    """Edit-R1's prompt ban: n rows drawn uniformly without replacement from the prompts whose latest group did not
    have reward std < std_below and mean > mean_above (a fresh seeded permutation per draw, as the published
    sampler); a banned prompt is never drawn again."""
    if table is None:
        raise ValueError("prompt sampler 'ban_saturated' needs the run's prompt state (build_prompt_state)")
    banned = banned_rows(table, std_below, mean_above)
    free = torch.nonzero(~banned).flatten()
    if free.numel() < n:
        raise ValueError(
            f"prompt sampler 'ban_saturated': {int(banned.sum())} of {banned.numel()} prompts are banned (reward "
            f"std < {std_below} and mean > {mean_above}), {free.numel()} remain for a step of {n}: add prompts, lower "
            "prompts_per_iteration or tighten std_below / mean_above"
        )
    # its own stream: independent of the global RNG and of the other samplers' draws (resumes from `draw` alone)
    g = torch.Generator().manual_seed((seed * 1_000_037 + 6_007 * draw + 31_337) % (2**63))
    return [int(i) for i in free[torch.randperm(free.numel(), generator=g)[:n]]]


def filter_metrics(keep: Tensor) -> dict[str, float]:
    """The fraction of a step's groups the mask left out."""
    return {"group_filter/masked_frac": float((~keep).double().mean()) if keep.numel() else 0.0}
