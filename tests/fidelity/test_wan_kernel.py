"""Flow-GRPO's Wan 2.1 step and loss weight against the published code's formulas, re-derived in float64.

- `sde_step_with_logprob` of flow_grpo/diffusers_patch/wan_pipeline_with_logprob.py (read in the fork
  zhtmike/flow_grpo@def7b84; not stored for yifan123/flow_grpo): on UniPC's flow grid, sigma = sigmas[i],
  sigma_prev = sigmas[i + 1], dt = sigma_prev - sigma < 0, sigma_max = sigmas[1], sigma_min = sigmas[-1],
  std_dev_t = sigma_min + (sigma_max - sigma_min) * sigma,
  mean = x (1 + std_dev_t^2 dt / (2 sigma)) + v (1 + std_dev_t^2 (1 - sigma) / (2 sigma)) dt,
  x_next = mean + std_dev_t sqrt(-dt) eps, logp = mean_d log N(x_next; mean, (std_dev_t sqrt(-dt))^2).
- yifan123/flow_grpo scripts/train_wan2_1.py@32b48fd: per step j, policy_loss = mean_b max(-A r, -A clip(r, 1 +- eps))
  times std_dev_t.mean() / sqrt(-dt).mean(); loss = policy_loss + beta * mean_b mean_d (mu - mu_ref)^2 / (2 std^2).
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch
from diffusers import UniPCMultistepScheduler

sys.path.insert(0, str(Path(__file__).parents[1] / "pipelines"))
from toy_adapter import ToyAdapter  # noqa: E402

from flowgrpo.core import LossConfig, LossInputs, policy_loss  # noqa: E402
from pipelines.plans import build_plan  # noqa: E402
from pipelines.sampler import Sampler, SamplerConfig  # noqa: E402
from pipelines.schedules import FlowSchedule, ddim_schedule  # noqa: E402
from pipelines.steps import rescore, step  # noqa: E402


def wan_grid(num_steps: int = 20, flow_shift: float = 3.0) -> FlowSchedule:
    """Wan 2.1's published scheduler (UniPC, flow sigmas) and its own grid, as the wan adapter's flow_grid builds it."""
    sched = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=flow_shift)
    sched.set_timesteps(num_steps)
    return FlowSchedule(sched.sigmas.float(), sched.timesteps.float())


GRID = wan_grid()


def published_step(x, v, sigmas, i, eps):
    """The source's step in float64: (x_next, mean, std, logp [B])."""
    sigma, sigma_prev = float(sigmas[i]), float(sigmas[i + 1])
    sigma_max, sigma_min = float(sigmas[1]), float(sigmas[-1])
    dt = sigma_prev - sigma
    std_dev_t = sigma_min + (sigma_max - sigma_min) * sigma
    mean = x * (1 + std_dev_t**2 / (2 * sigma) * dt) + v * (1 + std_dev_t**2 * (1 - sigma) / (2 * sigma)) * dt
    std = std_dev_t * math.sqrt(-dt)
    x_next = mean + std * eps
    logp = -((x_next - mean) ** 2) / (2 * std**2) - math.log(std) - math.log(math.sqrt(2 * math.pi))
    return x_next, mean, std, logp.flatten(1).mean(1)


def _xve(b=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, 4, 3, 4, 4, generator=g, dtype=torch.float64) for _ in range(3)]  # [B, C, F, H, W]


def test_the_grid_is_uniPC_s_own():
    # the kernel reads sigmas[1] and sigmas[-1] off the schedule: on Wan's grid these are 0.98... and 0
    assert GRID.sigmas[0] > 0.9999 and float(GRID.sigmas[-1]) == 0.0 and GRID.num_steps == 20


@pytest.mark.parametrize("i", [0, 1, 9, 18, 19])
def test_step_equals_the_published_step_in_float64(i):
    x, v, eps = _xve()
    want_next, want_mean, want_std, want_logp = published_step(x, v, GRID.sigmas.double(), i, eps)
    out = step("wan_sde", x.float(), v.float(), GRID, i, eps.float())
    torch.testing.assert_close(out.mean.double(), want_mean, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.x_next.double(), want_next, rtol=1e-5, atol=1e-5)
    assert float(out.std) == pytest.approx(want_std, rel=1e-5)
    torch.testing.assert_close(out.logp.double(), want_logp, rtol=1e-5, atol=1e-4)
    # re-scoring the published x_next gives the published log-prob (the training-time call with prev_sample)
    again = rescore("wan_sde", x.float(), want_next.float(), v.float(), GRID, i)
    torch.testing.assert_close(again.logp.double(), want_logp, rtol=1e-5, atol=1e-4)
    assert torch.allclose(out.x0_hat.double(), x - float(GRID.sigmas[i]) * v, atol=1e-5)


def test_noise_level_is_linear_in_sigma_and_not_flow_sde_s():
    x, v, _ = _xve(b=1)
    s = GRID.sigmas.double()
    levels = []
    for i in range(GRID.num_steps):
        dt = float(s[i] - s[i + 1])
        levels.append(float(step("wan_sde", x.float(), v.float(), GRID, i).std) / math.sqrt(dt))
    want = [float(s[-1] + (s[1] - s[-1]) * s[i]) for i in range(GRID.num_steps)]
    assert levels == pytest.approx(want, rel=1e-5)
    assert levels[0] == pytest.approx(float(s[1]), rel=1e-4)  # sigma_0 ~ 1: about sigma_1, no blow-up at sigma = 1
    flow = float(step("flow_sde", x.float(), v.float(), GRID, 5, a=0.7).std)
    assert abs(flow - float(step("wan_sde", x.float(), v.float(), GRID, 5).std)) > 1e-3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rescore_of_own_sample_gives_ratio_exactly_one(dtype):
    x, v, _ = (t.to(dtype) for t in _xve())
    for i in range(GRID.num_steps):
        out = step("wan_sde", x, v, GRID, i, generator=torch.Generator().manual_seed(i))
        again = rescore("wan_sde", x, out.x_next, v, GRID, i)
        assert torch.equal(again.logp, out.logp) and torch.isfinite(out.logp).all()
        x = out.x_next


