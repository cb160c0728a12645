"""REAL (Rewards as Labels): verifiable rewards as class labels, trained with a classification loss over each group.

Source read: Red-RL/REAL @ 1c30726a1c7606e717091b4b8cf1fc156a06039f, verl/verl/trainer/ppo/core_algos.py
`compute_policy_loss_real` (and `..._bce`), scripts/train/1.5b_real.sh (tau 0.5, GRPO's rollout settings). Per group,
with s_i = mean over the tokens of o_i of (log pi - log pi_old), O+ the samples with reward 1 and O- those with 0:

    L_q = log(1 + sum_{i in O+} exp(-s_i / tau)) + log(1 + sum_{j in O-} exp(s_j / tau))

summed over the groups that have both labels, / the number of groups (a group without both contributes 0 but is
counted). `real_group_loss` is that loss, exactly.

The policy loss sees rows: the estimator `real` gives each labelled sample A_i = +|O+| (positive) or -|O-|
(negative) of its group, 0 otherwise, and the surrogate `real` reads each row's group (`LossInputs.group_index`,
which the text trainer fills, keeping whole groups in every micro-batch) and computes each group's term L_q from its
rows' s_i, exactly, also after the policy has moved (several updates per batch). A labelled row that is not in the
micro-batch (its tokens all masked out, e.g. a truncated completion under `mask_truncated`) counts as a sample at
the old policy (s = 0, a term e^0 = 1: its label's count |A| says how many there are). L_q is shared equally by
the group's rows in the micro-batch, so their sum is L_q: with `seq_mean_token_mean` (a row's terms are equal over
its tokens) the loss is the sum of L_q / the sequence count, the source's per-question mean / G.
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


@SURROGATES.register("real", requires=("group_index",))
def real(ctx: LossContext, *, tau: float = 0.5) -> Tensor:
    """REAL: each group's classification loss log(1 + sum_+ e^(-s/tau)) + log(1 + sum_- e^(s/tau)), s the row's mean
    log-ratio, A from estimator `real`, shared equally by the group's labelled rows (LossInputs.group_index); a
    labelled row missing from the micro-batch sits at the old policy. Equal on every token of a row."""
    if tau <= 0:
        raise ValueError(f"real: tau must be > 0, got {tau}")
    a = ctx.adv
    if a.shape[1] != 1 and not bool((a == a[:, :1]).all()):
        raise ValueError("real: needs one advantage per sequence (estimator `real`), got per-token advantages")
    a = a[:, 0]
    mask = ctx.inputs.mask
    scaled = _seq_mean(ctx.raw_log_ratio, mask)[:, 0] / tau  # [N]
    inv: Tensor = torch.unique(ctx.need("group_index"), return_inverse=True)[1]  # each row's group, 0..groups-1
    member = inv.unsqueeze(0) == torch.arange(int(inv.max()) + 1 if inv.numel() else 0, device=inv.device).unsqueeze(1)
    groups: list[Tensor] = []
    for side, sign in ((member & (a > 0), -1.0), (member & (a < 0), 1.0)):  # [groups, N] rows of each label
        # the label's count |A| (the same for every row of it) minus the rows here: samples at the old policy, e^0
        count = torch.where(side, a.abs(), torch.zeros_like(a)).amax(1)
        absent = (count - side.sum(1).to(count.dtype)).clamp_min(0)
        terms = torch.where(side, sign * scaled, torch.full_like(scaled, -torch.inf))
        groups.append(torch.logsumexp(torch.cat([terms, absent.to(scaled.dtype).log1p().unsqueeze(1)], 1), 1))
    loss = groups[0] + groups[1]  # [groups]; 0 for a group without labelled rows (log 1 + log 1)
    carriers = member & (a != 0) & mask.any(1)
    share = loss / carriers.sum(1).clamp_min(1)
    per_row = (carriers.to(share.dtype) * share.unsqueeze(1)).sum(0)  # each carrier row: its group's share
    return per_row.unsqueeze(1).expand_as(ctx.raw_log_ratio)
