"""Flow-DPPO: PPO's ratio clip replaced by a divergence trust region, a loss part over the GRPO ratio path.

Per trained edge (one Gaussian transition) with ratio r = pi / pi_old, advantage A, transition std s and the
mean-square distance of its new and rollout-time means d = mean_dims (mu - mu_old)^2:
    KL  = d / (2 s^2)     (add_kl_coefficient: true; false: d / 2)
    drop = KL >= kl_threshold and ((r > 1 and A > 0) or (r < 1 and A < 0))
    loss = 0 where drop, else -A r                         (then the configured aggregation, token_mean)
An edge is removed only when it is already far from the rollout policy AND its update pushes it farther;
everything else takes the unclipped policy gradient. The mask carries no gradient.

Sources: verl-project/verl-omni @ a1139ba, verl_omni/trainer/diffusion/diffusion_algos.py FlowDPPOLoss.compute_loss
(sigma_t = std_dev_t * sqrt_dt: the transition std, our `std`); Tencent-Hunyuan/UniRL @ 1a7b501,
unirl/algorithms/flowdppo.py _flowdppo_kl_adv_loss (the same mask; kl_mask_threshold 1e-5,
add_kl_coefficient true in examples/diffusion/sd3_flowdppo.yaml). UniRL's `_compute_sigma_t` recomputes sigma_t
with sigma clamped at 0.99, which differs from its kernel's std (and ours, and verl-omni's) at sigma = 1 only.

Why a loss part and not a method: both implementations reuse Flow-GRPO's rollout (SDE), re-scored log-probs
and old means unchanged and differ only in the per-action surrogate, so `flow_dppo` is a surrogate in
flowgrpo.core's registry that `method: grpo` trains: the image objective hands it the rollout-time means because
the surrogate declares it reads them (flowgrpo.t2i.objectives.reads_old_means). The bounds part is not
used by this surrogate: `clip/frac` then reports the fraction outside the configured bounds, a diagnostic only.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .losses import SURROGATES, LossContext


def dppo_keep_mask(
    ratio: Tensor, adv: Tensor, mean_sqdist_old: Tensor, std: Tensor, kl_threshold: float, add_kl_coefficient: bool
) -> Tensor:
    """True where the edge keeps its policy term (bool, no gradient)."""
    kl = mean_sqdist_old / (2 * std**2) if add_kl_coefficient else mean_sqdist_old / 2
    high = kl >= kl_threshold
    drop = high & (((ratio > 1) & (adv > 0)) | ((ratio < 1) & (adv < 0)))
    return (~drop).detach()


@SURROGATES.register("flow_dppo", requires=("mean_sqdist_old", "std"))
def flow_dppo(ctx: LossContext, *, kl_threshold: float = 1e-5, add_kl_coefficient: bool = True) -> Tensor:
    """-A r, zeroed where the edge is past the KL trust region and moving away (Flow-DPPO's KL-ADV mask)."""
    r, a = ctx.ratios, ctx.adv.expand_as(ctx.ratios)
    keep = dppo_keep_mask(
        r.detach(), a, ctx.need("mean_sqdist_old").detach(), ctx.need("std"), kl_threshold, add_kl_coefficient
    )
    unclipped = -a * r
    return torch.where(keep, unclipped, torch.zeros_like(unclipped))
