"""The two KL forms against Flow-GRPO's published expression, in float64.

yifan123/flow_grpo scripts/train_sd3.py (train.beta > 0):
    kl_loss = ((prev_sample_mean - prev_sample_mean_ref) ** 2).mean(dim=(1, 2, 3)) / (2 * std_dev_t ** 2)
with std_dev_t from sde_step_with_logprob:
    std_dev_t = sqrt(sigma / (1 - where(sigma == 1, sigma_max = sigmas[1], sigma))) * noise_level
    prev_sample_mean = x (1 + std_dev_t^2 / (2 sigma) dt) + v (1 + std_dev_t^2 (1 - sigma) / (2 sigma)) dt,  dt < 0
The exact per-step Gaussian KL divides by the transition variance std_dev_t^2 |dt| instead.
"""

from __future__ import annotations

import contextlib
import copy
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "pipelines"))
from toy_adapter import ToyAdapter  # noqa: E402

from flowgrpo.core import LossConfig, LossNormalizer  # noqa: E402
from flowgrpo.t2i.objectives import EdgeObjective, edge_batch  # noqa: E402
from pipelines.plans import build_plan  # noqa: E402
from pipelines.sampler import Sampler, SamplerConfig  # noqa: E402


def flow_grpo_mean_and_std(x, v, sigmas, i, a):
    """Flow-GRPO's sde_step_with_logprob in float64: (prev_sample_mean, std_dev_t)."""
    sigma, sigma_prev, sigma_max = sigmas[i], sigmas[i + 1], sigmas[1]
    dt = sigma_prev - sigma
    std_dev_t = np.sqrt(sigma / (1 - (sigma_max if sigma == 1 else sigma))) * a
    mean = x * (1 + std_dev_t**2 / (2 * sigma) * dt) + v * (1 + std_dev_t**2 * (1 - sigma) / (2 * sigma)) * dt
    return mean, std_dev_t


def toy_velocity(adapter: ToyAdapter, x: np.ndarray, sigma: float, cond: float) -> np.ndarray:
    """The toy model (1x1 conv + (1 + t) * prompt embedding) evaluated in float64, no CFG."""
    w = adapter.denoiser.weight.detach().double().numpy()[:, :, 0, 0]
    b = adapter.denoiser.bias.detach().double().numpy()
    return np.einsum("oc,chw->ohw", w, x) + b[:, None, None] + cond * (1 + sigma)


def build(a: float, steps: int = 6):
    policy = ToyAdapter(seed=0)
    ref = copy.deepcopy(policy)
    with torch.no_grad():  # the reference differs from the policy, so the KL is not zero
        ref.denoiser.weight.add_(0.05 * torch.randn_like(ref.denoiser.weight))
    sampler = Sampler(
        SamplerConfig(num_steps=steps, sde_kernel={"name": "flow_sde", "a": a}, cfg_mode="none", height=16, width=16)
    )
    tree = sampler.run(
        policy,
        ["a cat", "a red bicycle"],
        build_plan("full_sde", steps, train_fraction=1.0),
        3,
        torch.Generator().manual_seed(1),
    )
    return policy, ref, sampler, tree


def objective_kl(estimator: str, beta: float, a: float):
    policy, ref, sampler, tree = build(a)
    loss = LossConfig(preset="flow_grpo", kl={"estimator": estimator, "coef": beta})
    objective = EdgeObjective(sampler, loss, reference=lambda: contextlib.nullcontext(ref))
    edges = tree.edge_sde.nonzero().squeeze(1)
    batch = edge_batch(tree, edges, torch.zeros(edges.numel()), torch.ones(edges.numel()))
    norm = LossNormalizer.from_inputs(batch.inputs())
    with torch.no_grad():
        out = objective(policy, tree, batch, ["a cat", "a red bicycle"], norm).output
    return float(out.loss), (policy, ref, tree, edges)


def reference_kls(policy, ref, tree, edges, a: float):
    """Per-edge KLs in float64 from the published formula: (flow_grpo form, exact Gaussian)."""
    sig = tree.schedule.sigmas.double().numpy()
    conds = {0: len("a cat") / 10, 1: len("a red bicycle") / 10}
    fg, exact = [], []
    for e in edges.tolist():
        i = int(tree.edge_step[e])
        x = tree.states[tree.parent[e]].double().numpy()
        cond = conds[int(tree.prompt[e])]
        mean, std_dev_t = flow_grpo_mean_and_std(x, toy_velocity(policy, x, sig[i], cond), sig, i, a)
        mean_ref, _ = flow_grpo_mean_and_std(x, toy_velocity(ref, x, sig[i], cond), sig, i, a)
        msd = ((mean - mean_ref) ** 2).mean()
        fg.append(msd / (2 * std_dev_t**2))
        exact.append(msd / (2 * std_dev_t**2 * (sig[i] - sig[i + 1])))
    return np.array(fg), np.array(exact)


@pytest.mark.parametrize("a", [0.7, 0.8])
def test_flow_grpo_kl_matches_the_published_expression(a):
    beta = 0.04
    got, (policy, ref, tree, edges) = objective_kl("flow_grpo", beta, a)
    fg, _ = reference_kls(policy, ref, tree, edges, a)
    assert fg.min() > 0
    assert got == pytest.approx(beta * fg.mean(), rel=2e-4)  # token mean over edges, A = 0


def test_gaussian_kl_is_the_exact_step_kl_and_1_over_dt_times_flow_grpo():
    beta, a = 0.04, 0.7
    got, (policy, ref, tree, edges) = objective_kl("gaussian", beta, a)
    fg, exact = reference_kls(policy, ref, tree, edges, a)
    assert got == pytest.approx(beta * exact.mean(), rel=2e-4)
    sig = tree.schedule.sigmas.double().numpy()
    dt = sig[tree.edge_step[edges].numpy()] - sig[tree.edge_step[edges].numpy() + 1]
    np.testing.assert_allclose(exact, fg / dt, rtol=1e-12)
    assert (1 / dt).min() > 1.5  # the exact form is several times stronger per step at the same beta


def test_flow_presets_default_to_the_flow_grpo_form():
    assert LossConfig(preset="flow_grpo", kl={"coef": 0.04}).kl.estimator == "flow_grpo"
    assert LossConfig(preset="grpo_guard", kl={"coef": 0.004}).kl.estimator == "flow_grpo"
    assert LossConfig(preset="flow_grpo", kl={"estimator": "gaussian", "coef": 0.04}).kl.estimator == "gaussian"
