"""Transition kernels: one denoising step x_i -> x_{i+1}, its law, and its log-prob.

A kernel is registered by name as a *law*: a pure function (x, model_output, schedule, i, *, settings)
-> Law(mean, std, x0_hat, density). Two drivers use it:

    out = step("flow_sde", x, v, sched, i, noise, a=0.7)          # draw x_next ~ N(mean, std^2)
    new = rescore("flow_sde", x, out.x_next, v_new, sched, i, a=0.7)  # logp / mean of that x_next
    ratio = exp(new.logp - out.logp)                               # exactly 1 when v_new == v

Conventions (docs/architecture.md): flow-matching sigma 1 = noise, 0 = data; step i goes sigma_i -> sigma_{i+1}
with dt = sigma_i - sigma_{i+1} > 0; v ~ eps - x0, so x0_hat = x - sigma*v and x1_hat = x + (1-sigma)*v.
logp is the mean over latent dims (flowgrpo.core.gaussian). All maths runs in float32; x_next comes
back in the input dtype and logp is taken of that rounded x_next, so re-scoring the stored state gives
ratio 1 exactly. `i` is an int, or a LongTensor [B] to re-score edges of different steps in one batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from flowgrpo.core.gaussian import gaussian_logprob, mean_sqdist
from flowgrpo.core.registry import Registry

from .schedules import DDIMSchedule, FlowSchedule

KERNELS = Registry("kernel")

# How a law's log-prob is read. "gaussian": log N(x_next; mean, std^2), mean over dims (0 where std is 0:
# a deterministic step carries no policy gradient). "cps": the published CPS surrogate, see `cps`.
# "point": deterministic kernels (ode, dpm2m), logp 0.
DENSITIES = ("gaussian", "cps", "point")


@dataclass(frozen=True)
class DPMState:
    """History a multistep solver carries: the previous step's clean estimate and its sigma."""

    x0_hat: Tensor
    sigma: float


@dataclass(frozen=True)
class Law:
    mean: Tensor  # float32, shape of x
    std: Tensor  # float32, 0-dim or broadcastable [B, 1, ...]; the nominal std
    x0_hat: Tensor  # float32, shape of x
    density: str
    state: DPMState | None = None


@dataclass(frozen=True)
class StepOutput:
    x_next: Tensor  # input dtype
    mean: Tensor  # float32
    std: Tensor  # float32, 0-dim or [B]; nominal std (without noise_scale)
    logp: Tensor  # float32 [B]
    x0_hat: Tensor  # float32
    state: DPMState | None = None  # only for stateful kernels (dpm2m): pass it to the next step


# ---------------------------------------------------------------------------------------------- drivers


def step(
    kernel: str,
    x: Tensor,
    model_output: Tensor,
    schedule: FlowSchedule | DDIMSchedule,
    i: int | Tensor,
    noise: Tensor | None = None,
    *,
    noise_scale: float = 1.0,
    generator: torch.Generator | None = None,
    state: DPMState | None = None,
    **settings: Any,
) -> StepOutput:
    """Draw x_next = mean + noise_scale * std * noise, with logp under the NOMINAL std.

    noise_scale != 1 is BranchGRPO's split noise: the sample is wider than the density its logp is read
    from. This mirrors BranchGRPO (old and new logp use the same formula, so the ratio stays consistent),
    but that logp is not the true sampling density. `noise` defaults to a fresh N(0, I) from `generator`;
    deterministic kernels (ode, dpm2m) draw none and ignore a given one.
    """
    entry = KERNELS.get(kernel)
    _check_inputs(x, i, schedule, model_output=model_output, noise=noise)
    if not noise_scale >= 0:
        raise ValueError(f"noise_scale must be >= 0, got {noise_scale}")
    law = _law(entry, x, model_output, schedule, i, state, settings)
    if law.density == "point":
        if noise_scale != 1.0:
            raise ValueError(f"noise_scale={noise_scale} has no effect on deterministic kernel '{kernel}'")
        x_next = law.mean
    else:
        if noise is None:
            # drawn where the generator lives (a seeded CPU generator gives the same noise on every device)
            where = x.device if generator is None else generator.device
            noise = torch.randn(x.shape, generator=generator, device=where, dtype=torch.float32).to(x.device)
        x_next = ((noise_scale * law.std) * noise.float()).add_(law.mean)  # = mean + that (addition commutes)
    x_next = x_next.to(x.dtype)
    return _output(law, x_next, x_next.detach())


