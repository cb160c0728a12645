"""Noise schedules for the transition kernels, produced by diffusers' own schedulers.

The numbers come from `FlowMatchEulerDiscreteScheduler` / `DDIMScheduler` built from a config dict
(the model's `scheduler_config.json`, or the defaults below), so a rollout here walks exactly the
grid the diffusers pipeline walks. diffusers is imported only when a schedule is built.

    sched = flow_schedule(10, shift=3.0)                 # SD3-style: sigmas [11], last 0
    sched = flow_schedule(28, config=flux_cfg, image_seq_len=4096, spacing="uniform")   # FLUX
    sched = ddim_schedule(50)                            # SD1.5 DDIM, epsilon prediction
    sched = time_shift_schedule(16, shift=3.0)           # DanceGRPO / MixGRPO / BranchGRPO / Pref-GRPO

A sampler picks its grid by name from SIGMA_GRIDS (`sampler.schedule`): "scheduler" (the model's
diffusers scheduler decides, the default) or "time_shift" (a fixed shift over a uniform grid).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

import torch
from torch import Tensor

from flowgrpo.core.registry import Registry

# How the unshifted sigmas are spaced before the shift is applied (diffusers appends the final 0):
#   "diffusers": what `set_timesteps(n)` and the SD3 pipeline use: linspace(1, sigma_min, n) where
#                sigma_min = shift(1/num_train_timesteps) is the scheduler's last *training* sigma, so
#                the low end is shifted twice (e.g. 0.0089 rather than 0.003 for shift 3);
#   "uniform":   linspace(1, 1/n, n), what the FLUX / Qwen-Image pipelines and DanceGRPO/MixGRPO use
#                (DanceGRPO's linspace(1, 0, n+1) without its last point).
FLOW_SPACINGS = ("diffusers", "uniform")

# SD1.5's DDIM setup. clip_sample is off as in SD1.5's scheduler_config.json; the kernel has no
# clipping, so a config that turns it on is refused rather than silently ignored.
SD15_DDIM_CONFIG: dict[str, Any] = {
    "num_train_timesteps": 1000,
    "beta_start": 0.00085,
    "beta_end": 0.012,
    "beta_schedule": "scaled_linear",
    "steps_offset": 1,
    "set_alpha_to_one": False,
    "clip_sample": False,
    "prediction_type": "epsilon",
    "timestep_spacing": "leading",
}
DDIM_PREDICTION_TYPES = ("epsilon", "v_prediction")


@dataclass(frozen=True)
class FlowSchedule:
    """Flow-matching grid: step i moves sigma_i -> sigma_{i+1} (sigma 1 = noise, 0 = data)."""

    sigmas: Tensor  # [T+1] float32, strictly decreasing, in [0, 1]
    timesteps: Tensor  # [T] float32, what the denoiser is conditioned on (sigma * num_train_timesteps)
    # [T] the flow time the denoiser sees when it is not sigmas[:-1] (FastVideo trainers round it down
    # to int(1000 * sigma) / 1000); the kernels always use the exact sigmas.
    model_sigmas: Optional[Tensor] = None
    # A kernel's per-step coefficients, built once (flowgrpo's pipelines.steps fills it; never compared).
    coefficients: dict = field(default_factory=dict, init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        s = self.sigmas
        if s.dim() != 1 or s.numel() < 2:
            raise ValueError(f"sigmas must be 1-D with at least 2 values, got shape {tuple(s.shape)}")
        if not bool(((s >= 0) & (s <= 1)).all()) or not bool((s[1:] < s[:-1]).all()):
            raise ValueError(f"sigmas must lie in [0, 1] and strictly decrease, got {s.tolist()}")
        if self.timesteps.shape != (s.numel() - 1,):
            raise ValueError(f"timesteps must have shape [{s.numel() - 1}], got {tuple(self.timesteps.shape)}")
        if self.model_sigmas is not None and self.model_sigmas.shape != (s.numel() - 1,):
            raise ValueError(f"model_sigmas must have shape [{s.numel() - 1}], got {tuple(self.model_sigmas.shape)}")

    @property
    def num_steps(self) -> int:
        return self.sigmas.numel() - 1

    @classmethod
    def from_sigmas(cls, sigmas: Any, num_train_timesteps: int = 1000) -> "FlowSchedule":
        """A custom grid (e.g. MixGRPO-Flash's compressed tail); timesteps follow diffusers' sigma*1000."""
        s = torch.as_tensor(sigmas, dtype=torch.float32).flatten()
        return cls(s, s[:-1] * num_train_timesteps)


@dataclass(frozen=True)
class DDIMSchedule:
    """DDIM grid for a diffusion model: step i moves from timesteps[i] to the step diffusers targets."""

    timesteps: Tensor  # [T] int64, descending
    alpha_bar: Tensor  # [T] float32, alphas_cumprod at timesteps[i]
    alpha_bar_prev: Tensor  # [T] float32, alphas_cumprod at the target (final_alpha_cumprod past 0)
    prediction_type: str = "epsilon"
    coefficients: dict = field(default_factory=dict, init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        t = self.timesteps.numel()
        if self.timesteps.dim() != 1 or t < 1:
            raise ValueError(f"timesteps must be 1-D and non-empty, got shape {tuple(self.timesteps.shape)}")
        for name in ("alpha_bar", "alpha_bar_prev"):
            if getattr(self, name).shape != (t,):
                raise ValueError(f"{name} must have shape [{t}], got {tuple(getattr(self, name).shape)}")
        if self.prediction_type not in DDIM_PREDICTION_TYPES:
            raise ValueError(f"prediction_type must be one of {DDIM_PREDICTION_TYPES}, got '{self.prediction_type}'")

    @property
    def num_steps(self) -> int:
        return self.timesteps.numel()


def flux_mu(
    image_seq_len: int,
    *,
    base_seq_len: int = 256,
    max_seq_len: int = 4096,
    base_shift: float = 0.5,
    max_shift: float = 1.15,
) -> float:
    """FLUX's resolution-dependent shift: mu grows linearly with the number of latent tokens."""
    slope = (max_shift - base_shift) / (max_seq_len - base_seq_len)
    return base_shift + slope * (image_seq_len - base_seq_len)


def flow_scheduler(config: Mapping[str, Any] | None = None, **overrides: Any):
    """diffusers' FlowMatchEulerDiscreteScheduler from a config dict (unknown keys are dropped by diffusers)."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler.from_config({**dict(config or {}), **overrides})


def flow_schedule(
    num_steps: int,
    *,
    shift: float | None = None,
    spacing: str = "diffusers",
    mu: float | None = None,
    image_seq_len: int | None = None,
    config: Mapping[str, Any] | None = None,
) -> FlowSchedule:
    """Sigmas for `num_steps` steps: sigma' = s*sigma/(1+(s-1)*sigma), then a final 0.

    `shift` overrides the config's shift. With `use_dynamic_shifting` in the config (FLUX), pass `mu`
    or `image_seq_len` (mu then comes from the config's base/max shift and sequence lengths).
    """
    if not isinstance(num_steps, int) or num_steps < 1:
        raise ValueError(f"num_steps must be a positive int, got {num_steps!r}")
    if spacing not in FLOW_SPACINGS:
        raise ValueError(f"spacing must be one of {FLOW_SPACINGS}, got '{spacing}'")
    cfg = dict(config or {})
    if shift is not None:
        if shift <= 0:
            raise ValueError(f"shift must be > 0, got {shift}")
        cfg["shift"] = float(shift)
    dynamic = bool(cfg.get("use_dynamic_shifting", False))
    if mu is not None and image_seq_len is not None:
        raise ValueError("pass either mu or image_seq_len, not both")
    if image_seq_len is not None:
        mu = flux_mu(
            image_seq_len,
            base_seq_len=cfg.get("base_image_seq_len", 256),
            max_seq_len=cfg.get("max_image_seq_len", 4096),
            base_shift=cfg.get("base_shift", 0.5),
            max_shift=cfg.get("max_shift", 1.15),
        )
    if dynamic and mu is None:
        raise ValueError("the config uses dynamic shifting: pass mu or image_seq_len")
    if dynamic and shift is not None:
        raise ValueError("shift is unused with use_dynamic_shifting=True: pass mu or image_seq_len instead")
    if not dynamic and mu is not None:
        raise ValueError("mu / image_seq_len need use_dynamic_shifting=True in the config (else use shift)")

    sched = flow_scheduler(cfg)
    base = None
    if spacing == "uniform":
        base = torch.linspace(1.0, 1.0 / num_steps, num_steps).tolist()
    sched.set_timesteps(num_steps, sigmas=base, mu=mu)
    return FlowSchedule(sched.sigmas.float().cpu(), sched.timesteps.float().cpu())


def ddim_scheduler(config: Mapping[str, Any] | None = None, **overrides: Any):
    """diffusers' DDIMScheduler from a config dict; SD1.5's settings fill what the dict leaves out."""
    from diffusers import DDIMScheduler

    return DDIMScheduler.from_config({**SD15_DDIM_CONFIG, **dict(config or {}), **overrides})


def ddim_schedule(num_steps: int, *, config: Mapping[str, Any] | None = None) -> DDIMSchedule:
    """alpha-bar pairs (current, target) for each of `num_steps` DDIM steps, as DDIMScheduler.step uses them."""
    if not isinstance(num_steps, int) or num_steps < 1:
        raise ValueError(f"num_steps must be a positive int, got {num_steps!r}")
    sched = ddim_scheduler(config)
    c = sched.config
    if c.clip_sample or c.thresholding:
        raise ValueError("clip_sample / thresholding are not supported by the ddim kernel; set them False")
    if c.prediction_type not in DDIM_PREDICTION_TYPES:
        raise ValueError(f"prediction_type must be one of {DDIM_PREDICTION_TYPES}, got '{c.prediction_type}'")
    sched.set_timesteps(num_steps)
    t = sched.timesteps.long().cpu()
    # DDIMScheduler.step targets t - num_train_timesteps // num_inference_steps, and uses
    # final_alpha_cumprod once that falls below 0 (diffusers has no public accessor for the pair).
    prev = t - c.num_train_timesteps // num_steps
    acp = sched.alphas_cumprod.float()
    alpha_bar_prev = torch.where(prev >= 0, acp[prev.clamp(min=0)], sched.final_alpha_cumprod.float())
    return DDIMSchedule(t, acp[t], alpha_bar_prev, c.prediction_type)


# ------------------------------------------------------------------------------------- named grids

SIGMA_GRIDS = Registry("sigma grid")


@SIGMA_GRIDS.register("scheduler")
def scheduler_grid() -> None:
    """The model's own diffusers scheduler (FLUX: dynamic shift from the token count; SD3: `sampler.shift`)."""
    return None  # a marker: the sampler builds this grid from the adapter's scheduler config


@SIGMA_GRIDS.register("time_shift")
def time_shift_schedule(num_steps: int, *, shift: float = 3.0, integer_timesteps: bool = False) -> FlowSchedule:
    """sigma = s*t / (1 + (s-1)*t) over t = linspace(1, 0, num_steps + 1): a static shift, final sigma 0.

    DanceGRPO's `sd3_time_shift` grid (`--shift 3`), used as is by MixGRPO, BranchGRPO and Pref-GRPO
    for FLUX instead of FLUX's resolution-dependent dynamic shift. Computed in float32 with the same
    operations as theirs, so the grid is theirs to the bit. integer_timesteps: the denoiser is
    conditioned on int(1000 * sigma) / 1000, as those trainers pass `timestep = int(sigma * 1000)`
    (the kernels still use the exact sigmas).
    """
    if not isinstance(num_steps, int) or num_steps < 1:
        raise ValueError(f"num_steps must be a positive int, got {num_steps!r}")
    if not shift > 0:
        raise ValueError(f"shift must be > 0, got {shift}")
    t = torch.linspace(1.0, 0.0, num_steps + 1, dtype=torch.float32)
    sigmas = (shift * t) / (1 + (shift - 1) * t)
    schedule = FlowSchedule.from_sigmas(sigmas)
    if not integer_timesteps:
        return schedule
    whole = (sigmas[:-1] * 1000).long()  # int() truncation, as the published trainers
    return FlowSchedule(schedule.sigmas, whole.float(), whole.float() / 1000)


def compress_tail(
    schedule: FlowSchedule, start: int, points: int, *, shift: float, integer_timesteps: bool = False
) -> FlowSchedule:
    """MixGRPO-Flash's rebuilt tail of a time_shift grid: keep sigmas[:start], then `points` values
    s*u / (1 + (s-1)*u) over u = linspace(t_start, 0, points), t_start the unshifted time of sigmas[start].

    The grid goes from sigma_start to 0 in points - 1 steps instead of num_steps - start.
    """
    n = schedule.num_steps
    if not 0 < start < n or points < 2:
        raise ValueError(f"compress_tail: need 0 < start < {n} and points >= 2, got start={start}, points={points}")
    t_start = float(torch.linspace(1.0, 0.0, n + 1, dtype=torch.float32)[start])
    u = torch.linspace(t_start, 0.0, points, dtype=torch.float32)
    sigmas = torch.cat([schedule.sigmas[:start], (shift * u) / (1 + (shift - 1) * u)])
    out = FlowSchedule.from_sigmas(sigmas)
    if not integer_timesteps:
        return out
    whole = (sigmas[:-1] * 1000).long()
    return FlowSchedule(out.sigmas, whole.float(), whole.float() / 1000)
