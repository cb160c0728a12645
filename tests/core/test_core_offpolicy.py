"""The REC / REP / RED family (surrogate `rec`, regularisers `opmd` / `asymre`, estimator `rec`, their presets)
against float64 re-derivations of Trinity-RFT's code (yanxi-chen/Trinity-RFT @ 9051d63):
rec_policy_loss.py `RECPolicyLossFn.__call__` and rec_advantage.py `RECGroupedAdvantage.calculate_group_advantage`,
written here as plain loops."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from _coreref import np64, random_rewards, t32, tb
from flowgrpo.core import PRESETS, REGULARIZERS, AdvantageConfig, GroupBatch, LossConfig, LossInputs, policy_loss
from flowgrpo.core.offpolicy import REC_PRESETS, add_presets, rec, rec_advantage
from flowgrpo.core.stages import compute_advantages

CLIP_MODES = ["none", "one-side", "two-side", "ring"]
WEIGHTS = ["none", "importance_sampling", "advantage"]


def inputs(seed=5, N=6, T=7, spread=0.4):
    rng = np.random.default_rng(seed)
    f = lambda a: np.asarray(a, dtype=np.float32).astype(np.float64)  # noqa: E731
    old = f(np.log(rng.uniform(0.05, 1.0, size=(N, T))))
    logp = f(old + rng.normal(0, spread, size=(N, T)))
    adv = f(np.repeat(rng.normal(size=(N, 1)), T, 1))
    adv[0] = 0.0  # A = 0 sits on both sides of the one-side mask
    lengths = rng.integers(1, T + 1, size=N)
    mask = np.arange(T)[None, :] < lengths[:, None]
    return logp, old, adv, mask


def trinity_rec(logp, old, adv, mask, *, el, eh, elp=0.6, ehp=2.0, clip_mode, weight, temp=1.0, reg="none", coef=0.0):
    """RECPolicyLossFn.__call__ action by action (its token ratio; the masked mean over every action)."""
    N, T = logp.shape
    total, count = 0.0, 0
    for i in range(N):
        for t in range(T):
            if not mask[i, t]:
                continue
            r, a, lp = math.exp(logp[i, t] - old[i, t]), adv[i, t], logp[i, t]
            if clip_mode == "two-side":
                keep = 1 - el <= r <= 1 + eh
            elif clip_mode == "one-side":
                keep = (r <= 1 + eh and a >= 0) or (a <= 0 and r >= 1 - el)
            elif clip_mode == "ring":
                keep = (1 - el <= r <= 1 + eh) or (a >= 0 and r <= 1 - elp) or (a <= 0 and r >= 1 + ehp)
            else:
                keep = True
            w = {"none": a, "importance_sampling": a * r, "advantage": a * math.exp(a / temp)}[weight]
            loss = -w * lp * float(keep)
            if reg == "forward-kl":
                loss -= coef * lp
            elif reg == "k2":
                loss += coef * (lp - old[i, t]) ** 2
            total += loss
            count += 1
    return total / count


def loss_of(logp, old, adv, mask, cfg, requires_grad=False):
    lp = torch.tensor(logp, dtype=torch.float32, requires_grad=requires_grad)
    inp = LossInputs(lp, t32(old), t32(adv), torch.tensor(mask))
    return policy_loss(inp, cfg), lp


@pytest.mark.parametrize("clip_mode", CLIP_MODES)
@pytest.mark.parametrize("weight", WEIGHTS)
def test_rec_surrogate_matches_trinity(clip_mode, weight):
    logp, old, adv, mask = inputs()
    for el, eh, temp in [(0.2, 0.2, 1.0), (0.1, 0.3, 0.5)]:
        cfg = LossConfig(
            bounds={"name": "asymmetric", "eps_low": el, "eps_high": eh},
            surrogate={"name": "rec", "clip_mode": clip_mode, "weight": weight, "temp": temp},
            aggregation="token_mean",
        )
        want = trinity_rec(logp, old, adv, mask, el=el, eh=eh, clip_mode=clip_mode, weight=weight, temp=temp)
        assert float(loss_of(logp, old, adv, mask, cfg)[0].loss) == pytest.approx(want, rel=1e-5, abs=1e-7)


def test_rec_masks_differ_where_the_ratio_leaves_the_band():
    """The fixture has ratios outside every band, so each clip mode gives a different loss (the test can fail)."""
    logp, old, adv, mask = inputs(spread=1.0)
    r = np.exp(logp - old)[mask]
    assert (r < 0.4).any() and (r > 3.0).any()  # the ring's outer band
    values = {
        m: float(loss_of(logp, old, adv, mask, LossConfig(surrogate={"name": "rec", "clip_mode": m}))[0].loss)
        for m in CLIP_MODES
    }
    assert len(set(np.round(list(values.values()), 6))) == 4, values


@pytest.mark.parametrize("reg,name", [("k2", "opmd"), ("forward-kl", "asymre")])
def test_rep_regularisers_match_trinity(reg, name):
    logp, old, adv, mask = inputs(seed=7)
    for coef in (0.1, 0.7):
        cfg = LossConfig(surrogate={"name": "rec", "clip_mode": "none"}, regularizer={"name": name, "coef": coef})
        out = loss_of(logp, old, adv, mask, cfg)[0]
        want = trinity_rec(logp, old, adv, mask, el=0.2, eh=0.2, clip_mode="none", weight="none", reg=reg, coef=coef)
        assert float(out.loss) == pytest.approx(want, rel=1e-5, abs=1e-7)
        assert f"reg/{name}_mean" in out.metrics
    assert REGULARIZERS.get("none").fn(None) == 0.0


def test_rec_gradient_has_the_ratio_and_mask_without_gradient():
    """d loss / d log pi_t = -w A M / #actions: the importance weight and the mask are constants."""
    logp, old, adv, mask = inputs(seed=9)
    cfg = LossConfig(surrogate={"name": "rec", "clip_mode": "two-side", "weight": "importance_sampling"})
    out, lp = loss_of(logp, old, adv, mask, cfg, requires_grad=True)
    out.loss.backward()
    r = np.exp(logp - old)
    keep = (r >= 0.8) & (r <= 1.2)
    want = np.where(mask, -adv * r * keep, 0.0) / mask.sum()
    np.testing.assert_allclose(np64(lp.grad), want, rtol=1e-5, atol=1e-8)


