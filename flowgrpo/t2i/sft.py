"""method: sft - supervised fine-tuning on the best of each group (best-of-N / rejection sampling), or
reward-weighted regression (RWR): the flow-matching loss on the policy's own clean samples, weighted.

Per group of G samples with weighted reward R_i = sum_k w_k r_ik (NaN: never kept):
    top_k: w_i = 1 / k' for the k' = min(k, valid) best samples of the group (ties: the earlier sample), else 0
    rwr:   w_i = softmax_group(R_i / temperature) over the valid samples
and, over a mini-batch's terms (sample i at time t, fresh noise eps, x_t = (1 - t) x0 + t eps):
    L = sum_terms [w_i mean_dims (v_theta(x_t, t) - (eps - x0))^2 + kl_coef mean_dims (v_theta - v_ref)^2] / sum_terms w_i
(a weighted mean: the weights of a group sum to 1, so every group counts alike; kept samples only).

Sources: yifan123/flow_grpo @ ac4c86e, flow_grpo/stat_tracking.py PerPromptStatTracker.update (type 'sft': a
one-hot on the group's maximum reward; type 'rwr': the raw reward, a softmax commented out beside it) and
scripts/train_sd3_sft.py (loss = mean(a_i (v - (eps - x0))^2), logit-normal times). Differences, on purpose:
k best instead of the argmax, the softmax form of RWR with a temperature (flow_grpo's commented-out line), and a
weighted mean instead of flow_grpo's plain batch mean (the same direction, an lr scale of k / G apart).
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from pydantic import Field
from torch import Tensor

from .awm import MatchingMethod, MatchingTimes, Term, matching_error
from .methods import METHODS, ScoredRollout


class SFTConfig(MatchingTimes):
    """Best-of-N SFT / RWR (method: sft)."""

    time_sampling: Literal["discrete", "discrete_wo_init", "logit_normal"] = "logit_normal"
    mode: Literal["top_k", "rwr"] = "top_k"
    top_k: int = Field(1, ge=1)  # top_k: samples kept per group
    temperature: float = Field(1.0, gt=0)  # rwr: softmax(R / temperature) within the group
    kl_coef: float = Field(0.0, ge=0)  # |v - v_ref|^2 (velocity space, as AWM)


def group_weights(rewards: Tensor, mode: str, top_k: int = 1, temperature: float = 1.0) -> Tensor:
    """Per-sample weights [P, G] from weighted rewards [P, G] (NaN = unscored: weight 0); a group's weights sum
    to 1 (0 when none of it is scored)."""
    valid = torch.isfinite(rewards)
    if mode == "rwr":
        logits = torch.where(valid, rewards.double() / temperature, torch.full_like(rewards.double(), -torch.inf))
        w = torch.softmax(logits, dim=1)
        return torch.where(valid.any(1, keepdim=True), w, torch.zeros_like(w)).float()
    if mode != "top_k":
        raise ValueError(f"sft.mode: expected top_k or rwr, got {mode!r}")
    filled = torch.where(valid, rewards.double(), torch.full_like(rewards.double(), -torch.inf))
    order = torch.sort(filled, dim=1, descending=True, stable=True).indices
    rank = torch.empty_like(order)
    rank.scatter_(1, order, torch.arange(rewards.shape[1]).expand_as(order).contiguous())
    kept = valid & (rank < top_k)
    count = kept.sum(1, keepdim=True).clamp_min(1)
    return (kept.float() / count).float()


@METHODS.register("sft")
class SFTMethod(MatchingMethod):
    """Best-of-N SFT / RWR: the weighted flow-matching loss on the group's best (or softmax-weighted) samples."""

    section = "sft"

    def coefficients(self, rollout: ScoredRollout, record: dict[str, Any]) -> tuple[Tensor, Tensor]:
        s = self.ctx.cfg.sft
        _, rewards = self.group_rewards(rollout, record)  # advantage metrics are logged alike
        w = group_weights(rewards, s.mode, s.top_k, s.temperature).reshape(-1)
        kept = w > 0
        if bool(kept.any()):
            record["sft/kept_reward_mean"] = float(rewards.reshape(-1)[kept].double().mul(w[kept]).sum() / w.sum())
        record["sft/kept_fraction"] = float(kept.float().mean())
        return w, w

    def term_loss(self, v: Tensor, term: Term, x0: Tensor, coef: Tensor) -> tuple[Tensor, dict[str, float]]:
        err = matching_error(v, term.eps.to(v.device), x0)
        return coef.double() * err, {"sft/matching_loss": float(err.detach().mean())}
