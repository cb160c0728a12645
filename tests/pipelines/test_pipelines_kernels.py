"""Transition kernels: ratio 1 on re-scoring, moments, log-prob by hand, zero-noise limits, bad input."""

import math

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler
from hypothesis import given, settings
from hypothesis import strategies as st

from pipelines.schedules import ddim_schedule, flow_schedule
from pipelines.steps import KERNELS, rescore, step

FLOW = flow_schedule(10, shift=3.0)
DDIM = ddim_schedule(10)
# (kernel, settings, schedule, settings that make its std 0)
STOCHASTIC = [
    ("flow_sde", {"a": 0.7}, FLOW, {"a": 0.0}),
    ("dance_sde", {"eta": 0.3}, FLOW, {"eta": 0.0}),
    ("cps", {"a": 0.8}, FLOW, {"a": 0.0}),
    ("ddim", {"eta": 1.0}, DDIM, {"eta": 0.0}),
]
IDS = [k[0] for k in STOCHASTIC]


def _xv(b=3, dtype=torch.float32):
    x = torch.randn(b, 4, 6, 6)
    return x.to(dtype), torch.randn_like(x).to(dtype)


def test_registry_names_every_kernel():
    assert KERNELS.names() == ["cps", "dance_sde", "ddim", "dpm2m", "flow_sde", "ode", "wan_sde"]


