"""Sigma / alpha-bar schedules agree with diffusers' schedulers and with the closed-form shift."""

import math

import pytest
import torch
from diffusers import DDIMScheduler, FlowMatchEulerDiscreteScheduler

from pipelines.schedules import SD15_DDIM_CONFIG, FlowSchedule, ddim_schedule, flow_schedule, flux_mu

FLUX_CONFIG = {
    "shift": 3.0,
    "use_dynamic_shifting": True,
    "base_shift": 0.5,
    "max_shift": 1.15,
    "base_image_seq_len": 256,
    "max_image_seq_len": 4096,
}


def _shift(sig: torch.Tensor, s: float) -> torch.Tensor:
    return s * sig / (1 + (s - 1) * sig)


@pytest.mark.parametrize("shift", [1.0, 3.0, 5.0])
@pytest.mark.parametrize("n", [1, 10, 28])
def test_flow_schedule_matches_diffusers_set_timesteps(shift, n):
    ref = FlowMatchEulerDiscreteScheduler(shift=shift)
    ref.set_timesteps(n)
    got = flow_schedule(n, shift=shift)
    assert torch.equal(got.sigmas, ref.sigmas)
    assert torch.equal(got.timesteps, ref.timesteps)
    assert got.num_steps == n and got.sigmas.dtype == torch.float32


@pytest.mark.parametrize("spacing", ["diffusers", "uniform"])
@pytest.mark.parametrize("shift", [1.0, 3.0])
def test_flow_schedule_is_the_shift_formula_ending_at_zero(spacing, shift):
    n = 10
    # diffusers spaces down to its last training sigma, which is already shifted
    low = _shift(torch.tensor(1 / 1000, dtype=torch.float64), shift) if spacing == "diffusers" else 1 / n
    base = torch.linspace(1.0, float(low), n, dtype=torch.float64)
    got = flow_schedule(n, shift=shift, spacing=spacing).sigmas.double()
    assert got[0] == 1.0 and got[-1] == 0.0
    torch.testing.assert_close(got[:-1], _shift(base, shift), atol=1e-6, rtol=0)


def test_uniform_spacing_is_dancegrpo_linspace_to_zero():
    # DanceGRPO / MixGRPO: shift(linspace(1, 0, n+1)); its last point shifts to 0.
    want = _shift(torch.linspace(1, 0, 21, dtype=torch.float64), 3.0)
    torch.testing.assert_close(flow_schedule(20, shift=3.0, spacing="uniform").sigmas.double(), want, atol=1e-6, rtol=0)


def test_flux_mu_matches_diffusers_calculate_shift():
    from diffusers.pipelines.flux.pipeline_flux import calculate_shift

    for seq in (256, 1024, 4096, 6000):
        assert flux_mu(seq) == pytest.approx(calculate_shift(seq), abs=1e-12)


def test_dynamic_shift_matches_flux_pipeline_grid():
    n, seq = 28, 1024
    mu = flux_mu(seq)
    ref = FlowMatchEulerDiscreteScheduler.from_config(FLUX_CONFIG)
    ref.set_timesteps(n, sigmas=torch.linspace(1.0, 1 / n, n).tolist(), mu=mu)
    got = flow_schedule(n, config=FLUX_CONFIG, image_seq_len=seq, spacing="uniform")
    assert torch.equal(got.sigmas, ref.sigmas)
    # independent form of the exponential time shift: e^mu / (e^mu + 1/t - 1)
    t = torch.linspace(1.0, 1 / n, n, dtype=torch.float64)
    want = math.exp(mu) / (math.exp(mu) + (1 / t - 1))
    torch.testing.assert_close(got.sigmas[:-1].double(), want, atol=1e-6, rtol=0)
    assert torch.equal(flow_schedule(n, config=FLUX_CONFIG, mu=mu, spacing="uniform").sigmas, got.sigmas)


def test_flow_schedule_rejects_bad_settings():
    with pytest.raises(ValueError, match="mu or image_seq_len"):
        flow_schedule(10, config=FLUX_CONFIG)
    with pytest.raises(ValueError, match="shift is unused"):
        flow_schedule(10, config=FLUX_CONFIG, mu=1.0, shift=3.0)
    with pytest.raises(ValueError, match="use_dynamic_shifting"):
        flow_schedule(10, shift=3.0, mu=1.0)
    with pytest.raises(ValueError, match="spacing"):
        flow_schedule(10, spacing="karras")
    with pytest.raises(ValueError, match="num_steps"):
        flow_schedule(0)
    with pytest.raises(ValueError, match="shift"):
        flow_schedule(10, shift=0.0)


def test_flow_schedule_from_sigmas_validates():
    s = FlowSchedule.from_sigmas([0.6, 0.3, 0.0])
    assert s.num_steps == 2 and torch.allclose(s.timesteps, torch.tensor([600.0, 300.0]))
    with pytest.raises(ValueError, match="strictly decrease"):
        FlowSchedule.from_sigmas([0.3, 0.6, 0.0])
    with pytest.raises(ValueError, match="strictly decrease"):
        FlowSchedule.from_sigmas([1.5, 0.0])
    with pytest.raises(ValueError, match="at least 2"):
        FlowSchedule.from_sigmas([0.5])


@pytest.mark.parametrize("n", [1, 10, 50])
def test_ddim_schedule_matches_diffusers(n):
    ref = DDIMScheduler(**SD15_DDIM_CONFIG)
    ref.set_timesteps(n)
    got = ddim_schedule(n)
    assert torch.equal(got.timesteps, ref.timesteps.long())
    assert torch.equal(got.alpha_bar, ref.alphas_cumprod[ref.timesteps])
    # set_alpha_to_one=False: the last step lands on alphas_cumprod[0], not 1
    assert got.alpha_bar_prev[-1] == ref.alphas_cumprod[0] < 1
    # "leading" spacing with steps_offset=1: each step targets the next grid timestep
    assert torch.equal(got.alpha_bar_prev[:-1], got.alpha_bar[1:])
    assert got.timesteps[-1] == 1 and got.prediction_type == "epsilon"


def test_ddim_schedule_rejects_unsupported_config():
    with pytest.raises(ValueError, match="clip_sample"):
        ddim_schedule(10, config={"clip_sample": True})
    with pytest.raises(ValueError, match="prediction_type"):
        ddim_schedule(10, config={"prediction_type": "sample"})