def rescore(
    kernel: str,
    x: Tensor,
    x_next: Tensor,
    model_output: Tensor,
    schedule: FlowSchedule | DDIMSchedule,
    i: int | Tensor,
    *,
    state: DPMState | None = None,
    **settings: Any,
) -> StepOutput:
    """logp and mean of a GIVEN x_next under (possibly new) model outputs; x_next is returned as given.

    Gradients flow through model_output into mean and logp (the PPO ratio and GRPO-Guard's mu_new).
    """
    entry = KERNELS.get(kernel)
    _check_inputs(x, i, schedule, model_output=model_output, x_next=x_next)
    law = _law(entry, x, model_output, schedule, i, state, settings)
    return _output(law, x_next, x_next)


def _law(entry, x, model_output, schedule, i, state, settings) -> Law:
    entry.check_settings(settings, "kernel")
    args = (x.float(), model_output.float(), schedule, i)
    if "state" in entry.requires:
        return entry.fn(*args, state, **settings)
    if state is not None:
        raise ValueError(f"state: kernel '{entry.name}' is not multistep and takes no state")
    return entry.fn(*args, **settings)


def _output(law: Law, x_next: Tensor, scored: Tensor) -> StepOutput:
    std = law.std.flatten() if law.std.dim() else law.std
    return StepOutput(x_next, law.mean, std, _logp(law.density, scored, law.mean, std), law.x0_hat, law.state)


def _logp(density: str, x_next: Tensor, mean: Tensor, std: Tensor) -> Tensor:
    if density == "point":
        return torch.zeros(x_next.shape[0], dtype=torch.float32, device=x_next.device)
    if density == "cps":
        return -mean_sqdist(x_next, mean)
    # A zero std (a = 0, eta = 0, the last CPS step) is a deterministic step: logp 0, not NaN. The safe
    # std keeps NaN out of the unused branch, so gradients through torch.where stay finite.
    positive = std > 0
    if bool(positive.all()):  # the usual case: both torch.where would return their first argument
        return gaussian_logprob(x_next, mean, std)
    logp = gaussian_logprob(x_next, mean, torch.where(positive, std, torch.ones_like(std)))
    return torch.where(positive, logp, torch.zeros_like(logp))


# ------------------------------------------------------------------------------------------- validation


def _check_inputs(x: Tensor, i: int | Tensor, schedule, **like_x: Tensor | None) -> None:
    if not isinstance(x, Tensor) or x.dim() < 2 or not x.is_floating_point():
        raise ValueError(f"x must be a floating tensor [B, ...latent dims], got {_describe(x)}")
    for name, t in like_x.items():
        if t is not None and (not isinstance(t, Tensor) or t.shape != x.shape):
            raise ValueError(f"{name} must have the shape of x {tuple(x.shape)}, got {_describe(t)}")
    if not isinstance(schedule, (FlowSchedule, DDIMSchedule)):
        raise ValueError(f"schedule must be a FlowSchedule or DDIMSchedule, got {type(schedule).__name__}")
    n = schedule.num_steps
    if isinstance(i, Tensor):
        if i.dtype in (torch.bool,) or i.is_floating_point() or i.shape != (x.shape[0],):
            raise ValueError(f"i must be an int or an integer tensor [B={x.shape[0]}], got {_describe(i)}")
        ok = bool(((i >= 0) & (i < n)).all())
    else:
        ok = isinstance(i, int) and not isinstance(i, bool) and 0 <= i < n
    if not ok:
        raise ValueError(f"i must index a step of the schedule (0 <= i < {n}), got {i}")


def _describe(t: Any) -> str:
    return f"shape {tuple(t.shape)} {t.dtype}" if isinstance(t, Tensor) else type(t).__name__


