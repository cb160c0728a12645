"""REAL (Rewards as Labels): verifiable rewards as class labels, trained with a classification loss over each group.

Source read: Red-RL/REAL @ 1c30726a1c7606e717091b4b8cf1fc156a06039f, verl/verl/trainer/ppo/core_algos.py
`compute_policy_loss_real` (and `..._bce`), scripts/train/1.5b_real.sh (tau 0.5, GRPO's rollout settings). Per group,
with s_i = mean over the tokens of o_i of (log pi - log pi_old), O+ the samples with reward 1 and O- those with 0:

    L_q = log(1 + sum_{i in O+} exp(-s_i / tau)) + log(1 + sum_{j in O-} exp(s_j / tau))

summed over the groups that have both labels, / the number of groups (a group without both contributes 0 but is
counted). `real_group_loss` is that loss, exactly.

The policy loss here sees rows, not groups (a micro-batch may hold part of a group, in any order), so the
trainer runs it per sample: the estimator `real` gives each labelled sample A_i = +|O+| (positive) or -|O-|
(negative) of its group, 0 otherwise, and the surrogate `real` turns a row into log(|A_i| + exp(-sign(A_i) s_i / tau)):
the group's term of its label with the other samples held at s_j = 0. Its gradient in s_i,
-(1/tau) sign(A_i) / (1 + |A_i| exp(sign(A_i) s_i / tau)), is the group loss's gradient exactly while the group's
other samples sit at s_j = 0: always with one update per batch (logp_old = the detached logp),
and for every row of the first update otherwise; in later updates the other samples' drift is left out (their
terms would need the whole group in one micro-batch; docs/text_trainer.md). With `seq_mean_token_mean` (a row's
terms are equal over its tokens) the rows' gradients sum to the source's per-question mean's / G, a constant factor.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .advantages import ESTIMATORS, _sample_result
from .contracts import AdvantageResult, GroupBatch
from .losses import SURROGATES, LossContext, _seq_mean
from .stats import masked_mean

LABELS = ("binary", "mean")


def real_group_loss(scores: Tensor, positive: Tensor, negative: Tensor, *, tau: float = 0.5) -> Tensor:
    """The REAL loss of [P, G] sequence scores s (mean token log-ratio) with bool label masks: the sum over groups
    with both labels of log(1 + sum_+ exp(-s / tau)) + log(1 + sum_- exp(s / tau)), / P."""
    if tau <= 0:
        raise ValueError(f"real: tau must be > 0, got {tau}")
    scaled = scores / tau
    zeros = torch.zeros_like(scaled[:, :1])
    neg_inf = torch.full_like(scaled, -torch.inf)
    pos = torch.logsumexp(torch.cat([torch.where(positive, -scaled, neg_inf), zeros], 1), 1)
    neg = torch.logsumexp(torch.cat([torch.where(negative, scaled, neg_inf), zeros], 1), 1)
    both = positive.any(1) & negative.any(1)
    return torch.where(both, pos + neg, torch.zeros_like(pos)).sum() / scores.shape[0]


def real_labels(r: Tensor, ok: Tensor, labels: str, high: float, low: float) -> tuple[Tensor, Tensor]:
    """Positive and negative masks [P, G]: `binary` r == high / r == low (the source's 1 / 0), `mean` r above /
    below the group mean (ours, for graded rewards)."""
    if labels == "binary":
        return ok & (r == high), ok & (r == low)
    if labels == "mean":
        mean = masked_mean(r, ok, dim=1)
        return ok & (r > mean), ok & (r < mean)
    raise ValueError(f"real: labels must be one of {LABELS}, got {labels!r}")


@ESTIMATORS.register("real")
def real_advantage(
    batch: GroupBatch, *, labels: str = "binary", high: float = 1.0, low: float = 0.0
) -> AdvantageResult:
    """REAL's labels for the `real` surrogate: A = +(count of positives) for a positive, -(count of negatives) for
    a negative, 0 in a group without both labels. labels: binary (r == high / r == low, the source) or mean (above /
    below the group mean)."""
    r = batch.scalar_rewards()
    ok = batch.usable(r)
    pos, neg = real_labels(r, ok, labels, high, low)
    both = (pos.any(1) & neg.any(1)).unsqueeze(1)
    n_pos = pos.sum(1, keepdim=True).to(r.dtype)
    n_neg = neg.sum(1, keepdim=True).to(r.dtype)
    adv = torch.where(pos & both, n_pos, torch.where(neg & both, -n_neg, torch.zeros_like(r)))
    metrics = {
        "real/labelled_groups": float(both.sum()),
        "real/positive_frac": float(pos.sum() / ok.sum().clamp_min(1)),
    }
    return _sample_result(adv, ok, batch, **metrics)


@SURROGATES.register("real")
def real(ctx: LossContext, *, tau: float = 0.5) -> Tensor:
    """REAL per sample: log(|A| + exp(-sign(A) s / tau)), s the row's mean log-ratio, A from estimator `real`: the
    group classification loss with the group's other samples at the old policy. Equal on every token of the row."""
    if tau <= 0:
        raise ValueError(f"real: tau must be > 0, got {tau}")
    s = _seq_mean(ctx.raw_log_ratio, ctx.inputs.mask)  # [N, 1]
    a = ctx.adv
    if a.shape[1] != 1 and not bool((a == a[:, :1]).all()):
        raise ValueError("real: needs one advantage per sequence (estimator `real`), got per-token advantages")
    a = a[:, :1]
    sign, count = torch.sign(a), a.abs()
    # log(n + e^x) as a stable logaddexp; A = 0 rows (unlabelled) give 0 and no gradient
    per_row = torch.where(count > 0, torch.logaddexp(count.clamp_min(1).log(), -sign * s / tau), 0 * s)
    return per_row.expand_as(ctx.raw_log_ratio)
