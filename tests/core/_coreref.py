"""Independent reference formulas for the flowgrpo.core tests.

Everything here is plain numpy (float64) with explicit loops, written from the papers' formulas
(GRPO-family text methods; Flow-GRPO and the flow methods after it), never by calling back into
flowgrpo.core. "usable" = valid and finite, the NaN-as-missing convention (docs/architecture.md).
"""

from __future__ import annotations

import itertools
import math
import os

import numpy as np
import torch
from hypothesis import settings

_SCALE = int(os.environ.get("FLOWGRPO_CORE_EXAMPLES_SCALE", "1"))  # e.g. 10 for a longer soak
SETTINGS = settings(max_examples=30 * _SCALE, deadline=None, database=None)
FEW = settings(max_examples=15 * _SCALE, deadline=None, database=None)


# --- random inputs ------------------------------------------------------------------------------


def random_rewards(
    rng: np.random.Generator,
    P: int,
    G: int,
    kind: str = "normal",
    nan_frac: float = 0.0,
    invalid_frac: float = 0.0,
    K: int | None = None,
):
    """float32-representable rewards (float64 array), a NaN pattern and a valid mask."""
    shape = (P, G) if K is None else (P, G, K)
    if kind == "normal":
        r = rng.normal(size=shape)
    elif kind == "binary":
        r = rng.integers(0, 2, size=shape).astype(np.float64)
    elif kind == "unit":
        r = rng.uniform(0, 1, size=shape)
    else:
        raise ValueError(kind)
    r = r.astype(np.float32).astype(np.float64)
    if nan_frac:
        r[rng.uniform(size=shape) < nan_frac] = np.nan
    valid = rng.uniform(size=(P, G)) >= invalid_frac
    return r, valid


def t32(a) -> torch.Tensor:
    return torch.as_tensor(np.asarray(a, dtype=np.float32))


def tb(a) -> torch.Tensor:
    return torch.as_tensor(np.asarray(a, dtype=bool))


def np64(t: torch.Tensor) -> np.ndarray:
    return t.detach().double().numpy()


# --- group statistics ---------------------------------------------------------------------------


def std(values, unbiased: bool) -> float:
    """Std of a list; 0 for fewer than two values."""
    v = np.asarray(values, dtype=np.float64)
    if len(v) < 2:
        return 0.0
    return float(np.std(v, ddof=1 if unbiased else 0))


def group_members(r: np.ndarray, valid: np.ndarray, p: int) -> list[int]:
    return [g for g in range(r.shape[1]) if valid[p, g] and np.isfinite(r[p, g])]


def ref_grpo(r, valid, eps=1e-4, unbiased=True, scope="group"):
    P, G = r.shape
    out = np.zeros((P, G))
    all_usable = [r[p, g] for p in range(P) for g in group_members(r, valid, p)]
    for p in range(P):
        idx = group_members(r, valid, p)
        if not idx:
            continue
        vals = [r[p, g] for g in idx]
        mean = sum(vals) / len(vals)
        for g in idx:
            if scope == "group":
                out[p, g] = (r[p, g] - mean) / (std(vals, unbiased) + eps)
            elif scope == "batch":
                out[p, g] = (r[p, g] - mean) / (std(all_usable, unbiased) + eps)
            else:
                out[p, g] = r[p, g] - mean
    return out


def ref_rloo(r, valid):
    P, G = r.shape
    out = np.zeros((P, G))
    for p in range(P):
        idx = group_members(r, valid, p)
        if len(idx) < 2:
            continue
        for g in idx:
            others = [r[p, j] for j in idx if j != g]
            out[p, g] = r[p, g] - sum(others) / len(others)
    return out


def ref_batch_whiten(r, valid, eps=1e-8):
    P, G = r.shape
    centred = {}
    for p in range(P):
        idx = group_members(r, valid, p)
        if not idx:
            continue
        mean = sum(r[p, g] for g in idx) / len(idx)
        for g in idx:
            centred[(p, g)] = r[p, g] - mean
    out = np.zeros((P, G))
    vals = list(centred.values())
    if not vals:
        return out
    m, s = sum(vals) / len(vals), std(vals, True)
    for (p, g), c in centred.items():
        out[p, g] = (c - m) / (s + eps)
    return out