def _at(values: Tensor, i: int | Tensor, x: Tensor) -> Tensor:
    """values[i] in float32: 0-dim for an int i, [B, 1, ...] (broadcasts against x) for a tensor i."""
    v = values.to(device=x.device, dtype=torch.float32)[i.to(x.device) if isinstance(i, Tensor) else i]
    return v.reshape(v.shape + (1,) * (x.dim() - 1)) if v.dim() else v


def _flow(schedule, kernel: str) -> FlowSchedule:
    if not isinstance(schedule, FlowSchedule):
        raise ValueError(f"schedule: kernel '{kernel}' needs a FlowSchedule, got {type(schedule).__name__}")
    return schedule


def _sigmas(schedule, i, x, kernel: str) -> tuple[Tensor, Tensor]:
    s = _flow(schedule, kernel).sigmas
    return _at(s, i, x), _at(s, i + 1, x)


def _require(ok: bool, what: str) -> None:
    if not ok:
        raise ValueError(what)


def _coefficients(schedule, i, x: Tensor, key: tuple, compute) -> tuple:
    """A kernel's coefficients for step i: `compute()` (0-dim tensors for an int i), kept on the schedule per
    kernel, settings, step and device, so a rollout builds them once instead of at every call (at small batch
    sizes the ~20 scalar operations cost more than the latent-sized ones). The same operations give the same
    bits either way. A tensor i (edges of different steps) computes them each time."""
    if isinstance(i, Tensor):
        return compute()
    entry, cache = (key, i, x.device), schedule.coefficients
    found = cache.get(entry)  # one lookup per step on a hit
    if found is None:
        with torch.inference_mode(False):  # built in an inference-mode rollout, used with grad in the update
            found = cache[entry] = compute()
    return found


# ---------------------------------------------------------------------------------------------- kernels
# The kernels write into the latent-sized temporaries they create (`.sub_`, `.mul_`, ...) where the written
# tensor is neither an input nor saved for backward: the same operations in the same order (so the same
# bits and gradients), fewer allocations, which cost more than the arithmetic at small batch sizes.


@KERNELS.register("ode")
def ode(x: Tensor, v: Tensor, schedule: FlowSchedule, i) -> Law:
    """Euler step of the probability-flow ODE: x_next = x - dt*v (diffusers' FlowMatchEuler step)."""

    def coefficients():
        s, s_next = _sigmas(schedule, i, x, "ode")
        return s, s - s_next, torch.zeros((), device=x.device)

    s, dt, zero = _coefficients(schedule, i, x, ("ode",), coefficients)
    return Law(x - dt * v, zero, x - s * v, "point")


@KERNELS.register("flow_sde")
def flow_sde(x: Tensor, v: Tensor, schedule: FlowSchedule, i, *, a: float = 0.7) -> Law:
    """Flow-GRPO SDE: g = a*sqrt(sigma/(1-sigma)), mean = reverse-SDE Euler-Maruyama, std = g*sqrt(dt)."""
    _require(a >= 0, f"a must be >= 0, got {a}")

    def coefficients():
        s, s_next = _sigmas(schedule, i, x, "flow_sde")
        dt = s - s_next
        # At sigma = 1 the denominator uses sigmas[1] instead (Flow-GRPO's guard; numerator stays sigma). Within
        # 1e-4 of 1 too: UniPC's flow grid (Wan) starts at 0.999999, where 1 / (1 - sigma) would blow the noise up.
        s_den = torch.where(s >= 1 - 1e-4, schedule.sigmas[1].to(s), s)
        g2 = a**2 * s / (1 - s_den)
        return s, dt, 1 - g2 / (2 * s) * dt, 1 + g2 * (1 - s) / (2 * s), torch.sqrt(g2 * dt)

    s, dt, x_coef, v_coef, std = _coefficients(schedule, i, x, ("flow_sde", a), coefficients)
    mean = (x * x_coef).sub_((v * v_coef).mul_(dt))
    return Law(mean, std, x - s * v, "gaussian")


