"""Policy losses: every ratio, bounds, surrogate, step weighting, KL estimator, aggregation and preset against
an action-by-action reference, the gradient contracts (stop-gradients), and micro-batch invariance."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from _coreref import FEW, SETTINGS, np64, ref_policy_loss
from flowgrpo.core import (
    AGGREGATIONS,
    BOUNDS,
    KL_ESTIMATORS,
    PRESETS,
    RATIOS,
    STEP_WEIGHTINGS,
    SURROGATES,
    LossConfig,
    LossInputs,
    LossNormalizer,
    policy_loss,
)


def make_inputs(rng, N=5, T=6, per_token_adv=False, sample_weight=False, spread=0.3, ragged=True):
    """Random numpy arrays (float32-representable float64) and the matching LossInputs."""
    f = lambda a: np.asarray(a, dtype=np.float32).astype(np.float64)  # noqa: E731
    old = f(np.log(rng.uniform(0.02, 1.0, size=(N, T))))
    inp = {
        "logp_old": old,
        "logp": f(old + rng.normal(0, spread, size=(N, T))),
        "adv": f(rng.normal(size=(N, T)) if per_token_adv else np.repeat(rng.normal(size=(N, 1)), T, 1)),
        "mask": np.ones((N, T), dtype=bool),
        "logp_ref": f(old + rng.normal(0, 0.3, size=(N, T))),
        "entropy": f(rng.uniform(0, 2, size=(N, T))),
        "msd_old": f(rng.uniform(0, 0.05, size=(N, T))),
        "msd_ref": f(rng.uniform(0, 0.05, size=(N, T))),
        "std": f(rng.uniform(0.1, 1.0, size=(N, T))),
        "dt": f(rng.uniform(0.02, 0.2, size=(N, T))),
        "sw": f(rng.choice([0.0, 0.5, 1.0, 2.0], size=(N, 1)).repeat(T, 1)) if sample_weight else None,
    }
    if ragged:
        lengths = rng.integers(0, T + 1, size=N)
        lengths[0] = max(lengths[0], 1)
        inp["mask"] = np.arange(T)[None, :] < lengths[:, None]
    return inp


def to_inputs(inp, requires_grad=False, adv_rows=False) -> LossInputs:
    t = lambda a: None if a is None else torch.tensor(a, dtype=torch.float32)  # noqa: E731
    logp = t(inp["logp"]).requires_grad_(requires_grad)
    adv = t(inp["adv"][:, 0]) if adv_rows else t(inp["adv"])
    sw = None if inp["sw"] is None else t(inp["sw"][:, 0])
    return LossInputs(
        logp=logp,
        logp_old=t(inp["logp_old"]),
        advantages=adv,
        mask=torch.tensor(inp["mask"]),
        sample_weight=sw,
        logp_ref=t(inp["logp_ref"]),
        entropy=t(inp["entropy"]),
        mean_sqdist_old=t(inp["msd_old"]),
        mean_sqdist_ref=t(inp["msd_ref"]),
        std=t(inp["std"]),
        dt=t(inp["dt"]),
    )


def config_of(ref: dict) -> LossConfig:
    """The LossConfig of a reference cfg dict."""
    b, s = ref.get("bounds", ("symmetric", {})), ref.get("surrogate", ("ppo_clip", {}))
    k = ref.get("kl", ("k3", 0.0))
    return LossConfig(
        ratio=ref.get("ratio", "token"),
        bounds={"name": b[0], **b[1]},
        surrogate={"name": s[0], **s[1]},
        step_weighting=ref.get("weighting", "none"),
        aggregation=ref.get("aggregation", "token_mean"),
        kl={"estimator": k[0], "coef": k[1]},
        entropy_coef=ref.get("entropy_coef", 0.0),
        log_ratio_clamp=ref.get("clamp", 20.0),
    )


RATIO_NAMES = ["token", "sequence", "sequence_token", "ratio_norm"]
BOUND_SPECS = [
    ("symmetric", {}),
    ("symmetric", {"eps": 0.1}),
    ("asymmetric", {}),
    ("asymmetric", {"eps_low": 0.1, "eps_high": 0.3}),
    ("dcpo", {}),
    ("dcpo", {"eps_low": 0.05, "eps_high": 0.5}),
]
SURROGATE_SPECS = [
    ("ppo_clip", {}),
    ("ppo_clip", {"dual_clip": 3.0}),
    ("ppo_clip", {"dual_clip": 1.5}),
    ("ppo_clip", {"delta": 1.1}),
    ("ppo_clip", {"delta": 1.3, "dual_clip": 2.0}),
    ("sapo", {}),
    ("sapo", {"tau_pos": 2.0, "tau_neg": 0.5}),
    ("cispo", {}),
    ("reinforce", {}),
]
WEIGHTINGS = ["none", "inv_dt", "noise_aware"]
KL_SPECS = [("k3", 0.0), ("k1", 0.1), ("k2", 0.2), ("k3", 0.05), ("k3+", 0.3), ("gaussian", 0.5), ("flow_grpo", 0.5)]
AGGS = [
    "token_mean",
    "local_token_mean",
    "seq_mean_token_mean",
    "seq_mean_token_sum",
    "seq_mean_token_sum_norm",
    "balanced",
]


def test_every_part_is_in_the_reference():
    assert RATIOS.names() == sorted(RATIO_NAMES)
    assert BOUNDS.names() == sorted({b for b, _ in BOUND_SPECS} | {"etr"})  # etr: test_core_etr.py
    # rec: test_core_offpolicy.py; flow_dppo: tests/t2i/test_method_dppo.py; real, rover: test_core_{real,rover}.py
    assert SURROGATES.names() == sorted({s for s, _ in SURROGATE_SPECS} | {"rec", "flow_dppo", "real", "rover"})
    # thr: test_core_thr.py; std_over_dt: tests/fidelity/test_wan_kernel.py
    assert STEP_WEIGHTINGS.names() == sorted([*WEIGHTINGS, "thr", "std_over_dt"])
    assert KL_ESTIMATORS.names() == sorted({k for k, _ in KL_SPECS})
    assert AGGREGATIONS.names() == sorted(AGGS)


@SETTINGS
@given(
    seed=st.integers(0, 2**31 - 1),
    ratio=st.sampled_from(RATIO_NAMES),
    bounds=st.sampled_from(BOUND_SPECS),
    surrogate=st.sampled_from(SURROGATE_SPECS),
    weighting=st.sampled_from(WEIGHTINGS),
    kl=st.sampled_from(KL_SPECS),
    aggregation=st.sampled_from(AGGS),
    entropy=st.sampled_from([0.0, 0.01]),
    per_token=st.booleans(),
    sw=st.booleans(),
    clamp=st.sampled_from([20.0, 0.25]),
)
def test_policy_loss_matches_reference(
    seed, ratio, bounds, surrogate, weighting, kl, aggregation, entropy, per_token, sw, clamp
):
    rng = np.random.default_rng(seed)
    inp = make_inputs(rng, per_token_adv=per_token, sample_weight=sw)
    cfg = dict(
        ratio=ratio,
        bounds=bounds,
        surrogate=surrogate,
        weighting=weighting,
        kl=kl,
        aggregation=aggregation,
        entropy_coef=entropy,
        clamp=clamp,
    )
    out = policy_loss(to_inputs(inp), config_of(cfg))
    loss, per = ref_policy_loss(inp, cfg)
    assert float(out.loss.detach()) == pytest.approx(loss, rel=1e-4, abs=1e-5)
    np.testing.assert_allclose(np64(out.per_action), per, rtol=1e-4, atol=1e-5)
    policy_only, _ = ref_policy_loss(inp, {**cfg, "kl": ("k3", 0.0), "entropy_coef": 0.0})
    assert out.metrics["loss/policy"] == pytest.approx(policy_only, rel=1e-4, abs=1e-5)
    assert out.metrics["loss/total"] == pytest.approx(loss, rel=1e-4, abs=1e-5)


@pytest.mark.parametrize("aggregation", AGGS)
@pytest.mark.parametrize("surrogate", SURROGATE_SPECS, ids=lambda s: f"{s[0]}{s[1]}")
def test_each_surrogate_and_aggregation_on_a_fixed_batch(surrogate, aggregation):
    """A deterministic sweep (complements the random one): every surrogate under every aggregation."""
    inp = make_inputs(np.random.default_rng(7), N=6, T=5, per_token_adv=True, sample_weight=True, spread=0.5)
    cfg = dict(surrogate=surrogate, aggregation=aggregation, kl=("k3", 0.1), entropy_coef=0.01)
    out = policy_loss(to_inputs(inp), config_of(cfg))
    assert float(out.loss.detach()) == pytest.approx(ref_policy_loss(inp, cfg)[0], rel=1e-4, abs=1e-6)


def test_dr_grpo_constant_length_comes_from_the_normalizer():
    inp = make_inputs(np.random.default_rng(3))
    cfg = dict(aggregation="seq_mean_token_sum_norm", const_len=64)
    li = to_inputs(inp)
    out = policy_loss(li, config_of(cfg), LossNormalizer.from_inputs(li, const_len=64))
    assert float(out.loss.detach()) == pytest.approx(ref_policy_loss(inp, cfg)[0], rel=1e-5)


# --- gradient contracts -----------------------------------------------------------------------


def grad_of(inp, cfg, adv_rows=False):
    li = to_inputs(inp, requires_grad=True, adv_rows=adv_rows)
    out = policy_loss(li, config_of(cfg))
    out.loss.backward()
    return out, np64(li.logp.grad)


@FEW
@given(
    seed=st.integers(0, 2**31 - 1),
    agg=st.sampled_from(["token_mean", "seq_mean_token_mean"]),
    taus=st.sampled_from([(1.0, 1.05), (2.0, 0.5)]),
)
def test_sapo_gradient_at_ratio_one_is_the_policy_gradient(seed, agg, taus):
    rng = np.random.default_rng(seed)
    inp = make_inputs(rng, per_token_adv=True)
    inp["logp"] = inp["logp_old"].copy()  # on-policy: ratio exactly 1
    _, g = grad_of(inp, dict(surrogate=("sapo", {"tau_pos": taus[0], "tau_neg": taus[1]}), aggregation=agg))
    # vanilla PG: loss -A log pi, aggregated the same way
    m, A = inp["mask"], inp["adv"]
    if agg == "token_mean":
        expected = np.where(m, -A / m.sum(), 0.0)
    else:
        lengths = m.sum(1, keepdims=True)
        expected = np.where(m, -A / np.maximum(lengths, 1) / (lengths > 0).sum(), 0.0)
    np.testing.assert_allclose(g, expected, rtol=1e-5, atol=1e-7)
    _, g_pg = grad_of(inp, dict(surrogate=("reinforce", {}), aggregation=agg))
    np.testing.assert_allclose(g, g_pg, rtol=1e-5, atol=1e-7)


@FEW
@given(
    seed=st.integers(0, 2**31 - 1),
    agg=st.sampled_from(["seq_mean_token_mean", "token_mean"]),
    eps=st.sampled_from([(3e-4, 4e-4), (0.2, 0.28)]),
)
def test_gspo_token_with_constant_advantage_equals_gspo(seed, agg, eps):
    rng = np.random.default_rng(seed)
    inp = make_inputs(rng, spread=eps[1] * 3)  # some sequences clipped, some not
    bounds = ("asymmetric", {"eps_low": eps[0], "eps_high": eps[1]})
    seq_out, g_seq = grad_of(inp, dict(ratio="sequence", bounds=bounds, aggregation=agg), adv_rows=True)
    tok_out, g_tok = grad_of(inp, dict(ratio="sequence_token", bounds=bounds, aggregation=agg), adv_rows=True)
    assert float(tok_out.loss.detach()) == pytest.approx(float(seq_out.loss.detach()), rel=1e-5, abs=1e-8)
    np.testing.assert_allclose(g_tok, g_seq, rtol=1e-5, atol=1e-9)
    # and GSPO's gradient is the formula: -A s_i / |o_i| per token of an unclipped sequence, 0 if clipped
    m, A = inp["mask"], inp["adv"][:, 0]
    lengths = m.sum(1)
    s = np.exp(
        np.array(
            [(inp["logp"][i, m[i]] - inp["logp_old"][i, m[i]]).mean() if lengths[i] else 0.0 for i in range(len(A))]
        )
    )
    clipped = ((A > 0) & (s > 1 + eps[1])) | ((A < 0) & (s < 1 - eps[0]))
    if agg == "seq_mean_token_mean":
        scale = 1.0 / (np.maximum(lengths, 1) * (lengths > 0).sum())
    else:
        scale = 1.0 / np.maximum(lengths, 1) * lengths / m.sum()
    expected = np.where(m, (np.where(clipped, 0.0, -A * s * scale))[:, None], 0.0)
    np.testing.assert_allclose(g_seq, expected, rtol=1e-4, atol=1e-9)


def test_gspo_token_allows_per_token_advantages():
    """Same sequence ratio value for every token of a row, gradient of each token's own log-prob."""
    inp = make_inputs(np.random.default_rng(11), per_token_adv=True, spread=1e-4, ragged=False)
    bounds = ("asymmetric", {"eps_low": 0.2, "eps_high": 0.2})
    out, g = grad_of(inp, dict(ratio="sequence_token", bounds=bounds, aggregation="token_mean"))
    m, A = inp["mask"], inp["adv"]
    s = np.exp((inp["logp"] - inp["logp_old"]).mean(1, keepdims=True))
    np.testing.assert_allclose(g, -A * s / m.sum(), rtol=1e-4)
    assert out.metrics["ratio/max"] == pytest.approx(s.max(), rel=1e-5)


