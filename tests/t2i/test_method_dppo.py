"""Flow-DPPO (flowgrpo/core/trust_region.py): the KL-ADV masked surrogate through flowgrpo.core.policy_loss against a
float64 re-derivation on fixed inputs; the method / surrogate pairing; one tiny iteration; learning (heavy)."""

import math

import pytest
import torch

from flowgrpo.core import LossConfig, LossInputs, policy_loss
from flowgrpo.t2i.objectives import reads_old_means

from .learning_runs import learning_margin


def _inputs():
    logp_old = torch.zeros(6, 1)
    logp = torch.tensor([[0.3], [0.3], [-0.2], [-0.2], [0.1], [-0.1]])
    adv = torch.tensor([1.0, 1.0, -2.0, -2.0, -0.5, 0.5])
    std = torch.tensor([[0.1], [0.1], [0.2], [0.2], [0.05], [0.05]])
    # KL = d / (2 std^2): rows 0, 2 far (>= 1e-2), rows 1, 3 near, rows 4, 5 far but moving back
    d = torch.tensor([[4e-4], [1e-4], [1.6e-3], [1e-4], [1e-3], [1e-3]])
    return LossInputs(logp=logp, logp_old=logp_old, advantages=adv, mask=torch.ones(6, 1, dtype=torch.bool),
                      mean_sqdist_old=d, std=std)  # fmt: skip


def _expected(inputs, threshold, coefficient=True):
    total = 0.0
    for i in range(6):
        r = math.exp(float(inputs.logp[i, 0]) - float(inputs.logp_old[i, 0]))
        a, d, s = float(inputs.advantages[i, 0]), float(inputs.mean_sqdist_old[i, 0]), float(inputs.std[i, 0])
        kl = d / (2 * s * s) if coefficient else d / 2
        drop = kl >= threshold and ((r > 1 and a > 0) or (r < 1 and a < 0))
        total += 0.0 if drop else -a * r
    return total / 6  # token_mean over 6 unmasked actions


@pytest.mark.parametrize("coefficient", [True, False])
def test_flow_dppo_matches_a_float64_derivation(coefficient):
    inputs = _inputs()
    threshold = 1e-2 if coefficient else 1e-4
    cfg = LossConfig(
        preset="flow_grpo",
        surrogate={"name": "flow_dppo", "kl_threshold": threshold, "add_kl_coefficient": coefficient},
    )
    out = policy_loss(inputs, cfg)
    assert out.loss.item() == pytest.approx(_expected(inputs, threshold, coefficient), rel=1e-6)
    if coefficient:  # rows 0 (A > 0, r > 1) and 2 (A < 0, r < 1) are far and moving away: dropped
        assert out.per_action[:, 0].tolist()[0] == 0.0 and out.per_action[:, 0].tolist()[2] == 0.0
        assert out.per_action[1, 0].item() == pytest.approx(-math.exp(0.3), rel=1e-6)


def test_the_mask_carries_no_gradient_and_kept_rows_take_the_unclipped_gradient():
    inputs = _inputs()
    logp = inputs.logp.clone().requires_grad_(True)
    inputs.logp = logp
    cfg = LossConfig(preset="flow_grpo", surrogate={"name": "flow_dppo", "kl_threshold": 1e-2})
    policy_loss(inputs, cfg).loss.backward()
    r = torch.exp(logp.detach()[:, 0])
    a = inputs.advantages[:, 0]
    keep = torch.tensor([0.0, 1, 0, 1, 1, 1])
    assert torch.allclose(logp.grad[:, 0], -a * r * keep / 6, rtol=1e-6)


def test_the_surrogate_gets_the_rollout_means(recipe_config):
    """method grpo hands the rollout-time means to any loss part that reads them: flow_dppo, ratio_norm."""
    cfg = recipe_config("flow_dppo")
    assert cfg.method == "grpo" and reads_old_means(cfg.loss)
    assert not reads_old_means(recipe_config("flow_grpo").loss) and reads_old_means(recipe_config("grpo_guard").loss)


def test_one_iteration(recipe_config):
    from flowgrpo.t2i import train_t2i

    cfg = recipe_config("flow_dppo", "iterations=1", "group_size=4", "artifacts.grid_every=0")
    (r,) = train_t2i(cfg)
    edges = cfg.prompts_per_iteration * cfg.group_size * 5  # 5 of the 6 steps trained (train_fraction 0.99)
    assert r["nfe_grad"] == edges and r["nfe_nograd"] == r["rollout_nfe_nograd"]  # no extra forward
    assert r["optimizer_steps"] == 2 and r["backward_passes"] == 2
    assert r["check/first_pass_ratio_dev"] < 1e-4


@pytest.mark.heavy
def test_flow_dppo_learns(tmp_path):
    # one optimizer step per rollout (on policy: KL = 0, nothing masked, the unclipped gradient). With the
    # recipe's two steps the second, unclipped, step at lr 3e-2 erases the gain on this toy (measured: gain
    # -1.2 standard errors; lr 1e-2: +1.1): open, see the report of issue 28.
    m = learning_margin("flow_dppo", tmp_path, iterations=16, extra=("train.mini_batches=1",))
    assert m["first_learn"] == pytest.approx(m["first_still"], abs=1e-7), m
    assert m["gain"] > 4.0 * m["noise"] and m["gain"] > 0, m
