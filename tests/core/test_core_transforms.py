"""Advantage transforms: clip, filter_zero_std, top_bottom_k, nft_optimality."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from _coreref import SETTINGS, np64, random_rewards, ref_grpo, t32, tb
from flowgrpo.core import TRANSFORMS, AdvantageConfig, AdvantageResult, GroupBatch, compute_advantages


def test_every_transform_is_tested():
    # ace: test_core_prompt_state.py
    assert TRANSFORMS.names() == ["ace", "clip", "filter_zero_std", "nft_optimality", "top_bottom_k"]


@SETTINGS
@given(seed=st.integers(0, 2**31 - 1), P=st.integers(1, 4), G=st.integers(2, 8), m=st.sampled_from([0.5, 1.0, 5.0]))
def test_clip_formula(seed, P, G, m):
    rng = np.random.default_rng(seed)
    r, _ = random_rewards(rng, P, G, "normal")
    base = ref_grpo(r, np.ones((P, G), bool), scope="none") * 3
    cfg = AdvantageConfig(estimator="dr_grpo", transforms=[{"name": "clip", "max": m}])
    out = compute_advantages(GroupBatch(rewards=t32(r * 3)), cfg)
    np.testing.assert_allclose(np64(out.advantages), np.clip(base, -m, m), rtol=1e-4, atol=1e-5)
    assert out.metrics["adv/clipped_frac"] == pytest.approx(float((np.abs(base) > m).mean()), abs=1e-6)


def test_clip_default_is_five():
    res = AdvantageResult(t32([[-7.0, -5.0, 0.0, 4.9, 12.0]]), torch.ones(1, 5))
    out = TRANSFORMS.get("clip").fn(res, GroupBatch(rewards=torch.zeros(1, 5)))
    np.testing.assert_allclose(np64(out.advantages), [[-5, -5, 0, 4.9, 5]], rtol=1e-6)
    assert out.metrics["adv/clipped_frac"] == pytest.approx(2 / 5)


@SETTINGS
@given(seed=st.integers(0, 2**31 - 1), P=st.integers(1, 6), G=st.integers(2, 6), tol=st.sampled_from([0.0, 0.5]))
def test_filter_zero_std_formula(seed, P, G, tol):
    rng = np.random.default_rng(seed)
    r = rng.integers(0, 3, size=(P, G)).astype(np.float64)  # many constant groups
    adv = ref_grpo(r, np.ones((P, G), bool))
    keep = np.array([np.any(np.abs(adv[p]) > tol) for p in range(P)])
    cfg = AdvantageConfig(estimator="grpo", transforms=[{"name": "filter_zero_std", "tol": tol}])
    out = compute_advantages(GroupBatch(rewards=t32(r)), cfg)
    np.testing.assert_array_equal(np64(out.sample_weight), np.repeat(keep[:, None], G, 1).astype(float))
    assert out.metrics["adv/filtered_groups"] == float((~keep).sum())


def test_filter_zero_std_on_step_level_and_ignores_dead_weights():
    """A prompt whose only non-zero advantage sits on a weight-0 action is filtered as a whole."""
    adv = t32([[[0.0, 0.0], [0.0, 0.0]], [[0.0, 1.0], [0.0, 0.0]], [[0.0, 0.0], [2.0, 0.0]]])
    w = torch.ones(3, 2, 2)
    w[2, 1, 0] = 0.0
    res = AdvantageResult(adv, w, "step")
    out = TRANSFORMS.get("filter_zero_std").fn(res, GroupBatch(step_rewards=torch.zeros(3, 2, 2)))
    np.testing.assert_array_equal(np64(out.sample_weight).reshape(3, -1).max(1), [0.0, 1.0, 0.0])
    assert out.metrics["adv/filtered_groups"] == 2.0


@SETTINGS
@given(
    seed=st.integers(0, 2**31 - 1),
    P=st.integers(1, 4),
    G=st.integers(2, 10),
    k=st.integers(1, 4),
    invalid=st.sampled_from([0.0, 0.3]),
)
def test_top_bottom_k_formula(seed, P, G, k, invalid):
    rng = np.random.default_rng(seed)
    r, valid = random_rewards(rng, P, G, "normal", 0.0, invalid)
    cfg = AdvantageConfig(estimator="grpo", transforms=[{"name": "top_bottom_k", "k": k}])
    out = compute_advantages(GroupBatch(rewards=t32(r), valid=tb(valid)), cfg)
    adv = ref_grpo(r, valid)
    expected = np.zeros((P, G))
    for p in range(P):
        live = [g for g in range(G) if valid[p, g]]
        by_adv = sorted(live, key=lambda g: adv[p, g])
        for g in by_adv[:k] + by_adv[-k:]:
            expected[p, g] = 1.0
    np.testing.assert_array_equal(np64(out.sample_weight), expected)
    np.testing.assert_allclose(np64(out.advantages), adv, rtol=1e-3, atol=1e-4)  # advantages unchanged


def test_top_bottom_k_needs_sample_level():
    res = AdvantageResult(torch.zeros(1, 2, 3), torch.ones(1, 2, 3), "step")
    with pytest.raises(ValueError, match="sample-level"):
        TRANSFORMS.get("top_bottom_k").fn(res, GroupBatch(step_rewards=torch.zeros(1, 2, 3)))


def test_nft_optimality_maps_advantages_to_probabilities():
    """r = clip(A / A_max / 2 + 1/2, 0, 1): 0 -> 0.5, +5 -> 1, -5 -> 0; unscored samples weigh 0."""
    adv = [[0.0, 5.0, -5.0, 2.5, 10.0, -1.0, 0.0]]
    rewards = [[1.0, 1.0, 1.0, 1.0, 1.0, 1.0, float("nan")]]
    batch = GroupBatch(rewards=t32(rewards))
    res = AdvantageResult(t32(adv), torch.ones(1, 7))
    out = TRANSFORMS.get("nft_optimality").fn(res, batch)
    expected = np.clip(np.array(adv) / 5.0 / 2 + 0.5, 0, 1)
    np.testing.assert_allclose(np64(out.advantages), expected, rtol=1e-6)
    assert np64(out.advantages)[0, :3].tolist() == [0.5, 1.0, 0.0]
    np.testing.assert_array_equal(np64(out.sample_weight), [[1, 1, 1, 1, 1, 1, 0]])
    # another adv_clip_max
    res = AdvantageResult(t32(adv), torch.ones(1, 7))
    out = TRANSFORMS.get("nft_optimality").fn(res, batch, adv_clip_max=2.0)
    np.testing.assert_allclose(np64(out.advantages), np.clip(np.array(adv) / 2.0 / 2 + 0.5, 0, 1), rtol=1e-6)


def test_nft_optimality_in_the_pipeline_gives_unscored_samples_weight_zero():
    r = [[1.0, float("nan"), 0.0, 0.5], [0.2, 0.2, 0.2, 0.2]]
    cfg = AdvantageConfig(estimator="grpo", transforms=["clip", "nft_optimality"])
    out = compute_advantages(GroupBatch(rewards=t32(r)), cfg)
    np.testing.assert_array_equal(np64(out.sample_weight), [[1, 0, 1, 1], [1, 1, 1, 1]])
    adv = ref_grpo(np.array(r), np.ones((2, 4), bool))
    np.testing.assert_allclose(
        np64(out.advantages), np.clip(np.clip(adv, -5, 5) / 10 + 0.5, 0, 1), rtol=1e-4, atol=1e-5
    )
    assert np64(out.advantages)[1].tolist() == [0.5] * 4  # a constant group is exactly "neutral"
    # step-level results keep their weights
    res = AdvantageResult(torch.zeros(1, 2, 2), torch.ones(1, 2, 2), "step")
    step = TRANSFORMS.get("nft_optimality").fn(res, GroupBatch(step_rewards=torch.zeros(1, 2, 2)))
    assert torch.equal(step.sample_weight, torch.ones(1, 2, 2)) and torch.all(step.advantages == 0.5)


def test_transforms_apply_in_order():
    r = [[0.0, 1.0, 2.0, 30.0]]
    a = compute_advantages(
        GroupBatch(rewards=t32(r)),
        AdvantageConfig(estimator="dr_grpo", transforms=[{"name": "clip", "max": 1.0}, "nft_optimality"]),
    ).advantages
    b = compute_advantages(
        GroupBatch(rewards=t32(r)),
        AdvantageConfig(estimator="dr_grpo", transforms=["nft_optimality", {"name": "clip", "max": 0.6}]),
    ).advantages
    centred = np.array(r[0]) - np.mean(r[0])
    np.testing.assert_allclose(np64(a)[0], np.clip(np.clip(centred, -1, 1) / 10 + 0.5, 0, 1), rtol=1e-6)
    np.testing.assert_allclose(np64(b)[0], np.clip(np.clip(centred / 10 + 0.5, 0, 1), -0.6, 0.6), rtol=1e-6)
