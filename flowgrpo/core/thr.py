"""THR (Token Hidden Reward; Deng et al., ICLR 2026, arXiv 2510.03669): reweight each token's GRPO advantage by the
sign of its influence on the likelihood of its group's correct responses (exploit with p > 0, explore with p < 0).

What was recovered. The THR paper's method sections were not readable (the stored copy of
https://arxiv.org/html/2510.03669v4 gives only its opening); its ICLR 2026 reviews and its predecessor by the same
authors, NTHR (arXiv 2505.18830, "On the Effect of Negative Gradient in Group Relative Deep Reinforcement
Optimization", full text read) were. The parts, **paper-checked** (P) or **reconstructed** (R):

  P (NTHR Thm 4.4, App. 7.2) a token's gradient feature is (e_y - pi_old(.|s)) h_s^T, h_s the last layer's hidden
    state: two tokens interact by alpha <h, h'>, alpha = <e_y - pi, e_y' - pi'> (the prediction-error similarity).
  P (NTHR Sec. 5.1; THR abstract and reviews) the influence of token k of row j on the correct responses of ITS
    group (the same prompt's rollouts): s_{j,k} = sum_{i correct, k'} alpha <h_{i,k'}, h_{j,k}>; GRPO's gradient
    flow weighs it by A_j (NTHR Lemma 4.2: the group weights are |A|), so THR_{j,k} = A_j s_{j,k} (R: the exact
    THR equation was not read; this is the NTHR decomposition with both signs, as the reviews describe it).
  P (NTHR Eq. 7-8, beta = 1; reviews: THR's threshold "follows a prior influence-based heuristic") the dominant
    tokens are |s| > tau, tau = beta min_{i correct} mean_k s_{i,k} over the group (a correct row's mean influence
    on the correct rows); only groups with both correct and incorrect rows are scored.
  P (abstract, reviews) reweighting: p > 0 amplifies positive-THR tokens and weakens negative ones, p < 0 the
    reverse; R: the form A (1 + p sign(THR)) on the dominant tokens, and p = 0.1 (the paper's values vary by model
    and were not recovered). P (reviews) "THR-only": train on the dominant tokens alone (`mode: only`).
  R (ours, option) `select: top_frac`: the top fraction of the micro-batch's tokens by |THR| instead of tau.

What the text trainer can give: the loss sees each token's log-prob, not h or pi(.|s), so the step weighting `thr`
uses a PROXY feature: ||e_y - pi|| >= 1 - pi(y), so phi_{j,k} = 1 - pi_old(o_{j,k}), every feature along one shared
direction (|h| = 1, alpha >= 0). Then s >= 0 and sign(THR) = sign(A): the reweighting scales whole advantages of the
dominant tokens, and the paper's cross-token interactions (sign flips, shared tokens) are not in it. "Correct" is
A > 0 (GRPO over 0 / 1 rewards: r = 1 in a mixed group). Each row's group is `LossInputs.group_index` (the text
trainer then keeps whole groups in a micro-batch). `token_hidden_reward` takes real features [N, T, D] (for
(e_y - pi) h^T flattened, <phi, phi'> = alpha <h, h'>).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

from .losses import STEP_WEIGHTINGS, LossContext

SELECTIONS = ("tau", "top_frac")
MODES = ("reweight", "only")


def _groups(n: int, group: Optional[Tensor], device: torch.device) -> tuple[Tensor, int]:
    """Each row's group as 0..G-1 and G (None: one group)."""
    if group is None:
        return torch.zeros(n, dtype=torch.long, device=device), 1
    inv = torch.unique(group, return_inverse=True)[1]
    return inv, int(inv.max()) + 1 if n else 0


def influence(features: Tensor, correct: Tensor, mask: Tensor, group: Optional[Tensor] = None) -> Tensor:
    """s [N, T]: <phi_{j,k}, sum of phi over the masked tokens of the correct rows of row j's group> for features
    [N, T, D], correct rows [N] (bool), the token mask and each row's group [N] (None: one group); 0 off the mask."""
    inv, n_groups = _groups(features.shape[0], group, features.device)
    keep = (mask & correct.unsqueeze(1)).to(features.dtype).unsqueeze(-1)
    per_row = (features * keep).sum(1)  # [N, D]
    total = per_row.new_zeros(n_groups, per_row.shape[1]).index_add_(0, inv, per_row)  # [G, D]
    s = (features * total[inv].unsqueeze(1)).sum(-1)
    return torch.where(mask, s, torch.zeros_like(s))


def token_hidden_reward(
    features: Tensor, adv: Tensor, correct: Tensor, mask: Tensor, group: Optional[Tensor] = None
) -> Tensor:
    """THR [N, T] = A_j s_{j,k} (`influence`), advantages [N] or [N, T]."""
    a = adv if adv.dim() == 2 else adv.unsqueeze(1)
    return torch.where(mask, a * influence(features, correct, mask, group), torch.zeros_like(mask, dtype=a.dtype))


