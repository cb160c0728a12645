"""Multi-reward advantages as MixGRPO (`multi_reward_mix advantage_aggr`) and Pref-GRPO combine them, float64.

Tencent-Hunyuan/MixGRPO fastvideo/train_grpo_flux.py, per reward model k and group g:
    A_k = (r_k - mean_g(r_k)) / (std_g(r_k) + 1e-8)        # torch .std(): unbiased
    A   = sum_k A_k * reward_weights[k]
CodeGoat24/Pref-GRPO fastvideo/train_flux_pref_grpo.py: A = 0.7 * A_winrate + 1.4 * A_clip (same z-score).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from flowgrpo.core import AdvantageConfig, GroupBatch, compute_advantages


def advantage_aggr(rewards: np.ndarray, weights: list[float]) -> np.ndarray:
    """rewards [P, G, K] -> [P, G]."""
    out = np.zeros(rewards.shape[:2])
    for k, w in enumerate(weights):
        r = rewards[..., k]
        out += w * (r - r.mean(1, keepdims=True)) / (r.std(1, ddof=1, keepdims=True) + 1e-8)
    return out


@pytest.mark.parametrize("weights", [[1.0, 1.0, 1.0, 1.0], [0.7, 1.4]])
def test_gdpo_without_batch_norm_is_advantage_aggr(weights):
    rng = np.random.default_rng(2)
    P, G, K = 3, 12, len(weights)
    scales = rng.uniform(0.01, 5.0, size=K)  # heads on very different scales, as HPS vs CLIP vs ImageReward
    rewards = rng.normal(size=(P, G, K)) * scales
    cfg = AdvantageConfig(estimator={"name": "gdpo", "batch_norm": False, "unbiased": True, "eps": 1e-8})
    ours = compute_advantages(
        GroupBatch(rewards=torch.tensor(rewards, dtype=torch.float32), reward_weights=weights), cfg
    ).advantages
    np.testing.assert_allclose(ours.double().numpy(), advantage_aggr(rewards, weights), rtol=1e-4, atol=1e-5)
    gdpo = compute_advantages(
        GroupBatch(rewards=torch.tensor(rewards, dtype=torch.float32), reward_weights=weights),
        AdvantageConfig(estimator={"name": "gdpo", "unbiased": True, "eps": 1e-8}),
    ).advantages
    assert not torch.allclose(gdpo, ours, atol=1e-2)  # GDPO's batch re-normalisation is a different rule