@FEW
@given(
    seed=st.integers(0, 2**31 - 1),
    bounds=st.sampled_from([("asymmetric", {"eps_low": 1.0, "eps_high": 4.0}), ("symmetric", {"eps": 0.1})]),
)
def test_cispo_weight_carries_no_gradient(seed, bounds):
    inp = make_inputs(np.random.default_rng(seed), per_token_adv=True, spread=0.5)
    _, g = grad_of(inp, dict(surrogate=("cispo", {}), bounds=bounds))
    lo, hi = (0.0, 5.0) if bounds[0] == "asymmetric" else (0.9, 1.1)
    w = np.clip(np.exp(inp["logp"] - inp["logp_old"]), lo, hi)
    m = inp["mask"]
    np.testing.assert_allclose(g, np.where(m, -w * inp["adv"] / m.sum(), 0.0), rtol=1e-4, atol=1e-8)


@FEW
@given(seed=st.integers(0, 2**31 - 1), dual=st.sampled_from([None, 1.5]))
def test_ppo_clip_gradient(seed, dual):
    """-A r per action where the clip is inactive, 0 where it is active (and beyond the dual clip)."""
    inp = make_inputs(np.random.default_rng(seed), per_token_adv=True, spread=0.4)
    settings = {} if dual is None else {"dual_clip": dual}
    _, g = grad_of(inp, dict(surrogate=("ppo_clip", settings)))
    r, A, m = np.exp(inp["logp"] - inp["logp_old"]), inp["adv"], inp["mask"]
    active = ((A > 0) & (r > 1.2)) | ((A < 0) & (r < 0.8))
    if dual is not None:
        active |= (A < 0) & (r > dual)
    np.testing.assert_allclose(g, np.where(m & ~active, -A * r / m.sum(), 0.0), rtol=1e-4, atol=1e-8)


