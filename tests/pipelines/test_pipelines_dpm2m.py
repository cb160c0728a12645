"""dpm2m: equals diffusers' DPM-Solver++(2M) for flow matching and beats Euler on an exact velocity field."""

import pytest
import torch
from diffusers import DPMSolverMultistepScheduler

from pipelines.schedules import FlowSchedule
from pipelines.steps import step

# Data N(M, S0^2) per dim: the flow-matching velocity E[eps - x0 | x_sigma] is exact, and the ODE maps
# noise z at sigma = 1 to M + S0 * z.
M, S0 = 0.7, 1.0


def velocity(x: torch.Tensor, sigma: float) -> torch.Tensor:
    var = (1 - sigma) ** 2 * S0**2 + sigma**2
    c = x - (1 - sigma) * M
    return sigma / var * c - (M + (1 - sigma) * S0**2 / var * c)


def solve(kernel: str, sched: FlowSchedule, x: torch.Tensor) -> torch.Tensor:
    state = None
    for i in range(sched.num_steps):
        kw = {"state": state} if kernel == "dpm2m" else {}
        out = step(kernel, x, velocity(x, float(sched.sigmas[i])), sched, i, **kw)
        x, state = out.x_next, out.state
    return x


def uniform(n: int, start: float, shift: float) -> FlowSchedule:
    t = torch.linspace(start, 0.0, n + 1, dtype=torch.float64)
    return FlowSchedule.from_sigmas(shift * t / (1 + (shift - 1) * t))


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # diffusers' own numpy call
def test_dpm2m_matches_diffusers_dpmsolver_multistep():
    ref = DPMSolverMultistepScheduler(
        algorithm_type="dpmsolver++",
        solver_order=2,
        prediction_type="flow_prediction",
        use_flow_sigmas=True,
        flow_shift=3.0,
        final_sigmas_type="zero",
    )
    ref.set_timesteps(10)
    sched = FlowSchedule.from_sigmas(ref.sigmas)
    x = torch.randn(2, 4, 8, 8)
    xa, xb, state = x.clone(), x.clone(), None
    for i, t in enumerate(ref.timesteps):
        sigma = float(sched.sigmas[i])
        xa = ref.step(velocity(xa, sigma), t, xa).prev_sample
        out = step("dpm2m", xb, velocity(xb, sigma), sched, i, state=state)
        xb, state = out.x_next, out.state
    torch.testing.assert_close(xb, xa, rtol=1e-5, atol=1e-5)


# Uniform grids as MixGRPO-Flash rebuilds them: the whole chain, and a post-window tail from 0.6.
@pytest.mark.parametrize("start", [1.0, 0.6])
@pytest.mark.parametrize("shift", [1.0, 3.0])
def test_dpm2m_10_steps_is_much_closer_to_the_200_step_reference_than_euler(start, shift):
    sched = uniform(10, start, shift)
    s = float(sched.sigmas[0])
    z = torch.randn(256, 16, dtype=torch.float64)
    x = (1 - s) * M + (((1 - s) * S0) ** 2 + s**2) ** 0.5 * z  # exact marginal at the grid's start
    ref = solve("ode", uniform(200, start, shift), x)
    err_euler = (solve("ode", sched, x) - ref).pow(2).mean().sqrt()
    err_dpm = (solve("dpm2m", sched, x) - ref).pow(2).mean().sqrt()
    assert err_dpm < 0.3 * err_euler


def test_dpm2m_first_order_steps_are_euler_and_the_last_step_is_x0():
    sched = uniform(6, 1.0, 3.0)
    x = torch.randn(2, 3, 4)
    v = velocity(x, 1.0)
    first = step("dpm2m", x, v, sched, 0)  # no history: DDIM, which is Euler for flow matching
    torch.testing.assert_close(first.x_next, step("ode", x, v, sched, 0).x_next, rtol=1e-5, atol=1e-5)
    assert first.state.sigma == 1.0 and (first.logp == 0).all()
    last_i = sched.num_steps - 1
    y = torch.randn(2, 3, 4)
    last = step("dpm2m", y, velocity(y, float(sched.sigmas[last_i])), sched, last_i, state=first.state)
    assert torch.equal(last.x_next, last.x0_hat)


def test_dpm2m_rejects_bad_state_and_batched_step_index():
    sched = uniform(6, 1.0, 3.0)
    x = torch.randn(2, 3, 4)
    out = step("dpm2m", x, velocity(x, 1.0), sched, 0)
    nxt = step("dpm2m", out.x_next, velocity(out.x_next, float(sched.sigmas[1])), sched, 1, state=out.state)
    with pytest.raises(ValueError, match="^state"):  # history must come from a higher sigma
        step("dpm2m", x, velocity(x, 0.5), sched, 1, state=nxt.state)
    with pytest.raises(ValueError, match="^i"):
        step("dpm2m", x, velocity(x, 0.5), sched, torch.tensor([1, 1]))