@KERNELS.register("wan_sde")
def wan_sde(x: Tensor, v: Tensor, schedule: FlowSchedule, i) -> Law:
    """Flow-GRPO's Wan 2.1 SDE: flow_sde's drift with a noise level linear in sigma, and no setting.

    std_dev_t = sigma_min + (sigma_1 - sigma_min) * sigma, with sigma_1 = sigmas[1] (the grid's SECOND sigma) and
    sigma_min = sigmas[-1] of the schedule given; mean = x (1 - std_dev_t^2 dt / (2 sigma)) - v (1 + std_dev_t^2
    (1 - sigma) / (2 sigma)) dt; std = std_dev_t sqrt(dt). From `sde_step_with_logprob` in
    flow_grpo/diffusers_patch/wan_pipeline_with_logprob.py, read in the fork zhtmike/flow_grpo@def7b84 (not stored
    for yifan123/flow_grpo, whose scripts/train_wan2_1.py@32b48fd calls it with the same signature).
    """

    def coefficients():
        sigmas = _flow(schedule, "wan_sde").sigmas
        s, s_next = _sigmas(schedule, i, x, "wan_sde")
        dt = s - s_next
        s_1, s_min = sigmas[1].to(s), sigmas[-1].to(s)
        # no guard at sigma = 1 is needed: the noise level is bounded and sigma > 0 on every step
        g2 = (s_min + (s_1 - s_min) * s) ** 2
        return s, dt, 1 - g2 / (2 * s) * dt, 1 + g2 * (1 - s) / (2 * s), torch.sqrt(g2 * dt)

    s, dt, x_coef, v_coef, std = _coefficients(schedule, i, x, ("wan_sde",), coefficients)
    mean = (x * x_coef).sub_((v * v_coef).mul_(dt))
    return Law(mean, std, x - s * v, "gaussian")


@KERNELS.register("dance_sde")
def dance_sde(x: Tensor, v: Tensor, schedule: FlowSchedule, i, *, eta: float = 0.3) -> Law:
    """DanceGRPO SDE: the same reverse-SDE drift with a constant diffusion g = eta; std = eta*sqrt(dt)."""
    _require(eta >= 0, f"eta must be >= 0, got {eta}")

    def coefficients():
        s, s_next = _sigmas(schedule, i, x, "dance_sde")
        dt = s - s_next
        return s, 1 - s, s**2, dt, eta * torch.sqrt(dt)

    s, one_minus_s, s_squared, dt, std = _coefficients(schedule, i, x, ("dance_sde", eta), coefficients)
    x0 = x - s * v
    score = (x - one_minus_s * x0).neg_().div_(s_squared)
    mean = (x - dt * v).add_((0.5 * eta**2 * score).mul_(dt))
    return Law(mean, std, x0, "gaussian")


@KERNELS.register("cps")
def cps(x: Tensor, v: Tensor, schedule: FlowSchedule, i, *, a: float = 0.8) -> Law:
    """Coefficient-preserving sampling: std = sigma_next*sin(a*pi/2), noise coefficients sum to sigma_next.

    NOTE the log-prob is the published SURROGATE -mean(|x_next - mean|^2): every constant of the Gaussian
    is dropped, including 1/(2 std^2). It equals 2*std^2 times the Gaussian log-ratio's quadratic part,
    so PPO clip ranges read at another scale (CPS configs use 1e-5). At the last step std is 0.
    """
    _require(0 <= a <= 1, f"a must be in [0, 1], got {a}")

    def coefficients():
        s, s_next = _sigmas(schedule, i, x, "cps")
        std = s_next * math.sin(a * math.pi / 2)
        return s, 1 - s, 1 - s_next, torch.sqrt((s_next**2 - std**2).clamp(min=0)), std

    s, one_minus_s, x0_coef, x1_coef, std = _coefficients(schedule, i, x, ("cps", a), coefficients)
    x0, x1 = x - s * v, x + one_minus_s * v
    mean = (x0 * x0_coef).add_(x1.mul_(x1_coef))
    return Law(mean, std, x0, "cps")