def test_reinforce_gradient_and_ratio_free():
    inp = make_inputs(np.random.default_rng(5), per_token_adv=True, spread=3.0)
    out, g = grad_of(inp, dict(surrogate=("reinforce", {})))
    m = inp["mask"]
    np.testing.assert_allclose(g, np.where(m, -inp["adv"] / m.sum(), 0.0), rtol=1e-5)


@pytest.mark.parametrize("name", ["k1", "k2", "k3", "k3+", "gaussian", "flow_grpo"])
def test_kl_estimator_values_and_gradients(name):
    """A = 0 leaves only the KL term: loss = coef * token mean of the estimator."""
    inp = make_inputs(np.random.default_rng(9), ragged=True)
    inp["adv"] = np.zeros_like(inp["adv"])
    out, g = grad_of(inp, dict(kl=(name, 0.5)))
    m = inp["mask"]
    x = inp["logp"] - inp["logp_ref"]  # log pi - log pi_ref
    value = {
        "k1": x,
        "k2": 0.5 * x**2,
        "k3": np.exp(-x) + x - 1,
        "k3+": np.exp(-x) + x - 1,
        "gaussian": inp["msd_ref"] / (2 * inp["std"] ** 2),
        "flow_grpo": inp["msd_ref"] * inp["dt"] / (2 * inp["std"] ** 2),
    }[name]
    grad = {
        "k1": np.ones_like(x),
        "k2": x,
        "k3": 1 - np.exp(-x),
        "k3+": x,
        "gaussian": np.zeros_like(x),
        "flow_grpo": np.zeros_like(x),
    }[name]
    assert float(out.loss.detach()) == pytest.approx(0.5 * value[m].mean(), rel=1e-5)
    assert out.metrics["kl/ref_mean"] == pytest.approx(value[m].mean(), rel=1e-5)
    np.testing.assert_allclose(g, np.where(m, 0.5 * grad / m.sum(), 0.0), rtol=1e-4, atol=1e-8)


