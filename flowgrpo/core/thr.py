"""THR (Token Hidden Reward; Deng et al., 2025, arXiv 2510.03669): reweight the GRPO advantage of the tokens that
most move the likelihood of the group's correct responses. Paper only: no public code was found and the paper's
sections 3-4 were not read (the note anchors_text_grpo.md 2.23 marks the form ✖). From the abstract and the note:

    THR_{i,t} = A_i < phi_{i,t}, sum_{j correct, t'} phi_{j,t'} >       phi = the token's gradient feature
    A_{i,t} <- A_{i,t} (1 + p sign(THR_{i,t}))   on the top-|THR| tokens; p > 0 exploits, p < 0 explores

`token_hidden_reward` is that definition for given features and `thr_weights` the reweighting.

What the text trainer can give: the loss sees each token's log-prob, not its gradient feature (hidden state and
next-token distribution), so the step weighting `thr` uses a PROXY (ours): the last layer's gradient feature of a
token is (e_y - pi) h^T, of norm at least (1 - pi(y)) |h|; taking every feature along one direction with |h| = 1,
phi_{i,t} = 1 - pi_old(o_{i,t}) and THR_{i,t} = A_i (1 - pi_{i,t}) sum_{j: A_j > 0, t'} (1 - pi_{j,t'}) over the
micro-batch (A > 0 stands for "correct"). Its sign is the advantage's, its size favours unlikely tokens; the
cross-token interactions the paper reports are not in it. Since sign(THR) = sign(A) the reweighting scales whole
advantages, so it is a per-action weight (1 + p sign(THR)) on the surrogate's loss: for the clipped surrogate
(positively homogeneous in A) that equals scaling the advantage.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .losses import STEP_WEIGHTINGS, LossContext


def token_hidden_reward(features: Tensor, adv: Tensor, correct: Tensor, mask: Tensor) -> Tensor:
    """THR [N, T] from per-token gradient features [N, T, D], advantages [N] or [N, T], correct rows [N] (bool) and
    the token mask: A_{i,t} <phi_{i,t}, sum of phi over the masked tokens of the correct rows>."""
    keep = (mask & correct.unsqueeze(1)).to(features.dtype).unsqueeze(-1)
    total = (features * keep).sum((0, 1))  # [D]
    a = adv if adv.dim() == 2 else adv.unsqueeze(1)
    thr = a * (features @ total)
    return torch.where(mask, thr, torch.zeros_like(thr))


def thr_weights(thr: Tensor, mask: Tensor, *, p: float, top_frac: float) -> Tensor:
    """1 + p sign(THR) on the ceil(top_frac x masked tokens) tokens of largest |THR| (ties: the earlier), 1 elsewhere."""
    if not -1 <= p <= 1:
        raise ValueError(f"thr: p must lie in [-1, 1] (a weight 1 + p sign(THR) >= 0), got {p}")
    if not 0 < top_frac <= 1:
        raise ValueError(f"thr: top_frac must lie in (0, 1], got {top_frac}")
    n = int(mask.sum())
    k = min(n, math.ceil(n * top_frac - 1e-9))  # the tolerance keeps exact fractions exact
    weight = torch.ones_like(thr)
    if k == 0:
        return weight
    score = torch.where(mask, thr.abs(), torch.full_like(thr, -1.0)).flatten()
    top = torch.sort(score, descending=True, stable=True).indices[:k]
    flat = weight.flatten()
    flat[top] = 1 + p * torch.sign(thr.flatten()[top])
    return flat.view_as(thr)


def proxy_thr(ctx: LossContext) -> Tensor:
    """The trainer-side proxy of THR (module doc): A_i (1 - pi_old) times the sum of (1 - pi_old) over the masked
    tokens of the micro-batch's rows with A > 0."""
    mask = ctx.inputs.mask
    phi = (1 - ctx.inputs.logp_old.detach().float().exp()).unsqueeze(-1)  # [N, T, 1]
    adv = ctx.adv.detach().float().expand_as(mask)
    correct = (adv > 0).any(1)
    return token_hidden_reward(phi, adv, correct, mask)


@STEP_WEIGHTINGS.register("thr")
def thr(ctx: LossContext, *, p: float = 0.1, top_frac: float = 0.2) -> Tensor:
    """THR reweighting: 1 + p sign(THR) on the top_frac of tokens by |THR| (p > 0 exploit, p < 0 explore); THR by
    the proxy A (1 - pi_old) x the correct rows' sum of (1 - pi_old) (paper only; module doc)."""
    return thr_weights(proxy_thr(ctx), ctx.inputs.mask, p=p, top_frac=top_frac)