@KERNELS.register("dpm2m", requires=("state",))
def dpm2m(x: Tensor, v: Tensor, schedule: FlowSchedule, i, state: DPMState | None = None) -> Law:
    """DPM-Solver++(2M) in x0-space for flow matching (alpha = 1 - sigma), for untrained steps.

    With lambda = log(alpha/sigma), h = lambda_next - lambda_i and r = h_prev/h:
        x_next = (sigma_next/sigma) x - alpha_next (e^-h - 1) (x0 + (x0 - x0_prev) / (2r)).
    First order (exact DDIM) without usable history, and at the final step to sigma = 0, where the
    second-order term diverges (diffusers' lower_order_final). Pass the returned state to the next step
    (or DPMState(out.x0_hat, sigma_i) built from any flow kernel's output). Matches diffusers'
    DPMSolverMultistepScheduler(dpmsolver++, order 2, flow_prediction) on the same grid.
    Use it on uniform-in-t grids (MixGRPO-Flash rebuilds its tail as shift(linspace(t, 0, n))): on the
    SD3 "diffusers" grid the last nonzero sigma is ~0.001-0.009, the step onto it is huge in lambda, and
    the 2M extrapolation overshoots there (as diffusers' own solver does).
    """
    _require(isinstance(i, int), f"i: dpm2m needs an int step index, got {_describe(i)}")
    sig = _flow(schedule, "dpm2m").sigmas
    s, t = float(sig[i]), float(sig[i + 1])
    x0 = x - s * v
    if t == 0:
        mean = x0
    else:
        d = x0
        # History at sigma = 1 has lambda = -inf, so r is infinite and the correction vanishes.
        if state is not None and state.sigma < 1:
            _require(state.sigma > s, f"state: sigma {state.sigma} must be above the current sigma {s}")
            _require(state.x0_hat.shape == x.shape, f"state: x0_hat shape {tuple(state.x0_hat.shape)} != x")
            lam = lambda q: math.log((1 - q) / q)  # noqa: E731
            r = (lam(s) - lam(state.sigma)) / (lam(t) - lam(s))
            d = x0 + (x0 - state.x0_hat.float()) / (2 * r)
        exp_neg_h = t * (1 - s) / (s * (1 - t))  # e^-h, 0 when sigma = 1
        mean = (t / s) * x - (1 - t) * (exp_neg_h - 1) * d
    return Law(mean, torch.zeros((), device=x.device), x0, "point", DPMState(x0, s))


@KERNELS.register("ddim")
def ddim(x: Tensor, model_output: Tensor, schedule: DDIMSchedule, i, *, eta: float = 1.0) -> Law:
    """DDIM step with eta-scaled noise for an epsilon- (or v-) prediction diffusion model (SD1.5 style).

    std = eta*sqrt((1-ab_prev)/(1-ab) * (1 - ab/ab_prev)); mean = sqrt(ab_prev)*x0 + sqrt(1-ab_prev-std^2)*eps,
    as diffusers' DDIMScheduler.step (no clipping, no thresholding).
    """
    _require(0 <= eta <= 1, f"eta must be in [0, 1], got {eta}")
    if not isinstance(schedule, DDIMSchedule):
        raise ValueError(f"schedule: kernel 'ddim' needs a DDIMSchedule, got {type(schedule).__name__}")

    def coefficients():
        ab, ab_prev = _at(schedule.alpha_bar, i, x), _at(schedule.alpha_bar_prev, i, x)
        std = eta * ((1 - ab_prev) / (1 - ab) * (1 - ab / ab_prev)).sqrt()
        return ab.sqrt(), (1 - ab).sqrt(), ab_prev.sqrt(), (1 - ab_prev - std**2).sqrt(), std

    root_ab, root_rest, root_ab_prev, eps_coef, std = _coefficients(schedule, i, x, ("ddim", eta), coefficients)
    if schedule.prediction_type == "epsilon":
        eps = model_output
        x0 = (x - root_rest * eps).div_(root_ab)
    else:  # v_prediction
        x0 = root_ab * x - root_rest * model_output
        eps = root_ab * model_output + root_rest * x
    mean = (root_ab_prev * x0).add_(eps_coef * eps)
    return Law(mean, std, x0, "gaussian")