def lower_median(values):
    v = sorted(values)
    return v[(len(v) - 1) // 2]


def ref_mc_grpo(r, valid, floor=1e-3, rescale=True):
    """Returns advantages, weights; the pivot is the sample whose reward is the (lower) median."""
    P, G = r.shape
    adv, weight = np.zeros((P, G)), valid.astype(np.float64).copy()
    for p in range(P):
        idx = group_members(r, valid, p)
        if not idx:
            continue
        b = lower_median([r[p, g] for g in idx])
        s = lower_median([abs(r[p, g] - b) for g in idx]) + floor
        pivot = [g for g in idx if r[p, g] == b][0]
        for g in idx:
            adv[p, g] = 0.0 if g == pivot else (r[p, g] - b) / s
        weight[p, pivot] = 0.0
        if rescale:
            nonzero = sum(1 for g in idx if adv[p, g] != 0)
            if nonzero:
                for g in idx:
                    adv[p, g] *= len(idx) / nonzero
    return adv, weight


def ref_ngrpo(r, valid, r_max=1.0, n_virtual=1, eps=1e-6):
    P, G = r.shape
    out = np.zeros((P, G))
    for p in range(P):
        idx = group_members(r, valid, p)
        stats = [r[p, g] for g in idx] + [r_max] * n_virtual
        mean, s = sum(stats) / len(stats), std(stats, True)
        for g in idx:
            out[p, g] = (r[p, g] - mean) / (s + eps)
    return out


def ref_dgpo(r, valid, eps=1e-4, question_weights=True, temperature=2.0, primary=None):
    """DGAE then DQW; `primary` is the first head (defaults to r)."""
    P, G = r.shape
    primary = r if primary is None else primary
    out = np.zeros((P, G))
    dev_sum = np.zeros(P)
    for p in range(P):
        idx = group_members(r, valid, p)
        if not idx:
            continue
        mean = sum(r[p, g] for g in idx) / len(idx)
        dev_sum[p] = sum(abs(r[p, g] - mean) for g in idx)
        for g in idx:
            out[p, g] = len(idx) * (r[p, g] - mean) / (dev_sum[p] + eps)
    if question_weights:
        live = [p for p in range(P) if dev_sum[p] > 0]
        acc = {}
        for p in live:
            pidx = group_members(primary, valid, p)
            acc[p] = sum(primary[p, g] for g in pidx) / max(len(pidx), 1)
        z = sum(math.exp(-acc[q] / temperature) for q in live)
        for p in range(P):
            w = len(live) * math.exp(-acc[p] / temperature) / z if p in live else 0.0
            out[p] *= w
    return out


def ref_a_grae(r, valid, alpha=1.0, eps=1e-6, std_eps=1e-4):
    P, G = r.shape
    base = ref_grpo(r, valid, eps=std_eps, unbiased=True)
    acc = np.zeros(P)
    has = []
    for p in range(P):
        idx = group_members(r, valid, p)
        if idx:
            acc[p] = min(max(sum(r[p, g] for g in idx) / len(idx), 0.0), 1.0)
            has.append(p)
    p_bar = sum(acc[p] for p in has) / len(has) if has else 0.0
    out = np.zeros((P, G))
    for p in range(P):
        for g in group_members(r, valid, p):
            hard = base[p, g] / (2 * (math.sqrt(acc[p]) + eps))
            easy = base[p, g] / (2 * (1 - math.sqrt(acc[p]) + eps))
            a = (1 - p_bar) * easy + p_bar * hard
            if a > 0:
                a *= min(1.0, p_bar / alpha)
            out[p, g] = a
    return out


def ref_sign_reinforce(r, valid, lam):
    """W-REINFORCE on rewards in [0, 1]: lambda * r - (1 - r) (lambda for r = 1, -1 for r = 0)."""
    out = np.zeros(r.shape)
    for p in range(r.shape[0]):
        for g in group_members(r, valid, p):
            out[p, g] = lam * r[p, g] - (1 - r[p, g])
    return out


def ref_scalar(heads, weights, policy):
    """Weighted head sum with the NaN policy: 'propagate' (any NaN -> NaN) or 'ignore_head'."""
    P, G, K = heads.shape
    out = np.zeros((P, G))
    for p in range(P):
        for g in range(G):
            vals = [(weights[k], heads[p, g, k]) for k in range(K)]
            if policy == "propagate":
                out[p, g] = sum(w * v for w, v in vals)
            else:
                ok = [(w, v) for w, v in vals if not math.isnan(v)]
                out[p, g] = sum(w * v for w, v in ok) if ok else math.nan
    return out


def ref_gdpo(heads, valid, weights, eps=1e-4, unbiased=True, policy="propagate"):
    P, G, K = heads.shape
    normed = np.zeros((P, G, K))
    for k in range(K):
        h = heads[..., k]
        for p in range(P):
            idx = group_members(h, valid, p)
            if not idx:
                continue
            vals = [h[p, g] for g in idx]
            mean, s = sum(vals) / len(vals), std(vals, unbiased)
            for g in idx:
                normed[p, g, k] = (h[p, g] - mean) / (s + eps)
    S = {}
    for p in range(P):
        for g in range(G):
            if not valid[p, g]:
                continue
            fin = [np.isfinite(heads[p, g, k]) for k in range(K)]
            if all(fin) if policy == "propagate" else any(fin):
                S[(p, g)] = sum(weights[k] * normed[p, g, k] for k in range(K))
    out = np.zeros((P, G))
    vals = list(S.values())
    if vals:
        m, s = sum(vals) / len(vals), std(vals, unbiased)
        for key, v in S.items():
            out[key] = (v - m) / (s + eps)
    return out


def ref_win_rates(pref, valid):
    """Pref-GRPO: w_i = (#wins + 0.5 #undecided) / (n - 1), pairs among valid samples only."""
    P, G, _ = pref.shape
    rates = np.full((P, G), np.nan)
    for p in range(P):
        idx = [g for g in range(G) if valid[p, g]]
        if len(idx) < 2:
            continue
        for i in idx:
            total = 0.0
            for j in idx:
                if j == i:
                    continue
                total += 0.5 if math.isnan(pref[p, i, j]) else pref[p, i, j]
            rates[p, i] = total / (len(idx) - 1)
    return rates


def ref_group_z(values, eps, unbiased):
    """z-score of each row of `values` [P, G] over its finite entries; 0 elsewhere."""
    P, G = values.shape
    out = np.zeros((P, G))
    for p in range(P):
        idx = [g for g in range(G) if np.isfinite(values[p, g])]
        if not idx:
            continue
        vals = [values[p, g] for g in idx]
        mean, s = sum(vals) / len(vals), std(vals, unbiased)
        for g in idx:
            out[p, g] = (values[p, g] - mean) / (s + eps)
    return out


# --- step-level ---------------------------------------------------------------------------------


def ref_step_z(values, ok, eps, unbiased):
    """z-score over the group axis (1) for every (prompt, step) of [P, G, T]; 0 where not ok."""
    P, G, T = values.shape
    out = np.zeros((P, G, T))
    for p in range(P):
        for t in range(T):
            idx = [g for g in range(G) if ok[p, g, t]]
            if not idx:
                continue
            vals = [values[p, g, t] for g in idx]
            mean, s = sum(vals) / len(vals), std(vals, unbiased)
            for g in idx:
                out[p, g, t] = (values[p, g, t] - mean) / (s + eps)
    return out


def sgn(x: float) -> int:
    return int(x > 0) - int(x < 0)


def ref_turning_point_rewards(R, eta=1.0, balance=True, balance_by="trend"):
    """TP-GRPO process rewards (the TP-GRPO paper), chain by chain.

    R: [P, G, T+1] ODE-completed rewards, R[..., 0] = pure ODE, R[..., T] = final SDE sample.
    Returns (options, turning count before balancing). `options` lists every (step rewards [P, G, T],
    turning mask) the balancing rule allows: "keep the min(#pos, #neg) largest |candidate| of each sign"
    leaves the choice among equal candidates open (with balance_by="trend" all turning points of one chain
    share its trend), so each way of breaking such ties is one option.
    """
    P, G, T1 = R.shape
    T = T1 - 1
    tp = np.zeros((P, G, T), dtype=bool)
    d = np.zeros((P, G, T))
    bonus = np.zeros((P, G, T))
    cand = np.zeros((P, G, T))
    for p in range(P):
        for g in range(G):
            r = R[p, g]
            trend = r[T] - r[0]
            s = {}
            for k in range(1, T + 1):
                d[p, g, k - 1] = r[k] - r[k - 1]
                bonus[p, g, k - 1] = eta * (r[T] - r[k - 1])
                s[k] = sgn(d[p, g, k - 1]) * sgn(trend)
                cand[p, g, k - 1] = trend if balance_by == "trend" else bonus[p, g, k - 1]
            for k in range(1, T + 1):
                onward = sgn(d[p, g, k - 1]) * sgn(r[T] - r[k]) > 0
                if k == 1:
                    tp[p, g, 0] = onward
                else:
                    tp[p, g, k - 1] = s[k - 1] < 0 and s[k] > 0 and onward
    before = int(tp.sum())
    masks = [tp]
    if balance:
        pos = [i for i in zip(*np.nonzero(tp)) if cand[i] > 0]
        neg = [i for i in zip(*np.nonzero(tp)) if cand[i] < 0]
        n = min(len(pos), len(neg))
        if n > 0:
            side_choices = []
            for side in (pos, neg):
                mags = sorted((abs(cand[i]) for i in side), reverse=True)
                threshold = mags[n - 1]
                must = [i for i in side if abs(cand[i]) > threshold]
                ties = [i for i in side if abs(cand[i]) == threshold]
                side_choices.append([must + list(c) for c in itertools.combinations(ties, n - len(must))])
            masks = []
            for keep_pos in side_choices[0]:
                for keep_neg in side_choices[1]:
                    m = tp.copy()
                    for i in pos + neg:
                        m[i] = False
                    for i in keep_pos + keep_neg:
                        m[i] = True
                    masks.append(m)
    return [(np.where(m, bonus, d), m) for m in masks], before


def ref_value_anchored(r, ok, gamma, k, absolute_steps, eps, unbiased):
    """VGPO per the estimator's docstring; steps that are not ok hold reward 0 and are left out of stats."""
    P, G, T = r.shape
    rr = np.where(ok, r, 0.0)
    Q = np.zeros((P, G, T))
    for p in range(P):
        for g in range(G):
            for t in range(T):
                Q[p, g, t] = sum(gamma ** (j - t) * rr[p, g, j] for j in range(t, T))
    rel = ref_step_z(Q, ok, eps, unbiased)
    out = np.zeros((P, G, T))
    for p in range(P):
        for g in range(G):
            ts = [t for t in range(T) if ok[p, g, t]]
            mean_q = sum(Q[p, g, t] for t in ts) / max(len(ts), 1)
            denom = mean_q if abs(mean_q) > eps else eps
            for t in ts:
                absolute = k * Q[p, g, t] if t < absolute_steps else 0.0
                out[p, g, t] = Q[p, g, t] / denom * (rel[p, g, t] + absolute)
    return out


def ref_tree_depth(
    parents, depths, leaf_of, rewards, fusion="mean", edge_logp=None, alpha=1.0, eps=1e-8, unbiased=True, min_std=1e-6
):
    """BranchGRPO on one tree given as python lists. leaf_of[g] = node of sample g (None = no sample).

    Returns (advantage per node, value per node or None).
    """
    N = len(parents)
    children = {n: [c for c in range(N) if parents[c] == n] for n in range(N)}
    leaf_rewards = {n: [] for n in range(N)}
    for g, node in enumerate(leaf_of):
        if node is not None and np.isfinite(rewards[g]):
            leaf_rewards[node].append(rewards[g])

    def leaves_below(n):
        out = list(leaf_rewards[n])
        for c in children[n]:
            out += leaves_below(c)
        return out

    def softmax_value(n):
        kids = [c for c in children[n] if softmax_value(c) is not None]
        if not kids:
            return sum(leaf_rewards[n]) / len(leaf_rewards[n]) if leaf_rewards[n] else None
        logits = [alpha * edge_logp[c] for c in kids]
        top = max(logits)
        w = [math.exp(x - top) for x in logits]
        return sum(wi * softmax_value(c) for wi, c in zip(w, kids)) / sum(w)

    value = {}
    for n in range(N):
        if fusion == "mean":
            below = leaves_below(n)
            value[n] = sum(below) / len(below) if below else None
        else:
            value[n] = softmax_value(n)
    adv = np.zeros(N)
    for d in set(depths):
        nodes = [n for n in range(N) if depths[n] == d and value[n] is not None]
        vals = [value[n] for n in nodes]
        if len(vals) < 2:
            continue
        mean, s = sum(vals) / len(vals), std(vals, unbiased)
        if s < min_std:
            continue
        for n in nodes:
            adv[n] = (value[n] - mean) / (s + eps)
    return adv, value


# --- losses -------------------------------------------------------------------------------------


def ref_policy_loss(inp: dict, cfg: dict, norm_from: dict | None = None) -> tuple[float, np.ndarray]:
    """The policy loss as the papers write it (PPO clip, DAPO, GSPO, SAPO, CISPO; Flow-GRPO, GRPO-Guard),
    action by action. `inp` holds float64 arrays [N, T] (advantages and sample_weight already [N, T]);
    `norm_from` is the whole batch the global normalisers are counted on (default: `inp`).
    Returns the scalar loss and the per-action terms (0 where the mask is False).
    cfg keys: ratio, bounds (name, settings), surrogate (name, settings), weighting, kl (name, coef),
    entropy_coef, aggregation, const_len, clamp.
    """

    def dropped(d):  # a zero sample weight removes the action from the mask (LossInputs contract)
        sw = d.get("sw")
        return {**d, "mask": d["mask"] & (sw != 0)} if sw is not None else d

    inp = dropped(inp)
    nf = dropped(norm_from or inp)
    logp, old, A, mask = inp["logp"], inp["logp_old"], inp["adv"], inp["mask"]
    N, T = logp.shape
    clamp = cfg.get("clamp", 20.0)
    # global counts
    g_mask, g_adv = nf["mask"], nf["adv"]
    num_tokens = float(g_mask.sum())
    num_seqs = float(sum(1 for i in range(g_mask.shape[0]) if g_mask[i].any()))
    pos_tokens = float(
        sum(1 for i in range(g_mask.shape[0]) for t in range(g_mask.shape[1]) if g_mask[i, t] and g_adv[i, t] > 0)
    )
    neg_tokens = float(
        sum(1 for i in range(g_mask.shape[0]) for t in range(g_mask.shape[1]) if g_mask[i, t] and g_adv[i, t] < 0)
    )
    pos_seqs = float(
        sum(1 for i in range(g_mask.shape[0]) if any(g_mask[i, t] and g_adv[i, t] > 0 for t in range(g_mask.shape[1])))
    )
    neg_seqs = float(
        sum(1 for i in range(g_mask.shape[0]) if any(g_mask[i, t] and g_adv[i, t] < 0 for t in range(g_mask.shape[1])))
    )
    std_mean = None
    if "std" in nf and nf["std"] is not None:
        std_mean = sum(
            nf["std"][i, t] for i in range(g_mask.shape[0]) for t in range(g_mask.shape[1]) if g_mask[i, t]
        ) / max(num_tokens, 1.0)

    per = np.zeros((N, T))
    for i in range(N):
        ts = [t for t in range(T) if mask[i, t]]
        seq_lr = sum(logp[i, t] - old[i, t] for t in ts) / max(len(ts), 1)
        for t in range(T):
            lr = logp[i, t] - old[i, t]
            ratio_name = cfg.get("ratio", "token")
            if ratio_name == "token":
                r = math.exp(min(max(lr, -clamp), clamp))
            elif ratio_name in ("sequence", "sequence_token"):
                r = math.exp(min(max(seq_lr, -clamp), clamp))
            elif ratio_name == "ratio_norm":
                s = inp["std"][i, t]
                r = math.exp(min(max(s * (lr + inp["msd_old"][i, t] / (2 * s * s)), -clamp), clamp))
            else:
                raise ValueError(ratio_name)
            bname, bset = cfg.get("bounds", ("symmetric", {}))
            if bname == "symmetric":
                lo, hi = 1 - bset.get("eps", 0.2), 1 + bset.get("eps", 0.2)
            elif bname == "asymmetric":
                lo, hi = 1 - bset.get("eps_low", 0.2), 1 + bset.get("eps_high", 0.28)
            elif bname == "dcpo":
                q = max(math.exp(old[i, t]), 1e-12)
                lo = 0.5 + 0.5 * math.sqrt(max(1 - 4 * bset.get("eps_low", 0.16) / q, 0.0))
                hi = 0.5 + 0.5 * math.sqrt(1 + 4 * bset.get("eps_high", 0.2) / q)
            else:
                raise ValueError(bname)
            a = A[i, t]
            sname, sset = cfg.get("surrogate", ("ppo_clip", {}))
            if sname == "ppo_clip":
                delta, dual = sset.get("delta"), sset.get("dual_clip")
                rt = min(r, delta) if delta is not None else r
                L = max(-a * rt, -a * min(max(r, lo), hi))
                if dual is not None and a < 0:
                    L = min(L, -a * dual)
            elif sname == "sapo":
                tau = sset.get("tau_pos", 1.0) if a > 0 else sset.get("tau_neg", 1.05)
                L = -(4 / tau) * (1 / (1 + math.exp(-tau * (r - 1)))) * a
            elif sname == "cispo":
                L = -min(max(r, lo), hi) * a * logp[i, t]
            elif sname == "reinforce":
                L = -a * logp[i, t]
            else:
                raise ValueError(sname)
            w = 1.0
            wname = cfg.get("weighting", "none")
            if wname == "inv_dt":
                w = 1.0 / inp["dt"][i, t]
            elif wname == "noise_aware":
                w = inp["std"][i, t] / std_mean
            if inp.get("sw") is not None:
                w *= inp["sw"][i, t]
            L *= w
            kname, kcoef = cfg.get("kl", ("k3", 0.0))
            if kcoef:
                if kname == "gaussian":
                    kl = inp["msd_ref"][i, t] / (2 * inp["std"][i, t] ** 2)
                elif kname == "flow_grpo":  # divides by std_dev_t^2 = std^2 / dt
                    kl = inp["msd_ref"][i, t] / (2 * inp["std"][i, t] ** 2 / inp["dt"][i, t])
                else:
                    x = logp[i, t] - inp["logp_ref"][i, t]  # log pi - log pi_ref
                    kl = {"k1": x, "k2": 0.5 * x * x, "k3": math.exp(-x) + x - 1, "k3+": math.exp(-x) + x - 1}[kname]
                L += kcoef * kl
            if cfg.get("entropy_coef"):
                L -= cfg["entropy_coef"] * inp["entropy"][i, t]
            per[i, t] = L

    agg = cfg.get("aggregation", "token_mean")
    per = np.where(mask, per, 0.0)
    total = sum(per[i, t] for i in range(N) for t in range(T) if mask[i, t])
    if agg == "token_mean":
        loss = total / max(num_tokens, 1.0)
    elif agg == "local_token_mean":
        loss = total / max(float(mask.sum()), 1.0)
    elif agg == "seq_mean_token_mean":
        loss = 0.0
        for i in range(N):
            ts = [t for t in range(T) if mask[i, t]]
            if ts:
                loss += sum(per[i, t] for t in ts) / len(ts)
        loss /= max(num_seqs, 1.0)
    elif agg == "seq_mean_token_sum":
        loss = total / max(num_seqs, 1.0)
    elif agg == "seq_mean_token_sum_norm":
        loss = total / (max(num_seqs, 1.0) * (cfg.get("const_len") or T))
    elif agg == "balanced":
        pos = sum(per[i, t] for i in range(N) for t in range(T) if mask[i, t] and A[i, t] > 0)
        neg = sum(per[i, t] for i in range(N) for t in range(T) if mask[i, t] and A[i, t] < 0)
        pos_mean, neg_mean = pos / max(pos_tokens, 1.0), neg / max(neg_tokens, 1.0)
        loss = (pos_seqs * pos_mean + neg_seqs * neg_mean) / max(pos_seqs + neg_seqs, 1.0)
    else:
        raise ValueError(agg)
    return loss, per
