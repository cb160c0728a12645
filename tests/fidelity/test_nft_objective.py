"""DiffusionNFT's objective, old-policy decay and advantages against the release, in float64.

NVlabs/DiffusionNFT scripts/train_nft_sd3.py (read in a public fork; the NVlabs repository itself is
not in the search index):
    r = clamp(clamp(A, -adv_clip_max, adv_clip_max) / adv_clip_max / 2 + 0.5, 0, 1)
    v+ = beta v + (1 - beta) v_old,   v- = (1 + beta) v_old - beta v
    x0+ = x_t - t v+,  w+ = mean|x0+ - x0| (float64, clip min 1e-5),  L+ = mean((x0+ - x0)^2 / w+)   (same for -)
    policy_loss = mean(adv_clip_max * (r L+ / beta + (1 - r) L- / beta)) ;  + train.beta * mean((v - v_ref)^2)
    old <- decay old + (1 - decay) new,  decay = return_decay(global_step, decay_type)
Advantages: flow_grpo's PerPromptStatTracker(global_std=True): (r - prompt mean) / (np.std(all r) + 1e-4).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from flowgrpo.core import AdvantageConfig, GroupBatch, compute_advantages
from flowgrpo.t2i.nft import nft_loss, old_decay


def release_loss(v, v_old, x_t, x0, t, adv, beta, adv_max):
    r = np.clip(np.clip(adv, -adv_max, adv_max) / adv_max / 2 + 0.5, 0, 1)
    tt = t[:, None, None, None]
    dims = (1, 2, 3)

    def term(v_side):
        pred = x_t - tt * v_side
        w = np.clip(np.abs(pred - x0).mean(axis=dims, keepdims=True), 1e-5, None)
        return ((pred - x0) ** 2 / w).mean(axis=dims)

    pos = term(beta * v + (1 - beta) * v_old)
    neg = term((1.0 + beta) * v_old - beta * v)
    return adv_max * (r * pos / beta + (1 - r) * neg / beta)


def release_decay(step: int, decay_type: int) -> float:
    flat, uprate, uphold = {0: (0, 0.0, 0.0), 1: (0, 0.001, 0.5), 2: (75, 0.0075, 0.999)}[decay_type]
    return 0.0 if step < flat else min((step - flat) * uprate, uphold)


@pytest.mark.parametrize("beta", [1.0, 0.1])
def test_nft_loss_is_the_release_objective(beta):
    rng = np.random.default_rng(0)
    B = 6
    x0, eps, v, v_old = (rng.standard_normal((B, 4, 8, 8)) for _ in range(4))
    t = rng.uniform(0.05, 1.0, B)
    x_t = (1 - t[:, None, None, None]) * x0 + t[:, None, None, None] * eps
    adv = np.array([-7.0, -2.0, -0.3, 0.0, 1.5, 6.0])
    adv_max = 5.0
    r = np.clip(np.clip(adv, -adv_max, adv_max) / adv_max / 2 + 0.5, 0, 1)
    f = lambda a: torch.tensor(a, dtype=torch.float32)  # noqa: E731
    ours = nft_loss(f(v), f(v_old), f(x_t), f(x0), f(t), f(r), beta=beta, adv_max=adv_max)
    np.testing.assert_allclose(ours.double().numpy(), release_loss(v, v_old, x_t, x0, t, adv, beta, adv_max), rtol=2e-5)


def test_nft_adaptive_weight_floor_is_the_releases():
    """A sample whose x0 estimate is (almost) exact: the weight floor 1e-5 decides the loss scale."""
    x0 = np.zeros((1, 1, 2, 2))
    v = np.full((1, 1, 2, 2), 1e-7)
    t = np.array([0.5])
    ours = nft_loss(
        *(torch.tensor(a, dtype=torch.float32) for a in (v, v, x0, x0, t, np.array([1.0]))), beta=1.0, adv_max=5.0
    )
    np.testing.assert_allclose(
        ours.double().numpy(), release_loss(v, v, x0, x0, t, np.array([5.0]), 1.0, 5.0), rtol=1e-4
    )


@pytest.mark.parametrize("kind, decay_type", [("on_policy", 0), ("linear", 1), ("delayed", 2)])
def test_old_policy_decay_is_return_decay_of_the_optimizer_step(kind, decay_type):
    for step in [0, 1, 2, 74, 75, 76, 100, 212, 500, 1000, 5000]:
        assert old_decay(step, kind) == pytest.approx(release_decay(step, decay_type), abs=1e-12)


def test_global_std_advantages_are_the_stat_trackers():
    rng = np.random.default_rng(1)
    P, G = 6, 8
    rewards = rng.normal(loc=rng.normal(size=(P, 1)), scale=rng.uniform(0.1, 2.0, size=(P, 1)), size=(P, G))
    cfg = AdvantageConfig(estimator={"name": "grpo", "std_scope": "batch", "unbiased": False, "eps": 1e-4})
    ours = compute_advantages(GroupBatch(rewards=torch.tensor(rewards, dtype=torch.float32)), cfg).advantages
    # PerPromptStatTracker(global_std=True).update: per-prompt mean, np.std of every reward, + 1e-4
    flat, prompts = rewards.reshape(-1), np.repeat(np.arange(P), G)
    ref = np.empty_like(flat)
    for p in range(P):
        ref[prompts == p] = (flat[prompts == p] - flat[prompts == p].mean()) / (np.std(flat) + 1e-4)
    np.testing.assert_allclose(ours.double().numpy().reshape(-1), ref, rtol=1e-5, atol=1e-6)
    per_group = compute_advantages(
        GroupBatch(rewards=torch.tensor(rewards, dtype=torch.float32)),
        AdvantageConfig(estimator={"name": "grpo", "unbiased": False}),
    ).advantages
    assert not torch.allclose(per_group, ours, atol=1e-2)  # the scope matters on these rewards