def test_k3_plus_has_value_of_k3_and_gradient_of_k2():
    inp = make_inputs(np.random.default_rng(13))
    inp["adv"] = np.zeros_like(inp["adv"])
    k3p, g3p = grad_of(inp, dict(kl=("k3+", 1.0)))
    k3, _ = grad_of(inp, dict(kl=("k3", 1.0)))
    k2, g2 = grad_of(inp, dict(kl=("k2", 1.0)))
    assert float(k3p.loss.detach()) == pytest.approx(float(k3.loss.detach()), rel=1e-6)
    assert float(k3p.loss.detach()) != pytest.approx(float(k2.loss.detach()), rel=1e-3)
    np.testing.assert_allclose(g3p, g2, rtol=1e-6)


def test_ratio_norm_bias_term_keeps_its_gradient():
    """d loss / d mean_sqdist_old = -A r / (2 std) / N for unclipped actions (the bias is not detached)."""
    inp = make_inputs(np.random.default_rng(17), per_token_adv=True, spread=0.01, ragged=False)
    li = to_inputs(inp)
    li.mean_sqdist_old.requires_grad_(True)
    out = policy_loss(li, LossConfig(ratio="ratio_norm", bounds={"name": "symmetric", "eps": 10.0}))
    out.loss.backward()
    s, A, m = inp["std"], inp["adv"], inp["mask"]
    r = np.exp(s * (inp["logp"] - inp["logp_old"] + inp["msd_old"] / (2 * s**2)))
    np.testing.assert_allclose(np64(li.mean_sqdist_old.grad), -A * r / (2 * s) / m.sum(), rtol=1e-4)


