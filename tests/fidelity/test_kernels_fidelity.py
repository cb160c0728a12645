"""Transition kernels, split noise and the decoded latent against the published code's formulas (float64).

- Flow-GRPO sde_step_with_logprob (also MixGRPO `--flow_grpo_sampling` eta 0.7, Flow-GRPO-Fast noise 0.8,
  Pref-GRPO flow_grpo_step): std_dev_t = a sqrt(sigma / (1 - sigma')) with sigma' = sigmas[1] at sigma = 1,
  mean = x (1 + std_dev_t^2 dt / (2 sigma)) + v (1 + std_dev_t^2 (1 - sigma) / (2 sigma)) dt (dt < 0),
  x_next = mean + std_dev_t sqrt(-dt) eps, log N(x_next; mean, (std_dev_t sqrt(-dt))^2) averaged over dims.
- DanceGRPO flux_step (sde_solver): mean = x + dsigma v - 0.5 eta^2 score dsigma with
  score = -(x - (1 - sigma) x0_hat) / sigma^2, std = eta sqrt(sigma - sigma_next).
- BranchGRPO flux_step_with_split: child = mean + (split_noise_scale eps) std; log-prob with the UNSCALED std.
- DanceGRPO / Pref-GRPO / BranchGRPO decode pred_original of the last step: x_{T-1} - sigma_{T-1} v.
- TP-GRPO CPS (YunzeTong/TurningPoint-GRPO, its SD3 SDE step with `sde_type="cps"`): x0_hat = x - sigma v,
  x1_hat = x + (1 - sigma) v, std = sigma' sin(a pi / 2), mean = x0_hat (1 - sigma') + x1_hat sqrt(sigma'^2 - std^2),
  x_next = mean + std eps; log-prob -mean_d (x_next - mean)^2 (constants dropped).
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "pipelines"))
from toy_adapter import ToyAdapter  # noqa: E402

from pipelines.plans import build_plan  # noqa: E402
from pipelines.sampler import Sampler, SamplerConfig  # noqa: E402
from pipelines.schedules import flow_schedule, time_shift_schedule  # noqa: E402
from pipelines.steps import step  # noqa: E402

GRIDS = {"sd3_diffusers_10": lambda: flow_schedule(10, shift=3.0), "time_shift_16": lambda: time_shift_schedule(16)}


def gaussian_logp(x, mean, std):
    return (-((x - mean) ** 2) / (2 * std**2) - math.log(std) - 0.5 * math.log(2 * math.pi)).mean()


def flow_grpo_step(x, v, sigmas, i, a, eps):
    sigma, sigma_prev, sigma_max = sigmas[i], sigmas[i + 1], sigmas[1]
    dt = sigma_prev - sigma
    std_dev_t = math.sqrt(sigma / (1 - (sigma_max if sigma == 1 else sigma))) * a
    mean = x * (1 + std_dev_t**2 / (2 * sigma) * dt) + v * (1 + std_dev_t**2 * (1 - sigma) / (2 * sigma)) * dt
    std = std_dev_t * math.sqrt(-dt)
    x_next = mean + std * eps
    return x_next, mean, std, gaussian_logp(x_next, mean, std)


def dance_step(x, v, sigmas, i, eta, eps):
    sigma, sigma_next = sigmas[i], sigmas[i + 1]
    dsigma = sigma_next - sigma
    x0 = x - sigma * v
    score = -(x - x0 * (1 - sigma)) / sigma**2
    mean = x + dsigma * v - 0.5 * eta**2 * score * dsigma
    std = eta * math.sqrt(sigma - sigma_next)
    return mean + std * eps, mean, std


def run_kernel(name, x, v, sched, i, eps, **settings):
    """Our kernel on float32 copies of the float64 inputs."""
    f32 = lambda a: torch.tensor(a, dtype=torch.float32)
    return step(name, f32(x), f32(v), sched, i, f32(eps), **settings)


@pytest.mark.parametrize("grid", sorted(GRIDS))
@pytest.mark.parametrize("a", [0.7, 0.8])
def test_flow_sde_is_flow_grpos_step(grid, a):
    sched = GRIDS[grid]()
    sig = sched.sigmas.double().numpy()
    rng = np.random.default_rng(3)
    for i in range(sched.num_steps):
        x, v, eps = (rng.standard_normal((2, 4, 8, 8)) for _ in range(3))
        out = run_kernel("flow_sde", x, v, sched, i, eps, a=a)
        for b in range(2):
            x_next, mean, std, logp = flow_grpo_step(x[b], v[b], sig, i, a, eps[b])
            np.testing.assert_allclose(out.mean[b].double().numpy(), mean, rtol=1e-5, atol=2e-6)
            np.testing.assert_allclose(out.x_next[b].double().numpy(), x_next, rtol=1e-5, atol=2e-6)
            assert float(out.std) == pytest.approx(std, rel=1e-5)
            # logp of OUR float32 x_next under the published density (the ratio uses exactly this)
            ours_x = out.x_next[b].double().numpy()
            assert float(out.logp[b]) == pytest.approx(gaussian_logp(ours_x, mean, std), rel=1e-4, abs=1e-4)


@pytest.mark.parametrize("eta", [0.3, 0.7])
def test_dance_sde_is_dancegrpos_flux_step(eta):
    sched = time_shift_schedule(16)
    sig = sched.sigmas.double().numpy()
    rng = np.random.default_rng(4)
    for i in range(sched.num_steps):
        x, v, eps = (rng.standard_normal((1, 4, 8, 8)) for _ in range(3))
        out = run_kernel("dance_sde", x, v, sched, i, eps, eta=eta)
        x_next, mean, std = dance_step(x[0], v[0], sig, i, eta, eps[0])
        np.testing.assert_allclose(out.mean[0].double().numpy(), mean, rtol=1e-5, atol=5e-6)
        np.testing.assert_allclose(out.x_next[0].double().numpy(), x_next, rtol=1e-5, atol=5e-6)
        assert float(out.std) == pytest.approx(std, rel=1e-5)


def cps_step(x, v, sigmas, i, a, eps):
    sigma, sigma_next = sigmas[i], sigmas[i + 1]
    x0, x1 = x - sigma * v, x + (1 - sigma) * v
    std = sigma_next * math.sin(a * math.pi / 2)
    # max(0, .) only guards float rounding at sigma' = 0; a = 1 makes the term exactly 0
    mean = x0 * (1 - sigma_next) + x1 * math.sqrt(max(sigma_next**2 - std**2, 0.0))
    x_next = mean + std * eps
    return x_next, mean, std


@pytest.mark.parametrize("grid", sorted(GRIDS))
@pytest.mark.parametrize("a", [0.7, 0.8])  # not 0.5, where sin(a pi/2) = cos(a pi/2) would hide a swap
def test_cps_is_tp_grpos_step(grid, a):
    sched = GRIDS[grid]()
    sig = sched.sigmas.double().numpy()
    rng = np.random.default_rng(5)
    for i in range(sched.num_steps):  # every sigma, the last (std 0, mean = x0_hat) included
        x, v, eps = (rng.standard_normal((2, 4, 8, 8)) for _ in range(3))
        out = run_kernel("cps", x, v, sched, i, eps, a=a)
        for b in range(2):
            x_next, mean, std = cps_step(x[b], v[b], sig, i, a, eps[b])
            np.testing.assert_allclose(out.mean[b].double().numpy(), mean, rtol=1e-5, atol=2e-6)
            np.testing.assert_allclose(out.x_next[b].double().numpy(), x_next, rtol=1e-5, atol=2e-6)
            assert float(out.std) == pytest.approx(std, rel=1e-5, abs=1e-7)
            # the surrogate of OUR float32 x_next around the published mean (what the ratio uses)
            ours_x = out.x_next[b].double().numpy()
            assert float(out.logp[b]) == pytest.approx(-((ours_x - mean) ** 2).mean(), rel=1e-4, abs=1e-7)


def test_split_noise_scales_the_sample_not_the_density():
    """BranchGRPO: sample = mean + (4 eps) std; log_prob under N(mean, std^2)."""
    sched = time_shift_schedule(20)
    sig = sched.sigmas.double().numpy()
    rng = np.random.default_rng(5)
    x, v, eps = (rng.standard_normal((1, 4, 8, 8)) for _ in range(3))
    out = run_kernel("dance_sde", x, v, sched, 3, eps, noise_scale=4.0, eta=0.3)
    _, mean, std = dance_step(x[0], v[0], sig, 3, 0.3, eps[0])
    sample = mean + (eps[0] * 4.0) * std
    np.testing.assert_allclose(out.x_next[0].double().numpy(), sample, rtol=1e-5, atol=5e-6)
    assert float(out.logp[0]) == pytest.approx(gaussian_logp(out.x_next[0].double().numpy(), mean, std), rel=1e-4)


def test_tree_plan_split_steps_are_four_times_wider():
    """The whole tree rollout: displacement / std is ~N(0, 16) on split edges, ~N(0, 1) elsewhere."""
    adapter = ToyAdapter(channels=4)
    cfg = SamplerConfig(
        num_steps=8,
        sde_kernel={"name": "dance_sde", "eta": 0.3},
        cfg_mode="none",
        schedule={"name": "time_shift", "shift": 3.0},
        height=64,
        width=64,
    )
    plan = build_plan("tree", 8, split_steps=[0, 3], branch=2, noise_scale=4.0)
    tree = Sampler(cfg).run(adapter, ["a cat"], plan, 4, torch.Generator().manual_seed(2))
    sig = tree.schedule.sigmas.double().numpy()
    cond = len("a cat") / 10
    w = adapter.denoiser.weight.detach().double().numpy()[:, :, 0, 0]
    b = adapter.denoiser.bias.detach().double().numpy()
    z = {True: [], False: []}
    for e in (tree.parent >= 0).nonzero().squeeze(1).tolist():
        i = int(tree.edge_step[e])
        x = tree.states[tree.parent[e]].double().numpy()
        v = np.einsum("oc,chw->ohw", w, x) + b[:, None, None] + cond * (1 + sig[i])
        _, mean, std = dance_step(x, v, sig, i, 0.3, 0.0)
        x_next = tree.states[e].double().numpy()
        z[i in (0, 3)].append((x_next - mean) / std)
        assert float(tree.edge_logp[e]) == pytest.approx(gaussian_logp(x_next, mean, std), rel=1e-4, abs=1e-4)
    assert np.std(np.concatenate(z[True])) == pytest.approx(4.0, rel=0.1)
    assert np.std(np.concatenate(z[False])) == pytest.approx(1.0, rel=0.1)


def test_decode_last_x0_is_the_last_steps_clean_estimate():
    adapter = ToyAdapter()
    base = dict(
        num_steps=6,
        sde_kernel={"name": "dance_sde", "eta": 0.3},
        cfg_mode="none",
        schedule={"name": "time_shift", "shift": 3.0},
        height=16,
        width=16,
    )
    tree = Sampler(SamplerConfig(**base, decode="last_x0")).run(
        adapter, ["a cat", "a dog!"], build_plan("full_sde", 6), 3, torch.Generator().manual_seed(0)
    )
    sig = tree.schedule.sigmas.double().numpy()
    w = adapter.denoiser.weight.detach().double().numpy()[:, :, 0, 0]
    b = adapter.denoiser.bias.detach().double().numpy()
    images = tree.leaf_latents()
    assert images.shape[:2] == tree.leaves.shape
    for p in range(2):
        cond = len(["a cat", "a dog!"][p]) / 10
        for g in range(3):
            leaf = tree.leaves[p, g]
            x = tree.states[tree.parent[leaf]].double().numpy()  # x_{T-1}
            v = np.einsum("oc,chw->ohw", w, x) + b[:, None, None] + cond * (1 + sig[-2])
            np.testing.assert_allclose(images[p, g].double().numpy(), x - sig[-2] * v, rtol=1e-5, atol=2e-6)
            assert not np.allclose(images[p, g].numpy(), tree.states[leaf].numpy())  # not the noisy final state
    same = Sampler(SamplerConfig(**base)).run(
        adapter, ["a cat", "a dog!"], build_plan("full_sde", 6), 3, torch.Generator().manual_seed(0)
    )
    torch.testing.assert_close(same.states, tree.states)  # decoding changes no state, edge or log-prob
    torch.testing.assert_close(same.edge_logp, tree.edge_logp, equal_nan=True)
    torch.testing.assert_close(same.leaf_latents(), same.states[same.leaves])