def trinity_gspo_rec(logp, old, adv, mask, el, eh, weight):
    """clip_mode gspo-one-side: the sequence ratio in the mask (and the weight), seq-mean-token-mean."""
    per_seq = []
    for i in range(logp.shape[0]):
        ts = [t for t in range(logp.shape[1]) if mask[i, t]]
        s = math.exp(sum(logp[i, t] - old[i, t] for t in ts) / len(ts))
        terms = []
        for t in ts:
            a = adv[i, t]
            keep = (s <= 1 + eh and a >= 0) or (s >= 1 - el and a <= 0)
            w = a * s if weight == "importance_sampling" else a
            terms.append(-w * logp[i, t] * float(keep))
        per_seq.append(sum(terms) / len(terms))
    return sum(per_seq) / len(per_seq)


@pytest.mark.parametrize("name,weight", [("rec_gspo_nois", "none"), ("rec_gspo_is", "importance_sampling")])
def test_rec_gspo_presets_match_trinity(name, weight):
    logp, old, adv, mask = inputs(seed=11, spread=3e-4)
    want = trinity_gspo_rec(logp, old, adv, mask, 3e-4, 4e-4, weight)
    assert float(loss_of(logp, old, adv, mask, LossConfig(preset=name))[0].loss) == pytest.approx(want, rel=1e-5)


PRESET_TRINITY = {  # examples/rec_gsm8k/README.md: the policy_loss_fn_args of each variant
    "rec_one_side_nois": dict(clip_mode="one-side", weight="none"),
    "rec_one_side_is": dict(clip_mode="one-side", weight="importance_sampling"),
    "rec_two_side_is": dict(clip_mode="two-side", weight="importance_sampling"),
    "rec_ring_nois": dict(clip_mode="ring", weight="none"),
    "opmd": dict(clip_mode="none", weight="none", reg="k2", coef=0.1),
    "asymre": dict(clip_mode="none", weight="none", reg="forward-kl", coef=0.1),
    "red_weight": dict(clip_mode="none", weight="advantage"),
}


