"""ROVER (Random Policy Valuation for Diverse Reasoning): the policy's relative log-probs as the Q-values of the
uniform random policy, regressed on the centred reward plus the next state's mean Q (the note anchors_text_grpo.md
2.20; the repository's README names no paper id).

Source read: yuxiaooye/ROVER @ ea5ce635ee03621035d6659845a387879cf20878,
- Math/verl/workers/actor/dp_actor.py `update_policy` (the "ROVER start / end" block): Q(s_t, a_t) =
  rover_t (log pi(a_t | s_t) - log pi_old(a_t | s_t)), optionally clipped to [log(1 - clip), log(1 + clip)] when it
  moves past the target (`use_rover_clip`, off by default); target = A + rover_t * (m_{t+1} - m_{t+1}^old) with
  m_t = mean over the vocabulary of log pi(. | s_t) (`verl_F.sum_log_softmax`: mean logit - logsumexp), 0 after
  the last token, no gradient; loss = the token mean of (Q - target)^2 (`compute_rover_loss`);
- Countdown/verl/trainer/ppo/core_algos.py `compute_rover_reward` (A = r - group mean, a lone sample's mean 0,
  optionally / (unbiased std + 1e-6)); Math/scripts/deepscaler/train/rover_qwen3_8b.sh (A: GRPO's (r - mean) /
  std, rover_t 1, one epoch over 4 mini-batches, rollout temperature 0.6).

The next-state term: the loss reads m_t of every action's state under the current and the old policy
(`LossInputs.vocab_mean_logp` / `vocab_mean_logp_old`; the text trainer computes both with the log-probs, from
the temperature-scaled logits as the source does) and uses m_{t+1} - m_{t+1}^old of the row's next action (0 at
its last one). Where the policy that is trained is the one that sampled (one update per batch) the two are the same
weights and the term is 0, as in the source.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .advantages import ESTIMATORS, _sample_result
from .contracts import AdvantageResult, GroupBatch
from .losses import SURROGATES, LossContext
from .stats import masked_count, masked_mean, masked_std


@ESTIMATORS.register("rover")
def rover_advantage(batch: GroupBatch, *, std_normalize: bool = False, eps: float = 1e-6) -> AdvantageResult:
    """ROVER's centred reward: r - group mean (a lone sample: r itself); std_normalize: / (unbiased std + eps)."""
    r = batch.scalar_rewards()
    ok = batch.usable(r)
    alone = masked_count(ok, dim=1) == 1
    mean = torch.where(alone, torch.zeros_like(r[:, :1]), masked_mean(r, ok, dim=1))
    adv = r - mean
    if std_normalize:
        std = torch.where(alone, torch.ones_like(mean), masked_std(r, ok, dim=1, unbiased=True))
        adv = adv / (std + eps)
    return _sample_result(adv, ok, batch)


@SURROGATES.register("rover", requires=("vocab_mean_logp", "vocab_mean_logp_old"))
def rover(ctx: LossContext, *, temperature: float = 1.0, clip: bool = False) -> Tensor:
    """ROVER: (temperature (log pi - log pi_old) - sg(target))^2 per token, target = A + temperature (m_{t+1} -
    m_{t+1}^old), m the vocabulary mean of log pi(. | s) (0 after a row's last action). clip: Q is held at
    log(high) / log(low) of the bounds part (no gradient) where it passes them moving away from the target."""
    if temperature <= 0:
        raise ValueError(f"rover: temperature must be > 0, got {temperature}")
    q = temperature * ctx.raw_log_ratio
    mask = ctx.inputs.mask
    gap = (ctx.need("vocab_mean_logp").float() - ctx.need("vocab_mean_logp_old").float()).detach()
    gap = torch.where(mask, gap, torch.zeros_like(gap))  # the state after a row's last action is terminal
    next_q = torch.nn.functional.pad(gap[:, 1:], (0, 1))
    target = (ctx.adv.detach() + temperature * next_q).expand_as(q)
    if clip:
        hi = torch.log(torch.as_tensor(ctx.high, dtype=q.dtype, device=q.device).clamp_min(1e-12))
        lo = torch.log(torch.as_tensor(ctx.low, dtype=q.dtype, device=q.device).clamp_min(1e-12))
        q = torch.where(
            (target > q) & (q > hi), hi.expand_as(q), torch.where((target < q) & (q < lo), lo.expand_as(q), q)
        )
    return (q - target) ** 2