def test_per_edge_step_index_matches_scalar_index_and_bad_input_is_named():
    x, v, x_next = (t.float() for t in _xve(b=3))
    idx = torch.tensor([0, 7, 19])
    batched = rescore("wan_sde", x, x_next, v, GRID, idx)
    for row, i in enumerate(idx.tolist()):
        one = rescore("wan_sde", x[row : row + 1], x_next[row : row + 1], v[row : row + 1], GRID, i)
        torch.testing.assert_close(batched.logp[row : row + 1], one.logp, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="kernel 'wan_sde' needs a FlowSchedule"):
        step("wan_sde", x, v, ddim_schedule(4), 0)
    with pytest.raises(ValueError, match="kernel 'wan_sde' has no setting 'a'"):
        step("wan_sde", x, v, GRID, 0, a=0.7)  # the published SDE has no noise-level setting


def test_a_sampler_rollout_with_wan_sde_has_the_published_log_probs():
    adapter = ToyAdapter(channels=4)
    cfg = SamplerConfig(num_steps=5, sde_kernel={"name": "wan_sde"}, cfg_mode="none", height=16, width=16,
                        schedule={"name": "time_shift", "shift": 3.0})  # fmt: skip
    tree = Sampler(cfg).run(adapter, ["a cat"], build_plan("full_sde", 5), 2, torch.Generator().manual_seed(0))
    sig = tree.schedule.sigmas.double()
    w = adapter.denoiser.weight.detach().double()[:, :, 0, 0]
    b = adapter.denoiser.bias.detach().double()
    edges = (tree.parent >= 0).nonzero().squeeze(1).tolist()
    assert len(edges) == 2 * 5
    for e in edges:
        i = int(tree.edge_step[e])
        x = tree.states[tree.parent[e]].double()[None]
        v = torch.einsum("oc,bchw->bohw", w, x) + b[:, None, None] + len("a cat") / 10 * (1 + float(sig[i]))
        x_next = tree.states[e].double()[None]
        _, mean, std, _ = published_step(x, v, sig, i, torch.zeros_like(x))
        logp = -((x_next - mean) ** 2) / (2 * std**2) - math.log(std) - 0.5 * math.log(2 * math.pi)
        assert float(tree.edge_logp[e]) == pytest.approx(float(logp.mean()), rel=1e-4, abs=1e-4)
        assert float(tree.edge_std[e]) == pytest.approx(std, rel=1e-5)


def test_std_over_dt_loss_equals_the_published_per_step_loss():
    """Two steps x 4 samples: ours (token_mean over edges, std_over_dt) = the mean over steps of the published loss."""
    g = torch.Generator().manual_seed(3)
    steps, b, eps, beta = [2, 11], 4, 1e-3, 0.004
    s = GRID.sigmas.double()
    logp = torch.randn(len(steps) * b, 1, generator=g, dtype=torch.float64) * 1e-3
    logp_old = logp + torch.randn(logp.shape, generator=g, dtype=torch.float64) * 2e-3  # some ratios clip
    adv = torch.randn(len(steps) * b, generator=g, dtype=torch.float64)
    sqd_ref = torch.rand(len(steps) * b, 1, generator=g, dtype=torch.float64) * 1e-4
    dts = torch.tensor([float(s[j] - s[j + 1]) for j in steps], dtype=torch.float64).repeat_interleave(b)
    levels = torch.tensor([float(s[-1] + (s[1] - s[-1]) * s[j]) for j in steps], dtype=torch.float64)
    std = levels.repeat_interleave(b) * dts.sqrt()  # the kernel's transition std
    published = []
    for k, j in enumerate(steps):
        rows = slice(k * b, (k + 1) * b)
        ratio = torch.exp(logp[rows, 0] - logp_old[rows, 0])
        a = adv[rows]
        pl = torch.maximum(-a * ratio, -a * ratio.clamp(1 - eps, 1 + eps)).mean()
        pl = pl * levels[k] / math.sqrt(float(s[j] - s[j + 1]))
        kl = (sqd_ref[rows, 0] / (2 * std[rows] ** 2)).mean()
        published.append(pl + beta * kl)
    inputs = LossInputs(
        logp=logp.float(), logp_old=logp_old.float(), advantages=adv.float(), mask=torch.ones(len(adv), 1).bool(),
        mean_sqdist_ref=sqd_ref.float(), std=std.float().view(-1, 1), dt=dts.float().view(-1, 1),
    )  # fmt: skip
    cfg = LossConfig.model_validate(
        {"preset": "flow_grpo", "bounds": {"eps": eps}, "kl": {"estimator": "gaussian", "coef": beta},
         "step_weighting": "std_over_dt"}
    )  # fmt: skip
    ours = policy_loss(inputs, cfg).loss
    want = torch.stack(published).mean()
    assert float(ours) == pytest.approx(float(want), rel=1e-4)
    unweighted = policy_loss(inputs, cfg.model_copy(update={"step_weighting": LossConfig().step_weighting})).loss
    assert abs(float(unweighted) - float(want)) > 1e-3 * abs(float(want))  # the weight matters at these steps