# --- step weightings --------------------------------------------------------------------------


def test_noise_aware_weights_average_one():
    """TempFlow: w_i = std_i / mean std over the batch's trained steps, so the weights average 1."""
    inp = make_inputs(np.random.default_rng(21))
    inp["adv"] = np.ones_like(inp["adv"])
    inp["logp"] = -np.ones_like(inp["logp"])  # reinforce: per-action term = -A logp w = w
    out = policy_loss(to_inputs(inp), config_of(dict(surrogate=("reinforce", {}), weighting="noise_aware")))
    m = inp["mask"]
    w = np64(out.per_action)
    assert w[m].mean() == pytest.approx(1.0, rel=1e-5)
    np.testing.assert_allclose(w[m], inp["std"][m] / inp["std"][m].mean(), rtol=1e-5)
    assert float(out.loss.detach()) == pytest.approx(1.0, rel=1e-5)


def test_inv_dt_weights():
    inp = make_inputs(np.random.default_rng(22))
    inp["adv"] = np.ones_like(inp["adv"])
    inp["logp"] = -np.ones_like(inp["logp"])
    out = policy_loss(to_inputs(inp), config_of(dict(surrogate=("reinforce", {}), weighting="inv_dt")))
    m = inp["mask"]
    np.testing.assert_allclose(np64(out.per_action)[m], 1 / inp["dt"][m], rtol=1e-5)


def test_entropy_bonus():
    inp = make_inputs(np.random.default_rng(23))
    base = policy_loss(to_inputs(inp), LossConfig())
    out = policy_loss(to_inputs(inp), LossConfig(entropy_coef=0.1))
    m = inp["mask"]
    assert float(out.loss.detach()) == pytest.approx(
        float(base.loss.detach()) - 0.1 * inp["entropy"][m].mean(), rel=1e-5, abs=1e-7
    )
    assert out.metrics["entropy/mean"] == pytest.approx(inp["entropy"][m].mean(), rel=1e-5)


def test_sample_weight_scales_and_drops():
    inp = make_inputs(np.random.default_rng(24), ragged=False)
    inp["sw"] = np.zeros_like(inp["adv"])
    inp["sw"][0] = 2.0
    out = policy_loss(to_inputs(inp), LossConfig(surrogate="reinforce"))
    per = np64(out.per_action)
    assert np.all(per[1:] == 0)
    np.testing.assert_allclose(per[0], -2 * inp["adv"][0] * inp["logp"][0], rtol=1e-5)


# --- metrics ----------------------------------------------------------------------------------


def test_ratio_metrics():
    inp = make_inputs(np.random.default_rng(25), per_token_adv=True, spread=0.4)
    out = policy_loss(to_inputs(inp), LossConfig(bounds={"name": "asymmetric", "eps_low": 0.2, "eps_high": 0.28}))
    m, A = inp["mask"], inp["adv"]
    lr = inp["logp"] - inp["logp_old"]
    r = np.exp(lr)
    low, high = (A < 0) & (r < 0.8), (A > 0) & (r > 1.28)
    mt = out.metrics
    assert mt["clip/low_frac"] == pytest.approx(low[m].mean(), abs=1e-6)
    assert mt["clip/high_frac"] == pytest.approx(high[m].mean(), abs=1e-6)
    assert mt["clip/frac"] == pytest.approx((low | high)[m].mean(), abs=1e-6)
    assert mt["clip/low_frac"] > 0 and mt["clip/high_frac"] > 0
    assert mt["ratio/min"] == pytest.approx(r[m].min(), rel=1e-5)
    assert mt["ratio/max"] == pytest.approx(r[m].max(), rel=1e-5)
    assert mt["ratio/mean"] == pytest.approx(r[m].mean(), rel=1e-5)
    assert mt["approx_kl"] == pytest.approx((0.5 * lr**2)[m].mean(), rel=1e-4)


def test_empty_mask_gives_zero_loss_and_no_ratio_metrics():
    inp = make_inputs(np.random.default_rng(26))
    inp["mask"][:] = False
    out = policy_loss(to_inputs(inp), LossConfig())
    assert float(out.loss.detach()) == 0.0 and "clip/frac" not in out.metrics and torch.all(out.per_action == 0)