def test_every_rec_preset_is_checked():
    assert set(REC_PRESETS) == set(PRESET_TRINITY) | {"rec_gspo_nois", "rec_gspo_is"}
    assert set(REC_PRESETS) <= set(PRESETS)
    with pytest.raises(ValueError, match=r"loss preset\(s\) \['dapo'\] already defined"):
        add_presets({"dapo": {}, "new_one": {}})
    assert "new_one" not in PRESETS


@pytest.mark.parametrize("name", sorted(PRESET_TRINITY))
def test_rec_presets_match_trinity(name):
    logp, old, adv, mask = inputs(seed=13)
    want = trinity_rec(logp, old, adv, mask, el=0.2, eh=0.2, **PRESET_TRINITY[name])
    assert float(loss_of(logp, old, adv, mask, LossConfig(preset=name))[0].loss) == pytest.approx(want, rel=1e-5)


def test_rec_surrogate_rejects_unknown_modes():
    logp, old, adv, mask = inputs()
    with pytest.raises(ValueError, match="clip_mode"):
        loss_of(logp, old, adv, mask, LossConfig(surrogate={"name": "rec", "clip_mode": "both"}))
    with pytest.raises(ValueError, match="weight"):
        loss_of(logp, old, adv, mask, LossConfig(surrogate={"name": "rec", "weight": "is"}))
    for bad in ({"clip_mode": "x"}, {"weight": "x"}):  # the function itself, called without a config
        with pytest.raises(ValueError, match=next(iter(bad))):
            rec(None, **bad)  # type: ignore[arg-type]


# --- estimator `rec` (REC / RED-Drop) ------------------------------------------------------------


def trinity_rec_advantage(r, valid, std_normalize, drop, eps=1e-6):
    """RECGroupedAdvantage per group over the usable samples; the dropped negatives are the last ones."""
    P, G = r.shape
    out = np.zeros((P, G))
    dropped_total = 0
    for p in range(P):
        idx = [g for g in range(G) if valid[p, g] and np.isfinite(r[p, g])]
        if len(idx) < 2:
            continue
        vals = np.array([r[p, g] for g in idx])
        is_pos = vals >= vals.mean()
        neg = [g for g, pos in zip(idx, is_pos) if not pos]
        extra = len(neg) - int(is_pos.sum())
        drop_set = set(neg[len(neg) - extra :]) if drop == "balance" and extra > 0 else set()
        dropped_total += len(drop_set)
        kept = np.array([r[p, g] for g in idx if g not in drop_set])
        mean, sd = kept.mean(), kept.std()  # unbiased=False
        for g in idx:
            if g in drop_set:
                continue
            out[p, g] = (r[p, g] - mean) / (sd + eps) if std_normalize else r[p, g] - mean
    return out, dropped_total


@pytest.mark.parametrize("std_normalize", [False, True])
@pytest.mark.parametrize("drop", ["none", "balance"])
@pytest.mark.parametrize("kind", ["binary", "normal"])
def test_rec_advantage_matches_trinity(std_normalize, drop, kind):
    rng = np.random.default_rng(17)
    r, valid = random_rewards(rng, 12, 7, kind=kind, nan_frac=0.1, invalid_frac=0.1)
    r[0] = [1, 0, 0, 0, 0, 0, 1]  # 2 positives, 5 negatives: 3 dropped
    valid[0] = True
    res = compute_advantages(
        GroupBatch(rewards=t32(r), valid=tb(valid)),
        AdvantageConfig(estimator={"name": "rec", "std_normalize": std_normalize, "drop": drop}),
    )
    want, n_drop = trinity_rec_advantage(r, valid, std_normalize, drop)
    np.testing.assert_allclose(np64(res.advantages), want, rtol=1e-5, atol=1e-6)
    if drop == "balance":
        assert n_drop >= 3 and np.count_nonzero(want[0]) == 4
        usable = (valid & np.isfinite(r)).sum()
        assert res.metrics["rec/dropped_frac"] == pytest.approx(n_drop / usable)


def test_rec_advantage_rejects_an_unknown_drop():
    with pytest.raises(ValueError, match="drop"):
        rec_advantage(GroupBatch(rewards=torch.zeros(1, 2)), drop="random")
