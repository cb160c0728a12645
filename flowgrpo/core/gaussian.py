"""Gaussian transition log-probs in the convention every flow-RL code uses: the mean over latent dims."""

from __future__ import annotations

import math

import torch
from torch import Tensor


def _per_sample(t: Tensor | float, like: Tensor) -> Tensor:
    t = torch.as_tensor(t, dtype=like.dtype, device=like.device)
    return t.reshape(t.shape + (1,) * (like.dim() - t.dim())) if t.dim() else t


def gaussian_logprob(x: Tensor, mean: Tensor, std: Tensor | float) -> Tensor:
    """log N(x; mean, std^2 I), averaged over every dim but the first; computed in float32.

    `std` is a scalar or one value per sample ([B]).
    """
    x, mean = x.float(), mean.float()
    s = _per_sample(std, x).float()
    var2 = 2 * s**2
    if var2.requires_grad:
        per_dim = -((x - mean) ** 2) / var2 - torch.log(s) - 0.5 * math.log(2 * math.pi)
    else:
        # the same operations in the same order, the last four in place: each new latent-sized tensor costs
        # more than its arithmetic here (none of them is saved for backward: pow saves its input)
        per_dim = ((x - mean) ** 2).neg_().div_(var2).sub_(torch.log(s)).sub_(0.5 * math.log(2 * math.pi))
    return per_dim.flatten(1).mean(1)


def mean_sqdist(a: Tensor, b: Tensor) -> Tensor:
    """mean over latent dims of (a - b)^2, one value per sample (GRPO-Guard bias, Gaussian KL)."""
    return ((a.float() - b.float()) ** 2).flatten(1).mean(1)
