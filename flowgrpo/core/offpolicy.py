"""Group-relative REINFORCE as an off-policy algorithm: the REC, REP and RED families (Yao et al., 2025,
"Group-Relative REINFORCE Is Secretly an Off-Policy Algorithm", arXiv 2509.24203).

Source read: yanxi-chen/Trinity-RFT @ 9051d6374db5d4199dbe317d33eb1caa2e42a9fb,
- trinity/algorithm/policy_loss_fn/rec_policy_loss.py `RECPolicyLossFn.__call__` (surrogate `rec`, the
  regularisers in regularizers.py);
- trinity/algorithm/advantage_fn/rec_advantage.py `RECGroupedAdvantage.calculate_group_advantage` (estimator
  `rec`);
- examples/rec_gsm8k/README.md (the variants' settings: the presets below).

Every member is REINFORCE on A_i = r_i - mean (optionally / std) with the loss -w A M log pi + reg, where the
importance weight w and the clipping mask M use the ratio without gradient.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from .advantages import ESTIMATORS, _sample_result
from .contracts import AdvantageResult, GroupBatch
from .losses import PRESETS, SURROGATES, LossContext
from .stats import masked_count, masked_mean, masked_std

CLIP_MODES = ("none", "one-side", "two-side", "ring")
REC_WEIGHTS = ("none", "importance_sampling", "advantage")


@SURROGATES.register("rec")
def rec(
    ctx: LossContext,
    *,
    clip_mode: str = "one-side",
    eps_low_prime: float = 0.6,
    eps_high_prime: float = 2.0,
    weight: str = "none",
    temp: float = 1.0,
) -> Tensor:
    """REC: -w A M log pi, M a clipping mask on the detached ratio r in the bounds [low, high].

    clip_mode: none (M = 1); one-side (PPO's: A >= 0 needs r <= high, A <= 0 needs r >= low); two-side
    (low <= r <= high); ring (inside the bounds, or A >= 0 with r <= 1 - eps_low_prime, or A <= 0 with
    r >= 1 + eps_high_prime). weight: none (w = 1, "NoIS"), importance_sampling (w = r, "IS") or advantage
    (RED-Weight: w = exp(A / temp)). The ratio part decides token or sequence (GSPO) ratios.
    """
    if clip_mode not in CLIP_MODES:
        raise ValueError(f"clip_mode: expected one of {CLIP_MODES}, got {clip_mode!r}")
    if weight not in REC_WEIGHTS:
        raise ValueError(f"weight: expected one of {REC_WEIGHTS}, got {weight!r}")
    r = ctx.ratios.detach()
    a = ctx.adv
    low = torch.as_tensor(ctx.low, dtype=r.dtype, device=r.device)
    high = torch.as_tensor(ctx.high, dtype=r.dtype, device=r.device)
    inside = (r >= low) & (r <= high)
    if clip_mode == "none":
        keep = torch.ones_like(r, dtype=torch.bool)
    elif clip_mode == "one-side":
        keep = ((a >= 0) & (r <= high)) | ((a <= 0) & (r >= low))
    elif clip_mode == "two-side":
        keep = inside
    else:  # ring
        keep = inside | ((a >= 0) & (r <= 1 - eps_low_prime)) | ((a <= 0) & (r >= 1 + eps_high_prime))
    if weight == "none":
        weighted = a
    elif weight == "importance_sampling":
        weighted = a * r
    else:  # advantage
        weighted = a * torch.exp(a / temp)
    return -weighted * ctx.inputs.logp * keep.float()


@ESTIMATORS.register("rec")
def rec_advantage(
    batch: GroupBatch, *, std_normalize: bool = False, eps: float = 1e-6, drop: str = "none"
) -> AdvantageResult:
    """REC / RED-Drop: A = r - group mean (std_normalize: / (biased std + eps)).

    drop "balance" (RED-Drop): where a group has more negatives (r < the group mean) than positives, the extra
    negatives get A = 0 and leave the group's mean and std, which are then recomputed over the rest. Trinity
    picks them at random; here they are the last ones in group order (the samples of a group are exchangeable,
    so this has the same distribution, and it is reproducible on every rank and after a resume). Dropped
    samples keep their weight, as in the source: they still count in the loss normaliser.
    """
    if drop not in ("none", "balance"):
        raise ValueError(f"drop: expected 'none' or 'balance', got {drop!r}")
    r = batch.scalar_rewards()
    ok = batch.usable(r)
    negative = ok & (r < masked_mean(r, ok, dim=1))
    dropped = torch.zeros_like(ok)
    if drop == "balance":
        n_neg = negative.sum(1, keepdim=True)
        extra = (n_neg - (masked_count(ok, dim=1) - n_neg)).clamp_min(0)
        from_end = negative.flip(1).long().cumsum(1).flip(1)  # 1 for the last negative, 2 for the one before, ...
        dropped = negative & (from_end <= extra)
    keep = ok & ~dropped
    centred = r - masked_mean(r, keep, dim=1)
    if std_normalize:
        centred = centred / (masked_std(r, keep, dim=1, unbiased=False) + eps)
    metrics = {"rec/dropped_frac": float(dropped.sum() / ok.sum().clamp_min(1))} if drop == "balance" else {}
    return _sample_result(centred, keep, batch, **metrics)


def _rec_preset(clip_mode: str, weight: str, **extra: Any) -> dict[str, Any]:
    """A REC-family loss: symmetric bounds 0.2 and Trinity's global token mean, unless `extra` says otherwise."""
    preset: dict[str, Any] = {
        "bounds": {"name": "symmetric", "eps": 0.2},
        "surrogate": {"name": "rec", "clip_mode": clip_mode, "weight": weight},
        "aggregation": "token_mean",
    }
    preset.update(extra)
    return preset


# examples/rec_gsm8k/README.md of the source, one preset per variant (the advantage: estimator `rec`, recipes.py)
REC_PRESETS: dict[str, dict[str, Any]] = {
    "rec_one_side_nois": _rec_preset("one-side", "none"),
    "rec_one_side_is": _rec_preset("one-side", "importance_sampling"),
    "rec_two_side_is": _rec_preset("two-side", "importance_sampling"),
    "rec_ring_nois": _rec_preset("ring", "none"),
    # GSPO-style REC: the mask and the weight on the sequence ratio, sequence-mean aggregation
    "rec_gspo_nois": _rec_preset(
        "one-side",
        "none",
        ratio="sequence",
        bounds={"name": "asymmetric", "eps_low": 3e-4, "eps_high": 4e-4},
        aggregation="seq_mean_token_mean",
    ),
    "rec_gspo_is": _rec_preset(
        "one-side",
        "importance_sampling",
        ratio="sequence",
        bounds={"name": "asymmetric", "eps_low": 3e-4, "eps_high": 4e-4},
        aggregation="seq_mean_token_mean",
    ),
    "opmd": _rec_preset("none", "none", regularizer={"name": "opmd", "coef": 0.1}),
    "asymre": _rec_preset("none", "none", regularizer={"name": "asymre", "coef": 0.1}),
    "red_weight": _rec_preset("none", "advantage"),
}


def add_presets(new: dict[str, dict[str, Any]]) -> None:
    """Add loss presets to PRESETS; a name that is already there raises (as a duplicate registry name does)."""
    clash = sorted(set(new) & set(PRESETS))
    if clash:
        raise ValueError(f"loss preset(s) {clash} already defined")
    PRESETS.update(new)


add_presets(REC_PRESETS)
