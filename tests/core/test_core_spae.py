"""SPAE (flowgrpo.core.spae): step splitting, the probe's acc / conf and the step potential against the source's
formulas (cii030/SPAE-RL probe example) in Python floats, and the step advantage (its reconstructed f and g)."""

import math

import pytest
import torch

from flowgrpo.core import AdvantageConfig, GroupBatch, compute_advantages
from flowgrpo.core.config import PartSpec
from flowgrpo.core.spae import potential_differences, probe_scores, step_ends, step_potential, token_steps


def test_steps_end_at_boundary_tokens_inside_the_think_block():
    ids = [5, 9, 7, 9, 3, 99, 9, 4]  # 9 = a token ending ".\n\n", 99 = </think>
    assert step_ends(ids, {9}, think_end_id=99) == [1, 3]
    assert step_ends(ids, {9}) == [1, 3, 6]
    assert token_steps(8, [1, 3]).tolist() == [0, 0, 1, 1, 1, 1, 1, 1]
    assert token_steps(3, []).tolist() == [0, 0, 0]


def test_probe_scores_and_potential_follow_the_source():
    lp = torch.tensor([[-0.1, -0.2], [-1.0, -0.5], [-0.3, -0.3]], dtype=torch.float64)  # N = 3 probes, K = 2 tokens
    H = torch.tensor([[0.2, 0.1], [0.9, 0.4], [0.0, 0.5]], dtype=torch.float64)
    acc, conf = probe_scores(lp, H)
    want_acc = sum(math.exp(sum(row)) / 2 for row in lp.tolist()) / 3
    want_conf = sum(math.exp(-sum(row)) / 2 for row in H.tolist()) / 3
    assert float(acc) == pytest.approx(want_acc) and float(conf) == pytest.approx(want_conf)
    assert float(step_potential(acc, conf)) == pytest.approx(1.5 * want_acc * want_conf + 0.5 * want_acc - want_conf)
    phi = torch.tensor([[0.1, 0.5, 0.4, 0.0]])
    mask = torch.tensor([[True, True, True, False]])
    assert potential_differences(phi, mask)[0].tolist() == pytest.approx([0.0, 0.4, -0.1, 0.0])


def test_spae_damps_positive_credit_after_saturation_and_adds_the_shaping():
    rewards = torch.tensor([[1.0, 0.0]])
    phi = torch.tensor([[[0.2, 0.95, 0.97, 0.3], [0.1, 0.3, 0.0, 0.0]]])
    mask = torch.tensor([[[True, True, True, True], [True, True, True, False]]])
    settings = {"saturation_weight": 0.5, "shaping_coef": 0.1, "shaping_clip": 0.5}
    out = compute_advantages(
        GroupBatch(rewards=rewards, step_rewards=phi, step_mask=mask),
        AdvantageConfig(estimator=PartSpec(name="spae", settings=settings)),
    )
    a = 0.5 / (math.sqrt(0.5) + 1e-4)  # GRPO's unbiased group z-score of (1, 0)
    pos = [a + 0.0, a + 0.1 * 0.5, 0.5 * a + 0.1 * 0.02, 0.5 * a + 0.1 * -0.5]  # saturated at step 1; clip at 0.5
    neg = [-a + 0.0, -a + 0.1 * 0.2, -a + 0.1 * -0.3, 0.0]  # never saturated, negative credit is never damped
    torch.testing.assert_close(out.advantages, torch.tensor([[pos, neg]]), rtol=0, atol=1e-5)
    assert out.sample_weight.tolist() == [[[1, 1, 1, 1], [1, 1, 1, 0]]]
    assert out.level == "step" and out.metrics["spae/damped_steps"] == 2.0
    assert out.metrics["spae/saturated_frac"] == 0.5


def test_spae_needs_outcome_rewards_and_step_potentials():
    with pytest.raises(ValueError, match="'spae' needs GroupBatch.rewards"):
        compute_advantages(
            GroupBatch(step_rewards=torch.zeros(1, 2, 3)), AdvantageConfig(estimator=PartSpec(name="spae"))
        )
    with pytest.raises(ValueError, match=r"saturation_weight: must be a finite number in \[0, 1\]"):
        compute_advantages(
            GroupBatch(rewards=torch.zeros(1, 2), step_rewards=torch.zeros(1, 2, 3)),
            AdvantageConfig(estimator=PartSpec(name="spae", settings={"saturation_weight": 2.0})),
        )


def test_probe_scores_read_only_the_positions_a_continuation_reached():
    """The source divides by min(K, the continuation's length) and counts a continuation that reached no position
    as 0 in both means (probe_mechanism_example.py: `valid_sample_count`, `acc /= num_samples`)."""
    lp = torch.tensor([[-0.1, -0.2], [-1.0, -10.0], [-0.3, -0.3]], dtype=torch.float64)
    H = torch.tensor([[0.2, 0.1], [0.9, 0.4], [0.0, 0.5]], dtype=torch.float64)
    valid = torch.tensor([[True, True], [True, False], [False, False]])
    acc, conf = probe_scores(lp, H, valid)
    want_acc = (math.exp(-0.3) / 2 + math.exp(-1.0) / 1 + 0.0) / 3
    want_conf = (math.exp(-0.3) / 2 + math.exp(-0.9) / 1 + 0.0) / 3
    assert float(acc) == pytest.approx(want_acc) and float(conf) == pytest.approx(want_conf)
    full = probe_scores(lp, H, torch.ones_like(valid))
    assert [float(x) for x in full] == [float(x) for x in probe_scores(lp, H)]  # no mask = every position
