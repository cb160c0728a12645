"""method: sft - supervised fine-tuning on the best of each group (best-of-N / rejection sampling), or
reward-weighted regression (RWR): the flow-matching loss on the policy's own clean samples, weighted.

Per group of G samples with weighted reward R_i = sum_k w_k r_ik (NaN: never kept):
    top_k: w_i = 1 / k' for the k' = min(k, valid) best samples of the group (ties: the earlier sample), else 0
    max:   w_i = 1 / k' for the k' samples equal to the group's maximum (flow_grpo's 'sft': every tie kept)
    rwr:   w_i = softmax_group(R_i / temperature) over the valid samples
and, over a mini-batch's terms (sample i at time t, fresh noise eps, x_t = (1 - t) x0 + t eps):
    L = sum_terms [w_i mean_dims (v_theta(x_t, t) - (eps - x0))^2 + kl_coef mean_dims (v_theta - v_ref)^2] / sum_terms w_i
(normalize: weights - a weighted mean: the weights of a group sum to 1, so every group counts alike), or with
normalize: samples flow_grpo's plain batch mean: coefficient 1 per kept sample (rwr: k' w_i, mean 1 over the
group), divided by the number of scored samples x times (the unkept ones count, at weight 0, and are not run:
exact with train.mini_batches 1, in expectation otherwise). Only kept samples are run either way.
`sample_with: reference` samples the rollout with the base model (flow_grpo's SFT samples with its never-updated
"ref" adapter: best-of-N of the base model, not of the policy).

Sources: yifan123/flow_grpo @ ac4c86e, flow_grpo/stat_tracking.py PerPromptStatTracker.update (type 'sft': a
one-hot on the group's maximum reward; type 'rwr': the raw reward, a softmax commented out beside it) and
scripts/train_sd3_sft.py (loss = mean(a_i (v - (eps - x0))^2), logit-normal times, rollouts by the "ref"
adapter) with config/sft.py. Its run is mode max, normalize samples, sample_with reference. Differences, by
default: k best instead of every maximum, the softmax form of RWR with a temperature (flow_grpo's commented-out
line; its 'rwr' weights by the raw reward and no config of it selects 'rwr'), a weighted mean instead of its batch
mean (the same direction, an lr scale of k / G apart), the policy's own samples.
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
    mode: Literal["top_k", "max", "rwr"] = "top_k"
    top_k: int = Field(1, ge=1)  # top_k: samples kept per group
    temperature: float = Field(1.0, gt=0)  # rwr: softmax(R / temperature) within the group
    kl_coef: float = Field(0.0, ge=0)  # |v - v_ref|^2 (velocity space, as AWM)
    normalize: Literal["weights", "samples"] = "weights"  # samples: flow_grpo's plain mean over the batch
    sample_with: Literal["policy", "reference"] = "policy"  # reference: flow_grpo (its "ref" adapter samples)


def group_weights(rewards: Tensor, mode: str, top_k: int = 1, temperature: float = 1.0) -> Tensor:
    """Per-sample weights [P, G] from weighted rewards [P, G] (NaN = unscored: weight 0); a group's weights sum
    to 1 (0 when none of it is scored)."""
    valid = torch.isfinite(rewards)
    if mode == "rwr":
        logits = torch.where(valid, rewards.double() / temperature, torch.full_like(rewards.double(), -torch.inf))
        w = torch.softmax(logits, dim=1)
        return torch.where(valid.any(1, keepdim=True), w, torch.zeros_like(w)).float()
    if mode not in ("top_k", "max"):
        raise ValueError(f"sft.mode: expected top_k, max or rwr, got {mode!r}")
    filled = torch.where(valid, rewards.double(), torch.full_like(rewards.double(), -torch.inf))
    if mode == "max":
        kept = valid & (filled == filled.max(1, keepdim=True).values)
    else:
        order = torch.sort(filled, dim=1, descending=True, stable=True).indices
        rank = torch.empty_like(order)
        rank.scatter_(1, order, torch.arange(rewards.shape[1]).expand_as(order).contiguous())
        kept = valid & (rank < top_k)
    count = kept.sum(1, keepdim=True).clamp_min(1)
    return (kept.float() / count).float()


def samples_normalized(w: Tensor, valid: Tensor, mode: str) -> tuple[Tensor, Tensor]:
    """(coefficient, normaliser weight) [P * G] of flow_grpo's plain batch mean from group weights w [P, G]:
    coefficient 1 per kept sample (rwr: k' w_i, mean 1 over the group), normaliser weights summing to the number
    of scored samples over the kept ones (so sum_kept coef err / sum_kept norm = sum_kept coef err / N_scored)."""
    kept = w > 0
    coef = w * kept.sum(1, keepdim=True) if mode == "rwr" else kept.float()
    n_kept = int(kept.sum())
    norm = kept.double() * (float(valid.sum()) / max(n_kept, 1))  # float64: N / k is rarely exact in float32
    return coef.reshape(-1).float(), norm.reshape(-1)


@METHODS.register("sft")
class SFTMethod(MatchingMethod):
    """Best-of-N SFT / RWR: the weighted flow-matching loss on the group's best (or softmax-weighted) samples."""

    section = "sft"

    @staticmethod
    def check_config(cfg: Any) -> None:
        # Rollouts may use CFG (flow_grpo's SFT samples at guidance 4.5): the loss trains the conditional velocity
        # on the clean samples either way, so only the plan is checked.
        if cfg.plan.name not in ("ode_only", "full_sde", "window"):
            raise ValueError(f"method 'sft' trains on clean samples only; plan '{cfg.plan.name}' means nothing")

    @classmethod
    def needs_reference(cls, cfg: Any) -> bool:
        return bool(cfg.sft.kl_coef != 0 or cfg.sft.sample_with == "reference")

    def rollout_policy(self) -> Any:
        if self.ctx.cfg.sft.sample_with == "reference":
            return self.ctx.reference()
        return super().rollout_policy()

    def coefficients(self, rollout: ScoredRollout, record: dict[str, Any]) -> tuple[Tensor, Tensor]:
        s = self.ctx.cfg.sft
        _, rewards = self.group_rewards(rollout, record)  # advantage metrics are logged alike
        w2 = group_weights(rewards, s.mode, s.top_k, s.temperature)
        w = w2.reshape(-1)
        kept = w > 0
        if bool(kept.any()):
            record["sft/kept_reward_mean"] = float(rewards.reshape(-1)[kept].double().mul(w[kept]).sum() / w.sum())
        record["sft/kept_fraction"] = float(kept.float().mean())
        if s.normalize == "weights":
            return w, w
        return samples_normalized(w2, torch.isfinite(rewards), s.mode)

    def term_loss(self, v: Tensor, term: Term, x0: Tensor, coef: Tensor) -> tuple[Tensor, dict[str, float]]:
        err = matching_error(v, term.eps.to(v.device), x0)
        return coef.double() * err, {"sft/matching_loss": float(err.detach().mean())}
