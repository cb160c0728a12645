"""DiffusionNFT: the forward-process objective, and the old policy's soft update.

Rollouts come from the old policy (LoRA adapter "old") with any sampler; only clean samples x0 are kept.
For a sample with optimality probability r in [0, 1] (the `nft_optimality` transform of its advantage)
and a noised x_t = (1 - t) x0 + t eps:
    v+ = beta v_theta + (1 - beta) v_old         v- = (1 + beta) v_old - beta v_theta
    L  = adv_max * mean_batch( r * L(v+) / beta + (1 - r) * L(v-) / beta ) + kl_coef * |v_theta - v_ref|^2
where L(v) = mean|x0_hat(v) - x0|^2 / sg(max(mean|x0_hat(v) - x0|, 1e-5)), x0_hat(v) = x_t - t v (adaptive
weighting; the weight in float64, floored at 1e-5, as NVlabs/DiffusionNFT scripts/train_nft_sd3.py).
"""

from __future__ import annotations

import torch
from torch import Tensor


def _adaptive_x0_loss(x0_hat: Tensor, x0: Tensor) -> Tensor:
    err = (x0_hat - x0).flatten(1)
    weight = err.detach().double().abs().mean(1).clamp_min(1e-5).float()
    return (err**2).mean(1) / weight


def nft_loss(v_theta: Tensor, v_old: Tensor, x_t: Tensor, x0: Tensor, t: Tensor, r: Tensor, *,
             beta: float, adv_max: float) -> Tensor:
    """Per-sample NFT policy loss [B] (fp32). t, r: [B]."""
    v_theta, v_old, x_t, x0 = v_theta.float(), v_old.float(), x_t.float(), x0.float()
    tt = t.float().view(-1, *([1] * (x0.dim() - 1)))
    v_pos = beta * v_theta + (1 - beta) * v_old
    v_neg = (1 + beta) * v_old - beta * v_theta
    loss_pos = _adaptive_x0_loss(x_t - tt * v_pos, x0)
    loss_neg = _adaptive_x0_loss(x_t - tt * v_neg, x0)
    return adv_max * (r * loss_pos / beta + (1 - r) * loss_neg / beta)


def old_decay(steps: int, kind: str) -> float:
    """lambda of theta_old <- lambda theta_old + (1 - lambda) theta, after `steps` optimizer steps in all.

    The release's return_decay(global_step, decay_type): global_step counts optimizer steps, this
    epoch's included (decay types 1 = linear, 2 = delayed, 0 = on_policy).
    """
    if kind == "on_policy":
        return 0.0
    if kind == "linear":
        return min(0.001 * steps, 0.5)
    if kind == "delayed":  # the release's OCR schedule
        return 0.0 if steps < 75 else min(0.0075 * (steps - 75), 0.999)
    raise ValueError(f"nft.decay: expected on_policy, linear or delayed, got {kind!r}")


@torch.no_grad()
def soft_update(old: list[Tensor], new: list[Tensor], decay: float) -> None:
    for o, n in zip(old, new):
        o.mul_(decay).add_(n.detach().to(o.dtype), alpha=1 - decay)