def test_on_policy_ratio_is_one():
    inp = make_inputs(np.random.default_rng(27))
    inp["logp"] = inp["logp_old"].copy()
    for ratio in RATIO_NAMES:
        cfg = LossConfig(ratio=ratio)
        if ratio == "ratio_norm":
            inp_rn = dict(inp, msd_old=np.zeros_like(inp["msd_old"]))
            out = policy_loss(to_inputs(inp_rn), cfg)
        else:
            out = policy_loss(to_inputs(inp), cfg)
        assert out.metrics["ratio/min"] == 1.0 and out.metrics["ratio/max"] == 1.0, ratio


# --- presets ----------------------------------------------------------------------------------

# What each preset means, written from its paper (DeepSeekMath GRPO, Dr. GRPO, DAPO, GSPO; Flow-GRPO, GRPO-Guard).
PRESET_REFERENCE = {
    "grpo": dict(bounds=("symmetric", {"eps": 0.2}), aggregation="seq_mean_token_mean"),
    "bnpo": dict(bounds=("symmetric", {"eps": 0.2}), aggregation="local_token_mean"),
    "dr_grpo": dict(bounds=("symmetric", {"eps": 0.2}), aggregation="seq_mean_token_sum_norm"),
    "dapo": dict(bounds=("asymmetric", {"eps_low": 0.2, "eps_high": 0.28}), aggregation="token_mean"),
    "gspo": dict(
        ratio="sequence", bounds=("asymmetric", {"eps_low": 3e-4, "eps_high": 4e-4}), aggregation="seq_mean_token_mean"
    ),
    "sapo": dict(surrogate=("sapo", {"tau_pos": 1.0, "tau_neg": 1.05}), aggregation="seq_mean_token_mean"),
    "cispo": None,  # TRL: -sg[min(rho, 5)] A log pi, global token mean (checked inline below)
    "flow_grpo": dict(bounds=("symmetric", {"eps": 1e-4}), aggregation="token_mean"),
    "grpo_guard": dict(
        ratio="ratio_norm", bounds=("symmetric", {"eps": 1e-4}), aggregation="token_mean", weighting="inv_dt"
    ),
}


def test_every_preset_has_a_reference():
    from flowgrpo.core.offpolicy import REC_PRESETS  # against Trinity's loss in test_core_offpolicy.py

    assert set(PRESETS) == set(PRESET_REFERENCE) | set(REC_PRESETS) | {"canon"}  # canon: test_core_conditional.py


@pytest.mark.parametrize("name", sorted(PRESET_REFERENCE))
@pytest.mark.parametrize("spread", [1e-4, 0.3])
def test_preset_matches_reference(name, spread):
    inp = make_inputs(np.random.default_rng(31), N=6, T=5, per_token_adv=name not in ("gspo",), spread=spread)
    inp["msd_old"] = inp["msd_old"] * spread  # RatioNorm's bias at the scale of the policy move
    out = policy_loss(to_inputs(inp, adv_rows=name == "gspo"), LossConfig(preset=name))
    if name == "cispo":
        m = inp["mask"]
        w = np.minimum(np.exp(inp["logp"] - inp["logp_old"]), 5.0)
        expected = (-w * inp["adv"] * inp["logp"])[m].sum() / m.sum()
    else:
        expected, _ = ref_policy_loss(inp, PRESET_REFERENCE[name])
    assert float(out.loss.detach()) == pytest.approx(expected, rel=1e-4, abs=1e-7)


def test_flow_presets_add_the_closed_form_kl_when_given_a_coefficient():
    inp = make_inputs(np.random.default_rng(32))
    for name in ["flow_grpo", "grpo_guard"]:
        assert LossConfig(preset=name, kl={"coef": 0.04}).kl.estimator == "flow_grpo"  # the papers' form
        for estimator in ["gaussian", "flow_grpo"]:
            cfg = LossConfig(preset=name, kl={"estimator": estimator, "coef": 0.04})
            ref = dict(PRESET_REFERENCE[name], kl=(estimator, 0.04))
            assert float(policy_loss(to_inputs(inp), cfg).loss) == pytest.approx(ref_policy_loss(inp, ref)[0], rel=1e-4)


# --- micro-batching ---------------------------------------------------------------------------

INVARIANT_AGGS = ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm", "balanced"]


def random_split(rng, N, parts):
    perm = rng.permutation(N)
    cuts = sorted(rng.choice(np.arange(1, N), size=min(parts - 1, N - 1), replace=False))
    return [torch.as_tensor(c) for c in np.split(perm, cuts)]