@pytest.mark.parametrize("kernel,cfg,sched,_", STOCHASTIC, ids=IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rescore_of_own_sample_gives_ratio_exactly_one(kernel, cfg, sched, _, dtype):
    x, v = _xv(dtype=dtype)
    for i in range(sched.num_steps):
        out = step(kernel, x, v, sched, i, **cfg)
        again = rescore(kernel, x, out.x_next, v, sched, i, **cfg)
        assert torch.equal(again.logp, out.logp) and torch.equal(again.mean, out.mean)
        assert torch.exp(again.logp - out.logp).eq(1).all()
        assert torch.isfinite(out.logp).all()
        x = out.x_next


@settings(max_examples=25, deadline=None)
@given(
    k=st.integers(0, len(STOCHASTIC) - 1),
    b=st.integers(1, 4),
    seed=st.integers(0, 2**16),
    scale=st.sampled_from([1.0, 0.3, 4.0]),
)
def test_ratio_one_property(k, b, seed, scale):
    kernel, cfg, sched, _ = STOCHASTIC[k]
    g = torch.Generator().manual_seed(seed)
    x, v = torch.randn(b, 2, 5, generator=g), torch.randn(b, 2, 5, generator=g)
    i = int(torch.randint(sched.num_steps, (), generator=g))
    out = step(kernel, x, v, sched, i, generator=g, noise_scale=scale, **cfg)
    assert torch.equal(rescore(kernel, x, out.x_next, v, sched, i, **cfg).logp, out.logp)


@pytest.mark.parametrize("kernel,cfg,sched,_", STOCHASTIC, ids=IDS)
def test_per_sample_step_index_matches_scalar_index(kernel, cfg, sched, _):
    x, v = _xv(b=4)
    idx = torch.tensor([0, 3, 7, sched.num_steps - 1])
    x_next = torch.randn_like(x)
    batched = rescore(kernel, x, x_next, v, sched, idx, **cfg)
    assert batched.std.shape in ((4,), ())
    for row, i in enumerate(idx.tolist()):
        one = rescore(kernel, x[row : row + 1], x_next[row : row + 1], v[row : row + 1], sched, i, **cfg)
        torch.testing.assert_close(batched.logp[row : row + 1], one.logp, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(batched.mean[row : row + 1], one.mean, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kernel,cfg,sched,_", STOCHASTIC, ids=IDS)
@pytest.mark.parametrize("scale", [1.0, 2.5])
def test_sample_moments_match_mean_and_std(kernel, cfg, sched, _, scale):
    n, i = 20000, 4
    x1, v1 = _xv(b=1)
    x, v = x1.expand(n, -1, -1, -1), v1.expand(n, -1, -1, -1)
    out = step(kernel, x, v, sched, i, noise_scale=scale, **cfg)
    std = float(out.std)
    assert std > 0
    se = scale * std / math.sqrt(n)
    assert (out.x_next.mean(0) - out.mean[0]).abs().max() < 5 * se
    emp = out.x_next.std(0)
    assert (emp / (scale * std) - 1).abs().max() < 0.05


@pytest.mark.parametrize("kernel,cfg,sched,_", [k for k in STOCHASTIC if k[0] != "cps"], ids=IDS[:2] + IDS[3:])
def test_logp_is_the_gaussian_density_by_hand(kernel, cfg, sched, _):
    x, v = torch.randn(2, 3), torch.randn(2, 3)
    out = step(kernel, x, v, sched, 2, noise_scale=3.0, **cfg)  # logp reads the NOMINAL std
    s = float(out.std)
    for b in range(2):
        dens = [
            -((float(out.x_next[b, j]) - float(out.mean[b, j])) ** 2) / (2 * s * s)
            - math.log(s)
            - 0.5 * math.log(2 * math.pi)
            for j in range(3)
        ]
        assert float(out.logp[b]) == pytest.approx(sum(dens) / 3, rel=1e-5, abs=1e-5)


def test_cps_logp_is_the_constant_free_surrogate():
    x, v = torch.randn(2, 3), torch.randn(2, 3)
    out = step("cps", x, v, FLOW, 2)
    for b in range(2):
        by_hand = -sum((float(out.x_next[b, j]) - float(out.mean[b, j])) ** 2 for j in range(3)) / 3
        assert float(out.logp[b]) == pytest.approx(by_hand, rel=1e-5)
    last = step("cps", x, v, FLOW, FLOW.num_steps - 1)  # std 0 at the last step: deterministic
    assert float(last.std) == 0 and torch.equal(last.x_next, last.mean) and (last.logp == 0).all()


@pytest.mark.parametrize("kernel,cfg,sched,zero", STOCHASTIC, ids=IDS)
def test_zero_noise_gives_the_mean_and_zero_std_gives_the_ode(kernel, cfg, sched, zero):
    x, v = _xv()
    for i in (0, 5, sched.num_steps - 1):
        out = step(kernel, x, v, sched, i, torch.zeros_like(x), **cfg)
        assert torch.equal(out.x_next, out.mean)
        det = step(kernel, x, v, sched, i, **zero)
        assert float(det.std) == 0 and (det.logp == 0).all()
        if sched is FLOW:  # every flow SDE shares the probability-flow ODE as its zero-noise limit
            torch.testing.assert_close(det.x_next, step("ode", x, v, sched, i).x_next, rtol=1e-5, atol=1e-5)


def test_flow_and_dance_means_are_the_reverse_sde_drift():
    # mean = x - dt * [v + g^2/(2 sigma) * (x + (1-sigma) v)]: Flow-GRPO's g = a sqrt(sigma/(1-sigma)),
    # DanceGRPO's g = eta. Checks the sign conventions of both published forms against one another.
    x, v = _xv()
    for i in (1, 4, 9):
        s, s1 = float(FLOW.sigmas[i]), float(FLOW.sigmas[i + 1])
        dt, eps_hat = s - s1, x + (1 - s) * v
        for kernel, cfg, g2 in (("flow_sde", {"a": 0.7}, 0.49 * s / (1 - s)), ("dance_sde", {"eta": 0.3}, 0.09)):
            want = x - dt * (v + g2 / (2 * s) * eps_hat)
            torch.testing.assert_close(step(kernel, x, v, FLOW, i, **cfg).mean, want, rtol=1e-5, atol=1e-5)
            assert float(step(kernel, x, v, FLOW, i, **cfg).std) == pytest.approx(math.sqrt(g2 * dt), rel=1e-5)


def test_flow_sde_is_finite_at_sigma_one():
    assert FLOW.sigmas[0] == 1.0
    x, v = _xv()
    out = step("flow_sde", x, v, FLOW, 0, a=0.7)
    s1 = float(FLOW.sigmas[1])
    # the denominator uses sigmas[1]: g = a * sqrt(1 / (1 - sigma_1)), std = g * sqrt(1 - sigma_1)
    assert float(out.std) == pytest.approx(0.7 * math.sqrt(1 / (1 - s1)) * math.sqrt(1 - s1), rel=1e-5)
    assert torch.isfinite(out.mean).all() and torch.isfinite(out.logp).all()


def test_ode_matches_diffusers_euler_step():
    ref = FlowMatchEulerDiscreteScheduler(shift=3.0)
    ref.set_timesteps(10)
    x, v = _xv()
    xa, xb = x.clone(), x.clone()
    for i, t in enumerate(ref.timesteps):
        xa = ref.step(v, t, xa).prev_sample
        out = step("ode", xb, v, FLOW, i)
        xb = out.x_next
        assert (out.logp == 0).all() and float(out.std) == 0
    torch.testing.assert_close(xb, xa, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kernel,cfg,sched,_", STOCHASTIC, ids=IDS)
def test_low_precision_input_keeps_float32_maths(kernel, cfg, sched, _):
    x, v = _xv(dtype=torch.bfloat16)
    out = step(kernel, x, v, sched, 3, **cfg)
    assert out.x_next.dtype == torch.bfloat16
    assert out.logp.dtype == out.mean.dtype == out.x0_hat.dtype == out.std.dtype == torch.float32
    assert out.logp.shape == (3,)


def test_rescore_gradient_flows_and_stays_finite_at_zero_std():
    x, v = _xv()
    v.requires_grad_(True)
    out = step("flow_sde", x, v.detach(), FLOW, 2)
    rescore("flow_sde", x, out.x_next, v * 1.01, FLOW, 2).logp.sum().backward()
    assert v.grad.abs().sum() > 0
    v.grad = None
    idx = torch.tensor([2, 9, 9])  # cps: std is 0 at the last step
    rescore("cps", x, torch.randn_like(x), v, FLOW, idx).logp.sum().backward()
    assert torch.isfinite(v.grad).all()
    v.grad = None
    rescore("dance_sde", x, torch.randn_like(x), v, FLOW, 2, eta=0.0).logp.sum().backward()
    assert torch.isfinite(v.grad).all()


def test_generator_makes_sampling_reproducible():
    x, v = _xv()
    a = step("dance_sde", x, v, FLOW, 1, generator=torch.Generator().manual_seed(7))
    b = step("dance_sde", x, v, FLOW, 1, generator=torch.Generator().manual_seed(7))
    assert torch.equal(a.x_next, b.x_next)


def test_bad_input_raises_naming_the_argument():
    x, v = _xv()
    bad = torch.randn(3, 4, 6, 5)
    with pytest.raises(ValueError, match="model_output"):
        step("flow_sde", x, bad, FLOW, 0)
    with pytest.raises(ValueError, match="noise"):
        step("flow_sde", x, v, FLOW, 0, bad)
    with pytest.raises(ValueError, match="x_next"):
        rescore("flow_sde", x, bad, v, FLOW, 0)
    with pytest.raises(ValueError, match="^x must"):
        step("flow_sde", torch.randn(5), torch.randn(5), FLOW, 0)
    with pytest.raises(ValueError, match="^i must"):
        step("flow_sde", x, v, FLOW, 10)
    with pytest.raises(ValueError, match="^i must"):
        step("flow_sde", x, v, FLOW, torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="^schedule"):
        step("ddim", x, v, FLOW, 0)
    with pytest.raises(ValueError, match="^schedule"):
        step("flow_sde", x, v, DDIM, 0)
    with pytest.raises(ValueError, match="valid names"):
        step("flow_ode", x, v, FLOW, 0)
    with pytest.raises(ValueError, match="no setting 'eta'"):
        step("flow_sde", x, v, FLOW, 0, eta=0.3)
    with pytest.raises(ValueError, match="^state"):
        step("ode", x, v, FLOW, 0, state=object())
    with pytest.raises(ValueError, match="noise_scale"):
        step("ode", x, v, FLOW, 0, noise_scale=2.0)
    with pytest.raises(ValueError, match="noise_scale"):
        step("flow_sde", x, v, FLOW, 0, noise_scale=-1.0)
    with pytest.raises(ValueError, match="a must"):
        step("cps", x, v, FLOW, 0, a=1.5)