def anchor_threshold(
    score: Tensor, correct: Tensor, mask: Tensor, group: Optional[Tensor] = None, *, beta: float
) -> Tensor:
    """tau [N] of each row's group: beta x the least mean influence s of a correct row's tokens (NTHR Eq. 7-8);
    +inf where the group lacks a correct or an incorrect row with tokens (nothing to compare: nothing selected)."""
    n = score.shape[0]
    inv, n_groups = _groups(n, group, score.device)
    count = mask.sum(1)
    live = count > 0
    mean = torch.where(mask, score, torch.zeros_like(score)).sum(1) / count.clamp_min(1)
    inf = torch.full((n_groups,), math.inf, dtype=score.dtype, device=score.device)
    least = inf.scatter_reduce(0, inv, torch.where(correct & live, mean, math.inf), "amin")
    has_pos = torch.zeros(n_groups, dtype=torch.bool, device=score.device).index_fill_(0, inv[correct & live], True)
    has_neg = torch.zeros(n_groups, dtype=torch.bool, device=score.device).index_fill_(0, inv[~correct & live], True)
    tau = torch.where(has_pos & has_neg, beta * least, inf)
    return tau[inv]


def select_top(thr: Tensor, mask: Tensor, *, top_frac: float) -> Tensor:
    """The ceil(top_frac x masked tokens) masked tokens of largest |THR| (ties: the earlier), bool [N, T]."""
    if not 0 < top_frac <= 1:
        raise ValueError(f"thr: top_frac must lie in (0, 1], got {top_frac}")
    n = int(mask.sum())
    k = min(n, math.ceil(n * top_frac - 1e-9))  # the tolerance keeps exact fractions exact
    chosen = torch.zeros(thr.numel(), dtype=torch.bool, device=thr.device)
    score = torch.where(mask, thr.abs(), torch.full_like(thr, -1.0)).flatten()
    chosen[torch.sort(score, descending=True, stable=True).indices[:k]] = True
    return chosen.view_as(mask)


def thr_weights(thr: Tensor, selected: Tensor, *, p: float, mode: str = "reweight") -> Tensor:
    """`reweight`: 1 + p sign(THR) on the selected tokens, 1 elsewhere; `only`: 1 on them, 0 elsewhere."""
    if not -1 <= p <= 1:
        raise ValueError(f"thr: p must lie in [-1, 1] (a weight 1 + p sign(THR) >= 0), got {p}")
    if mode not in MODES:
        raise ValueError(f"thr: mode must be one of {list(MODES)}, got {mode!r}")
    if mode == "only":
        return selected.to(thr.dtype)
    return torch.where(selected, 1 + p * torch.sign(thr), torch.ones_like(thr))


def proxy_influence(ctx: LossContext) -> tuple[Tensor, Tensor]:
    """(s, correct) of the trainer-side proxy (module doc): phi = 1 - pi_old, correct = A > 0, per group."""
    mask = ctx.inputs.mask
    phi = (1 - ctx.inputs.logp_old.detach().double().exp()).unsqueeze(-1)  # [N, T, 1]
    adv = ctx.adv.detach().double().expand_as(mask)
    correct = (adv > 0).any(1)
    return influence(phi, correct, mask, ctx.need("group_index")), correct


@STEP_WEIGHTINGS.register("thr", requires=("group_index",))
def thr(
    ctx: LossContext,
    *,
    p: float = 0.1,
    select: str = "tau",
    beta: float = 1.0,
    top_frac: float = 0.2,
    mode: str = "reweight",
) -> Tensor:
    """THR weights (module doc): THR = A s, s each token's proxy influence on its group's correct rows; the dominant
    tokens |s| > tau = beta min_{correct i} mean_k s_{i,k} (`select: tau`) or the top_frac of the micro-batch by
    |THR| (`select: top_frac`, ours); `reweight`: 1 + p sign(THR) on them (p > 0 exploit, p < 0 explore), `only`:
    train on them alone."""
    if select not in SELECTIONS:
        raise ValueError(f"thr: select must be one of {list(SELECTIONS)}, got {select!r}")
    mask = ctx.inputs.mask
    s, correct = proxy_influence(ctx)
    value = ctx.adv.detach().double().expand_as(mask) * s  # THR
    unscored = torch.zeros_like(mask)
    if select == "tau":
        tau = anchor_threshold(s, correct, mask, ctx.need("group_index"), beta=beta).unsqueeze(1)
        selected = mask & (s.abs() > tau)
        unscored = mask & torch.isinf(tau)  # a group without both kinds of rows: its tokens are left as they are
    else:
        selected = select_top(value, mask, top_frac=top_frac)
    weight = thr_weights(value, selected, p=p, mode=mode)
    if mode == "only":  # `only` keeps the tokens it cannot score (reweight leaves them at 1 already)
        weight = torch.where(unscored, torch.ones_like(weight), weight)
    return weight.to(ctx.inputs.logp.dtype)