@SETTINGS
@given(
    seed=st.integers(0, 2**31 - 1),
    agg=st.sampled_from(INVARIANT_AGGS),
    parts=st.integers(2, 5),
    weighting=st.sampled_from(["none", "noise_aware"]),
    per_token=st.booleans(),
)
def test_global_normalizer_makes_micro_batching_invariant(seed, agg, parts, weighting, per_token):
    rng = np.random.default_rng(seed)
    inp = make_inputs(rng, N=8, T=6, per_token_adv=per_token, sample_weight=True)
    full = to_inputs(inp, requires_grad=True)
    cfg = config_of(dict(aggregation=agg, weighting=weighting, kl=("k3", 0.1), entropy_coef=0.01))
    norm = LossNormalizer.from_inputs(full)
    whole = policy_loss(full, cfg, norm)
    whole.loss.backward()
    g_full = full.logp.grad.clone()
    full.logp.grad = None
    total = 0.0
    for idx in random_split(rng, 8, parts):
        out = policy_loss(full.split(idx), cfg, norm)
        out.loss.backward()
        total += float(out.loss.detach())
    assert total == pytest.approx(float(whole.loss.detach()), rel=1e-5, abs=1e-7)
    np.testing.assert_allclose(np64(full.logp.grad), np64(g_full), rtol=1e-5, atol=1e-8)
    # and the reference agrees with the whole-batch value
    ref, _ = ref_policy_loss(inp, dict(aggregation=agg, weighting=weighting, kl=("k3", 0.1), entropy_coef=0.01))
    assert float(whole.loss.detach()) == pytest.approx(ref, rel=1e-4, abs=1e-6)


def test_local_token_mean_is_not_micro_batch_invariant():
    """bnpo divides each micro-batch by its own token count: averaging the micro-batch losses (gradient
    accumulation) weighs a token of a short micro-batch more than one of a long micro-batch."""
    inp = make_inputs(np.random.default_rng(41), N=4, T=6, per_token_adv=True, ragged=False)
    inp["mask"][:2, 1:] = False  # micro-batch 1: 2 tokens, micro-batch 2: 12 tokens
    full = to_inputs(inp)
    cfg = LossConfig(aggregation="local_token_mean")
    whole = float(policy_loss(full, cfg).loss)
    parts = [policy_loss(full.split(torch.tensor(i)), cfg) for i in ([0, 1], [2, 3])]
    counts = [2.0, 12.0]
    ga_mean = sum(float(p.loss.detach()) for p in parts) / 2
    assert ga_mean != pytest.approx(whole, rel=1e-3)
    assert sum(float(p.loss.detach()) for p in parts) != pytest.approx(whole, rel=1e-3)
    # what it would take: weigh each micro-batch by its share of the tokens (= the global token_mean)
    weighted = sum(float(p.loss.detach()) * c for p, c in zip(parts, counts)) / sum(counts)
    assert weighted == pytest.approx(whole, rel=1e-5)
    norm = LossNormalizer.from_inputs(full)
    tm = sum(float(policy_loss(full.split(torch.tensor(i)), LossConfig(), norm).loss) for i in ([0, 1], [2, 3]))
    assert tm == pytest.approx(whole, rel=1e-5)


def test_normalizer_counts():
    inp = make_inputs(np.random.default_rng(42), per_token_adv=True)
    inp["adv"][0, :] = 0.0
    n = LossNormalizer.from_inputs(to_inputs(inp), const_len=7)
    m, A = inp["mask"], inp["adv"]
    assert n.num_tokens == m.sum() and n.num_seqs == m.any(1).sum() and n.const_len == 7
    assert n.pos_tokens == (m & (A > 0)).sum() and n.neg_tokens == (m & (A < 0)).sum()
    assert n.pos_seqs == (m & (A > 0)).any(1).sum() and n.neg_seqs == (m & (A < 0)).any(1).sum()
    assert n.std_sum == pytest.approx(inp["std"][m].sum(), rel=1e-5)
    inp["std"] = None
    li = to_inputs(inp)
    assert LossNormalizer.from_inputs(li).std_sum == 0.0


def test_normalizer_all_reduce_sums_ranks():
    rng = np.random.default_rng(43)
    a, b = make_inputs(rng, N=3), make_inputs(rng, N=4)
    na, nb = LossNormalizer.from_inputs(to_inputs(a)), LossNormalizer.from_inputs(to_inputs(b))
    both = {k: np.concatenate([a[k], b[k]]) if a[k] is not None else None for k in a}
    nab = LossNormalizer.from_inputs(to_inputs(both))
    names = ["num_tokens", "num_seqs", "pos_tokens", "neg_tokens", "pos_seqs", "neg_seqs", "std_sum"]
    other = torch.tensor([getattr(nb, k) for k in names], dtype=torch.float64)
    reduced = na.all_reduce(lambda t: t + other)
    for k in names:
        assert getattr(reduced, k) == pytest.approx(getattr(nab, k), rel=1e-6), k
    assert na.all_reduce() is na  # no process group: unchanged


