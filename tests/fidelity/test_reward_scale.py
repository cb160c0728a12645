"""PickScore on Flow-GRPO's scale: its scorer returns the score / 26, so eps = 1e-4 of the z-score acts on that.

yifan123/flow_grpo flow_grpo/pickscore_scorer.py (the same file in TempFlow-GRPO and TurningPoint-GRPO):
    scores = logit_scale * cos(text, image); scores = scores / 26
flow_grpo/stat_tracking.py with global_std: A = (r - mean_prompt(r)) / (std_batch(r) + 1e-4), numpy (biased) std.
A reward weight of 1/26 (the weighted sum of the heads) is the same reward; weight 1 is 26x wider, so eps weighs 26x
less. The reference is float64 numpy over PickScore-like raw scores (about 21, spread 0.05 within a prompt).
"""

from __future__ import annotations

import numpy as np
import torch

from flowgrpo.core import AdvantageConfig, GroupBatch, compute_advantages

SCALE = 1 / 26


def flow_grpo_global_std(scores: np.ndarray) -> np.ndarray:
    """[P, G] scorer outputs -> advantages, Flow-GRPO's PerPromptStatTracker(global_std=True)."""
    return (scores - scores.mean(1, keepdims=True)) / (scores.std() + 1e-4)


def test_weight_one_twenty_sixth_is_flow_grpos_pickscore_scale():
    rng = np.random.default_rng(0)
    raw = 21.0 + rng.normal(scale=0.05, size=(6, 1)) + rng.normal(scale=0.05, size=(6, 24))
    reference = flow_grpo_global_std(raw * SCALE)
    cfg = AdvantageConfig(estimator={"name": "grpo", "std_scope": "batch", "unbiased": False, "eps": 1e-4})

    def ours(weight: float) -> np.ndarray:
        batch = GroupBatch(rewards=torch.tensor(raw[..., None], dtype=torch.float64), reward_weights=[weight])
        return compute_advantages(batch, cfg).advantages.double().numpy()

    np.testing.assert_allclose(
        ours(SCALE), reference, rtol=0, atol=1e-4
    )  # ours: float32 rewards (cancellation near 21 / 26)
    assert np.abs(ours(1.0) - reference).max() > 1e-2  # the unscaled score: eps shrinks the advantages 26x less
