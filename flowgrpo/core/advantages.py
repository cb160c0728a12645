"""Advantage estimators, by name.

Each estimator is a small pure function `fn(batch, *, settings...) -> AdvantageResult`. Samples that
are padding or could not be scored (NaN) are left out of every statistic; `compute_advantages`
sets their advantage to 0 afterwards, then applies the configured transforms (see transforms.py).

Sample-level estimators read the weighted sum of the reward heads unless they say otherwise.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .contracts import AdvantageResult, GroupBatch, given
from .registry import Registry
from .stats import masked_count, masked_mean, masked_median, masked_std, whole_batch_std, zscore

ESTIMATORS = Registry("advantage estimator")


def _sample_result(adv: Tensor, usable: Tensor, batch: GroupBatch, **metrics: float) -> AdvantageResult:
    adv = torch.where(usable, adv, torch.zeros_like(adv))
    return AdvantageResult(adv, batch.mask.float(), "sample", dict(metrics))


# --- group-relative baselines -------------------------------------------------------------------


@ESTIMATORS.register("grpo")
def grpo(batch: GroupBatch, *, eps: float = 1e-4, unbiased: bool = True, std_scope: str = "group") -> AdvantageResult:
    """(r - group mean) / (std + eps); std per group, over the whole batch (Flow-GRPO global_std), or none."""
    r = batch.scalar_rewards()
    ok = batch.usable(r)
    centred = r - masked_mean(r, ok, dim=1)
    if std_scope == "group":
        scale = masked_std(r, ok, dim=1, unbiased=unbiased)
    elif std_scope == "batch":
        scale = whole_batch_std(r, ok, unbiased=unbiased)
    elif std_scope == "none":
        return _sample_result(centred, ok, batch)
    else:
        raise ValueError(f"std_scope: expected 'group', 'batch' or 'none', got {std_scope!r}")
    return _sample_result(centred / (scale + eps), ok, batch)


@ESTIMATORS.register("dr_grpo")
def dr_grpo(batch: GroupBatch) -> AdvantageResult:
    """r - group mean (Dr. GRPO: no division by the std)."""
    return grpo(batch, std_scope="none")


@ESTIMATORS.register("rloo")
def rloo(batch: GroupBatch) -> AdvantageResult:
    """r - mean of the other samples of the group (leave-one-out)."""
    r = batch.scalar_rewards()
    ok = batch.usable(r)
    n = masked_count(ok, dim=1).float()
    adv = n / (n - 1).clamp_min(1) * (r - masked_mean(r, ok, dim=1))
    return _sample_result(adv, ok & (n >= 2), batch)


@ESTIMATORS.register("batch_whiten")
def batch_whiten(batch: GroupBatch, *, eps: float = 1e-8) -> AdvantageResult:
    """r - group mean, then whitened over the whole batch (REINFORCE++ with baseline)."""
    r = batch.scalar_rewards()
    ok = batch.usable(r)
    centred = r - masked_mean(r, ok, dim=1)
    flat, flat_ok = centred.reshape(-1), ok.reshape(-1)
    mean = masked_mean(flat, flat_ok, dim=0)
    std = masked_std(flat, flat_ok, dim=0, unbiased=True)
    return _sample_result((centred - mean) / (std + eps), ok, batch)


@ESTIMATORS.register("mc_grpo")
def mc_grpo(batch: GroupBatch, *, mad_floor: float = 1e-3, nonzero_rescale: bool = True) -> AdvantageResult:
    """MC-GRPO: median centre, median-absolute-deviation scale (+ floor); the pivot (median) sample gets weight 0.

    Meant for groups of G+1 samples. `nonzero_rescale` multiplies the non-zero advantages of a group by
    (group size) / (number of non-zero advantages), as the authors' trainer does.
    """
    r = batch.scalar_rewards()
    ok = batch.usable(r)
    centre, pivot = masked_median(r, ok, dim=1)
    mad, _ = masked_median((r - centre).abs(), ok, dim=1)
    adv = torch.where(ok, (r - centre) / (mad + mad_floor), torch.zeros_like(r))
    is_pivot = torch.zeros_like(ok).scatter_(1, pivot, True) & ok
    adv = torch.where(is_pivot, torch.zeros_like(adv), adv)
    if nonzero_rescale:
        nonzero = (adv != 0).sum(dim=1, keepdim=True).float()
        adv = adv * masked_count(ok, dim=1).float() / nonzero.clamp_min(1)
    result = _sample_result(adv, ok, batch)
    result.sample_weight = torch.where(is_pivot, torch.zeros_like(result.sample_weight), result.sample_weight)
    return result


@ESTIMATORS.register("ngrpo")
def ngrpo(batch: GroupBatch, *, max_reward: float = 1.0, num_virtual: int = 1, eps: float = 1e-6) -> AdvantageResult:
    """NGRPO: group statistics include `num_virtual` virtual samples of reward `max_reward` (unbiased std)."""
    r = batch.scalar_rewards()
    ok = batch.usable(r)
    n = masked_count(ok, dim=1).float()
    total = torch.where(ok, r, torch.zeros_like(r)).sum(1, keepdim=True) + num_virtual * max_reward
    m = n + num_virtual
    mean = total / m
    sq = (
        torch.where(ok, (r - mean) ** 2, torch.zeros_like(r)).sum(1, keepdim=True)
        + num_virtual * (max_reward - mean) ** 2
    )
    std = (sq / (m - 1).clamp_min(1)).sqrt()
    return _sample_result((r - mean) / (std + eps), ok, batch)


@ESTIMATORS.register("dgpo")
def dgpo(
    batch: GroupBatch, *, eps: float = 1e-4, question_weights: bool = True, temperature: float = 2.0
) -> AdvantageResult:
    """DGPO: A = n (r - mean) / (sum |r - mean| + eps), times softmax(-accuracy / T) difficulty weights.

    The weights run over groups with non-zero spread and average 1 over them; accuracy is the group
    mean of the first reward head.
    """
    r = batch.scalar_rewards()
    ok = batch.usable(r)
    n = masked_count(ok, dim=1).float()
    centred = torch.where(ok, r - masked_mean(r, ok, dim=1), torch.zeros_like(r))
    abs_dev = centred.abs().sum(dim=1, keepdim=True)
    adv = n * centred / (abs_dev + eps)
    metrics = {}
    if question_weights:
        primary = batch.head_rewards()[..., 0].float()
        accuracy = masked_mean(primary, batch.usable(primary), dim=1).squeeze(1)
        spread = abs_dev.squeeze(1) > 0
        logits = torch.where(spread, -accuracy / temperature, torch.full_like(accuracy, -math.inf))
        weights = torch.softmax(logits, dim=0) * spread.sum() if bool(spread.any()) else torch.zeros_like(accuracy)
        adv = adv * torch.nan_to_num(weights, nan=0.0).unsqueeze(1)
        metrics["dgpo/weight_max"] = float(weights.max()) if bool(spread.any()) else 0.0
    return _sample_result(adv, ok, batch, **metrics)


@ESTIMATORS.register("a_grae")
def a_grae(batch: GroupBatch, *, alpha: float = 1.0, eps: float = 1e-6, std_eps: float = 1e-4) -> AdvantageResult:
    """A-GRAE: GRPO advantage reweighted from easy to hard prompts as batch accuracy rises.

    Rewards are read as accuracies in [0, 1]. Positive advantages are damped by min(1, batch acc / alpha).
    The eps of the difficulty terms is not stated in the paper: it is a setting.
    """
    r = batch.scalar_rewards()
    ok = batch.usable(r)
    base = grpo(batch, eps=std_eps).advantages
    p = masked_mean(r, ok, dim=1).clamp(0, 1)
    has = masked_count(ok, dim=1).squeeze(1) > 0
    p_bar = p.squeeze(1)[has].mean() if bool(has.any()) else torch.zeros(())
    hard = base / (2 * (p.sqrt() + eps))
    easy = base / (2 * (1 - p.sqrt() + eps))
    adv = (1 - p_bar) * easy + p_bar * hard
    adv = torch.where(adv > 0, adv * torch.clamp(p_bar / alpha, max=1.0), adv)
    return _sample_result(adv, ok, batch, **{"a_grae/batch_accuracy": float(p_bar)})


# --- no baseline: sign-asymmetric REINFORCE ----------------------------------------------------


@ESTIMATORS.register("w_reinforce")
def w_reinforce(batch: GroupBatch, *, positive_weight: float = 0.1) -> AdvantageResult:
    """W-REINFORCE: A = lambda for a correct sample, -1 for a wrong one (rewards in [0, 1]: lambda r - (1 - r))."""
    r = batch.scalar_rewards()
    return _sample_result(positive_weight * r - (1 - r), batch.usable(r), batch)


@ESTIMATORS.register("nsr")
def nsr(batch: GroupBatch) -> AdvantageResult:
    """Negative-sample reinforcement only: A = r - 1."""
    return w_reinforce(batch, positive_weight=0.0)


@ESTIMATORS.register("psr")
def psr(batch: GroupBatch) -> AdvantageResult:
    """Positive-sample reinforcement only: A = r."""
    r = batch.scalar_rewards()
    return _sample_result(r, batch.usable(r), batch)


# --- several rewards and pairwise preferences --------------------------------------------------


@ESTIMATORS.register("gdpo")
def gdpo(batch: GroupBatch, *, eps: float = 1e-4, unbiased: bool = True, batch_norm: bool = True) -> AdvantageResult:
    """GDPO: z-score each reward head in its group, weighted sum, then z-score over the batch.

    batch_norm=False stops at the weighted sum of per-head group z-scores: MixGRPO's
    `multi_reward_mix advantage_aggr` and Pref-GRPO's 0.7 A_winrate + 1.4 A_clip (eps 1e-8 there).
    """
    heads = batch.head_rewards().float()
    head_ok = batch.usable(heads)
    normed = zscore(heads, head_ok, dim=1, eps=eps, unbiased=unbiased)
    ok = head_ok.all(-1) if batch.head_nan_policy == "propagate" else head_ok.any(-1)
    summed = (normed * batch.weights).sum(-1)
    if not batch_norm:
        return _sample_result(summed, ok, batch)
    flat, flat_ok = summed.reshape(-1), ok.reshape(-1)
    adv = (summed - masked_mean(flat, flat_ok, 0)) / (masked_std(flat, flat_ok, 0, unbiased) + eps)
    return _sample_result(adv, ok, batch)


@ESTIMATORS.register("win_rate", requires=("preferences",), reads="preferences")
def win_rate(batch: GroupBatch, *, eps: float = 1e-8, unbiased: bool = True) -> AdvantageResult:
    """Pref-GRPO: win rate of each sample against the rest of its group, then group z-score.

    preferences[p, i, j] = P(i beats j); ties count 0.5 and so do unreadable (NaN) verdicts.
    """
    pref = given(batch.preferences, "GroupBatch.preferences").float()
    pair_ok = batch.mask.unsqueeze(2) & batch.mask.unsqueeze(1)
    pair_ok &= ~torch.eye(batch.group_size, dtype=torch.bool, device=pref.device)
    unreadable = torch.isnan(pref) & pair_ok
    pref = torch.where(unreadable, torch.full_like(pref, 0.5), pref)
    wins = torch.where(pair_ok, pref, torch.zeros_like(pref)).sum(-1)
    n = batch.mask.sum(1, keepdim=True).float()
    rate = wins / (n - 1).clamp_min(1)
    ok = batch.mask & (n >= 2)
    result = _sample_result(zscore(rate, ok, dim=1, eps=eps, unbiased=unbiased), ok, batch)
    result.metrics.update(
        {
            "win_rate/unreadable_pairs": float(unreadable.sum()) / 2,
            "win_rate/mean": float(rate[ok].mean()) if bool(ok.any()) else 0.0,
        }
    )
    return result


# --- step- and node-level estimators ------------------------------------------------------------


def _step_result(adv: Tensor, ok: Tensor, **metrics: float) -> AdvantageResult:
    adv = torch.where(ok, adv, torch.zeros_like(adv))
    return AdvantageResult(adv, ok.float(), "step", dict(metrics))


def _step_inputs(batch: GroupBatch) -> tuple[Tensor, Tensor]:
    r = given(batch.step_rewards, "GroupBatch.step_rewards").float()
    return r, given(batch.step_mask, "GroupBatch.step_mask") & batch.usable(r)


@ESTIMATORS.register("sibling", requires=("step_rewards",), reads="siblings")
def sibling(batch: GroupBatch, *, eps: float = 1e-4, unbiased: bool = False) -> AdvantageResult:
    """TempFlow-GRPO: z-score among the k siblings of each branch point.

    step_rewards[p, j, t] is the (ODE-completed) reward of sibling j at branch point t of prompt p.
    """
    r, ok = _step_inputs(batch)
    return _step_result(zscore(r, ok, dim=1, eps=eps, unbiased=unbiased), ok)


@ESTIMATORS.register("turning_point", requires=("step_rewards",), reads="step_rewards", final_reward_step=True)
def turning_point(
    batch: GroupBatch,
    *,
    eta: float = 1.0,
    balance: bool = True,
    balance_by: str = "trend",
    eps: float = 1e-4,
    unbiased: bool = False,
) -> AdvantageResult:
    """TP-GRPO: incremental step rewards, with the aggregated long-term reward at turning points.

    step_rewards[p, g, k] for k = 0..T are the rewards of ODE completions along chain g: k = 0 is the
    pure-ODE sample from the same initial noise, k = T the final SDE sample. Output: [P, G, T], one
    advantage per SDE step, z-scored per (prompt, step) over the group.
    Turning points are found by sign changes only; `balance` keeps equally many positive and negative
    ones (largest |candidate| first), where the candidate is the global trend ("trend") or the bonus.
    """
    if balance_by not in ("trend", "bonus"):
        raise ValueError(f"balance_by: expected 'trend' or 'bonus', got {balance_by!r}")
    R, ok_nodes = _step_inputs(batch)
    if R.shape[-1] < 2:
        raise ValueError("step_rewards: turning_point needs T + 1 >= 2 probe rewards per chain")
    d = R[..., 1:] - R[..., :-1]  # d_k, k = 1..T
    final = R[..., -1:]
    trend = final - R[..., :1]  # R_sde - R_ode
    to_end = torch.sign(d) * torch.sign(final - R[..., 1:])  # does the rest of the chain keep d_k's direction?
    agrees = torch.sign(d) * torch.sign(trend)
    turning = torch.zeros_like(d, dtype=torch.bool)
    turning[..., 0] = to_end[..., 0] > 0
    turning[..., 1:] = (agrees[..., :-1] < 0) & (agrees[..., 1:] > 0) & (to_end[..., 1:] > 0)
    ok = ok_nodes[..., 1:] & ok_nodes[..., :-1] & ok_nodes[..., -1:] & ok_nodes[..., :1]
    turning &= ok
    bonus = eta * (final - R[..., :-1])  # B_k = eta (R_sde - R_{k-1})
    dropped = 0
    if balance:
        candidate = (trend.expand_as(d) if balance_by == "trend" else bonus).reshape(-1)
        flat_tp = turning.reshape(-1).clone()
        pos, neg = flat_tp & (candidate > 0), flat_tp & (candidate < 0)
        n_keep = int(min(pos.sum(), neg.sum()))
        if n_keep > 0:
            for side in (pos, neg):
                magnitude = torch.where(side, candidate.abs(), torch.full_like(candidate, -1.0))
                keep = torch.zeros_like(side)
                keep[magnitude.topk(n_keep).indices] = True
                flat_tp &= ~(side & ~keep)
        dropped = int(turning.sum()) - int(flat_tp.sum())
        turning = flat_tp.reshape(turning.shape)
    step_reward = torch.where(turning, bonus, d)
    adv = zscore(step_reward, ok, dim=1, eps=eps, unbiased=unbiased)
    return _step_result(
        adv, ok, **{"turning_point/count": float(turning.sum()), "turning_point/dropped_by_balance": float(dropped)}
    )


@ESTIMATORS.register("value_anchored", requires=("step_rewards",), reads="step_rewards")
def value_anchored(
    batch: GroupBatch,
    *,
    gamma: float = 0.95,
    k: float = 0.1,
    absolute_steps: int = 5,
    eps: float = 1e-4,
    unbiased: bool = False,
) -> AdvantageResult:
    """VGPO (UNVERIFIED constants and form): discounted step values with a value-anchored absolute term.

    step_rewards[p, g, t] is the instant reward of the one-step x0 projection at step t.
    Q_t = sum_{k>=t} gamma^(k-t) r_k;  w_t = Q_t / mean_t Q_t;
    A_t = w_t * ((Q_t - mean_g Q_t) / (std_g Q_t + eps) + k * Q_t * [t < absolute_steps]).
    gamma, k and this reading of the paper's Eq. 13 come from reviews, not from code: check them.
    """
    r, ok = _step_inputs(batch)
    r = torch.where(ok, r, torch.zeros_like(r))
    T = r.shape[-1]
    t = torch.arange(T, device=r.device)
    power = (t.unsqueeze(1) - t.unsqueeze(0)).float()  # [k, t] = k - t
    discount = torch.where(power >= 0, gamma ** power.clamp_min(0), torch.zeros_like(power))
    Q = r @ discount  # [P, G, T]
    mean_q = masked_mean(Q, ok, dim=2)
    omega = Q / torch.where(mean_q.abs() > eps, mean_q, torch.full_like(mean_q, eps))
    relative = zscore(Q, ok, dim=1, eps=eps, unbiased=unbiased)
    absolute = k * Q * (t < absolute_steps).float()
    return _step_result(omega * (relative + absolute), ok)


@ESTIMATORS.register("tree_depth", requires=("tree",), reads="tree")
def tree_depth(
    batch: GroupBatch,
    *,
    fusion: str = "mean",
    alpha: float = 1.0,
    eps: float = 1e-8,
    unbiased: bool = True,
    min_std: float = 1e-6,
) -> AdvantageResult:
    """BranchGRPO: fuse leaf rewards up the tree, then z-score per depth within each tree.

    fusion "mean": a node's value is the mean reward of its leaf descendants; "softmax": the
    softmax(alpha * edge log-prob)-weighted value of its children (needs tree.edge_logp).
    Depths with one node or std < min_std get advantage 0. Output: one advantage per node, [P, N].
    """
    tree = given(batch.tree, "GroupBatch.tree")
    P, N = tree.parent.shape
    dev = tree.parent.device
    leaf_r = batch.scalar_rewards()
    leaf_ok = batch.usable(leaf_r)
    # Work relative to each tree's best leaf: the z-scores are shift-invariant and both fusions
    # shift-equivariant, and a tree whose leaves tie then holds exact zeros (a float32 mean of three
    # 22.3s is not 22.3, and the per-depth z-score blows that ulp up to +-1).
    shift = torch.where(leaf_ok, leaf_r, torch.full_like(leaf_r, -math.inf)).amax(dim=1, keepdim=True)
    leaf_r = leaf_r - torch.where(torch.isfinite(shift), shift, torch.zeros_like(shift))

    def flat(idx: Tensor) -> Tensor:
        return (idx + torch.arange(P, device=idx.device).unsqueeze(1) * N).reshape(-1)

    value = torch.zeros(P * N, device=dev)
    count = torch.zeros(P * N, device=dev)
    value.index_put_(
        (flat(tree.leaf_index)[leaf_ok.reshape(-1)],), leaf_r.reshape(-1)[leaf_ok.reshape(-1)], accumulate=True
    )
    count.index_put_(
        (flat(tree.leaf_index)[leaf_ok.reshape(-1)],), torch.ones(int(leaf_ok.sum()), device=dev), accumulate=True
    )
    parent_flat = flat(tree.parent.clamp_min(0))
    depth = tree.depth.reshape(-1)
    node_valid = given(tree.node_valid, "tree.node_valid")
    child_of = (tree.parent.reshape(-1) >= 0) & node_valid.reshape(-1)
    if fusion == "softmax":
        if tree.edge_logp is None:
            raise ValueError("tree.edge_logp: fusion 'softmax' needs the edge log-probs")
        logit = alpha * tree.edge_logp.reshape(-1).float()
        value = value / count.clamp_min(1)  # leaves hold their reward
    elif fusion != "mean":
        raise ValueError(f"fusion: expected 'mean' or 'softmax', got {fusion!r}")
    for d in range(int(depth.max()), 0, -1):  # one vectorised pass per depth level
        at_d = child_of & (depth == d) & (count > 0)
        idx, parents = at_d.nonzero().squeeze(1), parent_flat[at_d]
        if fusion == "mean":
            value.index_add_(0, parents, value[idx])
            count.index_add_(0, parents, count[idx])
        else:
            top = torch.full((P * N,), -math.inf, device=dev).scatter_reduce(0, parents, logit[idx], "amax")
            w = torch.exp(logit[idx] - top[parents])
            num = torch.zeros(P * N, device=dev).index_add_(0, parents, w * value[idx])
            den = torch.zeros(P * N, device=dev).index_add_(0, parents, w)
            has = den > 0
            value = torch.where(has, num / den.clamp_min(1e-30), value)
            count = torch.where(has, torch.ones_like(count), count)
    node_ok = (count > 0) & node_valid.reshape(-1)
    node_value = value / count.clamp_min(1) if fusion == "mean" else value
    # z-score per (tree, depth)
    key = (torch.arange(P, device=dev).unsqueeze(1) * (int(depth.max()) + 1) + tree.depth).reshape(-1)
    n_keys = P * (int(depth.max()) + 1)
    okf = node_ok.float()
    n = torch.zeros(n_keys, device=dev).index_add_(0, key, okf)
    mean = torch.zeros(n_keys, device=dev).index_add_(0, key, okf * node_value) / n.clamp_min(1)
    var = torch.zeros(n_keys, device=dev).index_add_(0, key, okf * (node_value - mean[key]) ** 2) / (
        n - int(unbiased)
    ).clamp_min(1)
    std = var.sqrt()
    spread = (n >= 2) & (std >= min_std)
    adv = torch.where(node_ok & spread[key], (node_value - mean[key]) / (std[key] + eps), torch.zeros_like(node_value))
    weight = (node_ok & child_of).float()
    return AdvantageResult(
        adv.reshape(P, N),
        weight.reshape(P, N),
        "node",
        {"tree/degenerate_depth_frac": float((~spread & (n > 0)).sum() / (n > 0).sum().clamp_min(1))},
    )


def reward_metrics(batch: GroupBatch) -> dict[str, float]:
    """Reward mean / std per head and combined, NaN count, and the fraction of zero-spread groups."""
    out: dict[str, float] = {}
    if batch.rewards is not None:
        heads = batch.head_rewards().float()
        for k, name in enumerate(given(batch.reward_names, "GroupBatch.reward_names")):
            h = heads[..., k]
            ok = batch.usable(h)
            out[f"rewards/{name}/mean"] = float(h[ok].mean()) if bool(ok.any()) else math.nan
            out[f"rewards/{name}/std"] = float(h[ok].std(unbiased=False)) if bool(ok.any()) else math.nan
        r = batch.scalar_rewards()
        ok = batch.usable(r)
        out["reward_mean"] = float(r[ok].mean()) if bool(ok.any()) else math.nan
        out["reward_std"] = float(r[ok].std(unbiased=False)) if bool(ok.any()) else math.nan
        out["rewards/nan_count"] = float((batch.mask & ~torch.isfinite(r)).sum())
        has = masked_count(ok, 1).squeeze(1) > 0
        flat = masked_std(r, ok, dim=1, unbiased=False).squeeze(1) == 0
        out["zero_std_frac"] = float((flat & has).sum() / has.sum().clamp_min(1))
    if batch.step_rewards is not None:
        step_mask, step_rewards = given(batch.step_mask, "step_mask"), given(batch.step_rewards, "step_rewards")
        out["rewards/step_nan_count"] = float((step_mask & ~torch.isfinite(step_rewards)).sum())
    return out


def advantage_metrics(result: AdvantageResult) -> dict[str, float]:
    live = result.sample_weight > 0
    a = result.advantages[live]
    if a.numel() == 0:
        return {"adv/num_live": 0.0}
    return {
        "adv/num_live": float(a.numel()),
        "adv/mean": float(a.mean()),
        "adv/std": float(a.std(unbiased=False)),
        "adv/abs_max": float(a.abs().max()),
        "adv/num_positive": float((a > 0).sum()),
        "adv/num_negative": float((a < 0).sum()),
    }
