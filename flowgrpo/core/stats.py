"""Masked statistics along one axis. Entries where `mask` is False do not count."""

from __future__ import annotations

import torch
from torch import Tensor


def masked_count(mask: Tensor, dim: int) -> Tensor:
    return mask.sum(dim=dim, keepdim=True)


def masked_mean(x: Tensor, mask: Tensor, dim: int) -> Tensor:
    """Mean over `dim` (kept); 0 where nothing is valid.

    Summed relative to one valid entry (the largest), so the mean of a constant group is that constant
    exactly: a plain float32 sum / n is off by an ulp, which `(x - mean) / (std + eps)` turns into a
    spurious advantage (0.02 for a constant group of PickScore-sized rewards).
    """
    n = masked_count(mask, dim)
    shift = torch.where(mask, x, torch.full_like(x, -torch.inf)).amax(dim=dim, keepdim=True)
    shift = torch.where(n > 0, shift, torch.zeros_like(shift))
    total = torch.where(mask, x - shift, torch.zeros_like(x)).sum(dim=dim, keepdim=True)
    return shift + total / n.clamp_min(1)


def masked_std(x: Tensor, mask: Tensor, dim: int, unbiased: bool) -> Tensor:
    """Std over `dim` (kept); 0 where fewer than two entries are valid."""
    n = masked_count(mask, dim)
    mean = masked_mean(x, mask, dim)
    sq = torch.where(mask, (x - mean) ** 2, torch.zeros_like(x)).sum(dim=dim, keepdim=True)
    var = sq / (n - int(unbiased)).clamp_min(1)
    return torch.where(n >= 2, var.sqrt(), torch.zeros_like(var))


def masked_median(x: Tensor, mask: Tensor, dim: int) -> tuple[Tensor, Tensor]:
    """Lower median over `dim` (kept) and the index of the element that is the median."""
    values, index = torch.where(mask, x, torch.full_like(x, float("nan"))).nanmedian(dim=dim, keepdim=True)
    return torch.nan_to_num(values, nan=0.0), index


def zscore(x: Tensor, mask: Tensor, dim: int, eps: float, unbiased: bool) -> Tensor:
    """(x - mean) / (std + eps) over `dim`; 0 where `mask` is False."""
    out = (x - masked_mean(x, mask, dim)) / (masked_std(x, mask, dim, unbiased) + eps)
    return torch.where(mask, out, torch.zeros_like(out))


def whole_batch_std(x: Tensor, mask: Tensor, unbiased: bool) -> Tensor:
    """One std over every valid entry of the batch (a 0-d tensor)."""
    return masked_std(x.reshape(-1), mask.reshape(-1), dim=0, unbiased=unbiased).squeeze(0)