def test_normalizer_all_reduce_with_a_process_group(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        n = LossNormalizer.from_inputs(to_inputs(make_inputs(np.random.default_rng(44))))
        assert n.all_reduce() == n
    finally:
        dist.destroy_process_group()


# --- errors -----------------------------------------------------------------------------------


def test_missing_inputs_raise():
    inp = make_inputs(np.random.default_rng(45))
    for drop, cfg, what in [
        ("std", LossConfig(ratio="ratio_norm"), "ratio 'ratio_norm' needs LossInputs.std"),
        ("msd_old", LossConfig(ratio="ratio_norm"), "needs LossInputs.mean_sqdist_old"),
        ("dt", LossConfig(step_weighting="inv_dt"), "step weighting 'inv_dt' needs LossInputs.dt"),
        ("std", LossConfig(step_weighting="noise_aware"), "needs LossInputs.std"),
        ("logp_ref", LossConfig(kl={"estimator": "k3", "coef": 0.1}), "KL estimator 'k3' needs LossInputs.logp_ref"),
        ("msd_ref", LossConfig(kl={"estimator": "gaussian", "coef": 0.1}), "needs LossInputs.mean_sqdist_ref"),
        ("entropy", LossConfig(entropy_coef=0.01), "entropy"),
    ]:
        with pytest.raises(ValueError, match=what.replace(".", r"\.")):
            policy_loss(to_inputs(dict(inp, **{drop: None})), cfg)
    # a KL with coefficient 0 needs no reference log-probs
    policy_loss(to_inputs(dict(inp, logp_ref=None)), LossConfig(kl={"estimator": "k3", "coef": 0.0}))


def test_loss_inputs_shapes_are_checked():
    x = torch.zeros(3, 4)
    m = torch.ones(3, 4, dtype=torch.bool)
    with pytest.raises(ValueError, match="logp"):
        LossInputs(torch.zeros(3), torch.zeros(3), torch.zeros(3), torch.ones(3, dtype=torch.bool))
    with pytest.raises(ValueError, match="mask"):
        LossInputs(x, x, torch.zeros(3), torch.ones(3, 5, dtype=torch.bool))
    with pytest.raises(ValueError, match="advantages"):
        LossInputs(x, x, torch.zeros(4), m)
    with pytest.raises(ValueError, match="advantages"):
        LossInputs(x, x, torch.zeros(3, 2), m)
    with pytest.raises(ValueError, match="sample_weight"):
        LossInputs(x, x, torch.zeros(3), m, sample_weight=torch.zeros(2))
    for name in ["logp_old", "logp_ref", "entropy", "mean_sqdist_old", "mean_sqdist_ref", "std", "dt"]:
        kwargs = dict(logp=x, logp_old=x, advantages=torch.zeros(3), mask=m)
        kwargs[name] = torch.zeros(3, 5)
        with pytest.raises(ValueError, match=name):
            LossInputs(**kwargs)
    ok = LossInputs(x, x, torch.zeros(3), m.float(), sample_weight=torch.ones(3))
    assert ok.mask.dtype == torch.bool and ok.advantages.shape == (3, 1) and ok.sample_weight.shape == (3, 1)


def test_dcpo_bounds_widen_for_rare_tokens():
    """DCPO (lime-RL/DCPO README; bounds from |(r - 1) p| <= eps): at q = 0.01 the new probability may reach
    0.05 (upper ratio 5); at q = 0.9 about [0.69, 1.07] q."""
    from flowgrpo.core.losses import LossContext, dcpo

    old = torch.log(torch.tensor([[0.01, 0.9]]))
    li = LossInputs(old.clone(), old, torch.zeros(1), torch.ones(1, 2, dtype=torch.bool))
    lo, hi = dcpo(LossContext(li, LossNormalizer.from_inputs(li), old - old, 20.0))
    assert float(hi[0, 0]) == pytest.approx(5.0, rel=1e-5)
    assert float(lo[0, 0]) == pytest.approx(0.5, rel=1e-6)  # sqrt(max(1 - 64, 0)) = 0
    assert float(lo[0, 1]) * 0.9 == pytest.approx(0.69, abs=0.01)
    assert float(hi[0, 1]) * 0.9 == pytest.approx(1.07, abs=0.01)
    assert math.isclose(float(hi[0, 1]), 0.5 + 0.5 * math.sqrt(1 + 0.8 / 0.9), rel_tol=1e-5)
