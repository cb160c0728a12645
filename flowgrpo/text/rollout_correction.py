"""Rollout-vs-training mismatch: measure it, and correct the policy loss with importance weights.

The sampler (vLLM kernels, a KV cache, low precision) and the training forward give slightly different
log-probs for the same tokens, so the batch is not exactly on-policy for the trained model. With the
sampler's log-probs `logp_rollout` recorded, w = exp(logp_old - logp_rollout), where logp_old is the
training forward under the weights that sampled, is the importance weight that turns the sampler's
distribution into the trained one. Truncating it (TIS) bounds the variance; masking drops the tokens
or completions where the two engines disagree too much. See `RolloutCorrectionConfig` for the modes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from .config import RolloutCorrectionConfig


@torch.no_grad()
def mismatch_metrics(logp_old: Tensor, logp_rollout: Tensor, mask: Tensor) -> dict[str, float]:
    """How far the training forward is from the sampler, over the tokens in `mask`.

    logp_diff: |logp_old - logp_rollout|; kl: the k3 estimate of KL(rollout || train), per token;
    ratio: the token weights w before any clipping.
    """
    m = mask.bool()
    if not bool(m.any()):
        return {}
    d = (logp_old.float() - logp_rollout.float())[m]
    w = d.exp()
    return {
        "mismatch/logp_diff_mean": float(d.abs().mean()),
        "mismatch/logp_diff_max": float(d.abs().max()),
        "mismatch/kl": float((w - 1 - d).mean()),
        "mismatch/token_ratio_min": float(w.min()),
        "mismatch/token_ratio_mean": float(w.mean()),
        "mismatch/token_ratio_max": float(w.max()),
    }


@dataclass(frozen=True)
class Correction:
    """The importance correction of a batch: per-token multipliers of the policy term, and its metrics."""

    weights: Tensor  # [N, T]; 0 = the token leaves the loss
    metrics: dict[str, float]  # mismatch/{token,sequence}_{clipped,masked}_frac, mismatch/weight_mean


@torch.no_grad()
def correction_weights(
    logp_old: Tensor, logp_rollout: Tensor, mask: Tensor, cfg: RolloutCorrectionConfig
) -> Correction:
    """Per-token multipliers [N, T] for the policy term (0 = the token leaves the loss) and metrics.

    Sequence modes use the product of the token weights over the completion (a sum in log space).
    """
    m = mask.bool()
    log_w = torch.where(m, logp_old.float() - logp_rollout.float(), torch.zeros_like(logp_old, dtype=torch.float))
    if cfg.mode == "none":
        return Correction(torch.ones_like(log_w), {})
    low = cfg.clip_min if cfg.clip_min is not None else 0.0
    high = cfg.clip_max
    if cfg.mode.startswith("sequence"):
        # clamp the log first: a long completion's product can overflow float32
        seq = log_w.sum(1, keepdim=True).clamp(max=math.log(high) + 1.0).exp().expand_as(log_w)
        weights, unit = seq, m.any(1)
    else:
        weights, unit = log_w.clamp(max=math.log(high) + 1.0).exp(), m
    outside = (weights < low) | (weights > high)
    if cfg.mode.endswith("truncate"):
        out = weights.clamp(min=low, max=high)
        key = "clipped_frac"
    else:
        out = torch.where(outside, torch.zeros_like(weights), torch.ones_like(weights))
        key = "masked_frac"
    out = torch.where(m, out, torch.zeros_like(out))
    if cfg.mode.startswith("sequence"):
        rows = outside[:, 0][unit]
        metrics = {f"mismatch/sequence_{key}": float(rows.float().mean()) if rows.numel() else math.nan}
    else:
        metrics = {f"mismatch/token_{key}": float(outside[m].float().mean()) if bool(m.any()) else math.nan}
    metrics["mismatch/weight_mean"] = float(out[m].mean()) if bool(m.any()) else math.nan
    return Correction(out, metrics)
