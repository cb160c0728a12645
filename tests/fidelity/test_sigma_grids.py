"""The FLUX GRPO papers' sigma grid against the published formula, in float64.

DanceGRPO (fastvideo/train_grpo_flux.py), MixGRPO, BranchGRPO and Pref-GRPO all build
    sigma_schedule = sd3_time_shift(shift, linspace(1, 0, n + 1)),  sd3_time_shift(s, t) = s t / (1 + (s - 1) t)
with --shift 3, and condition the transformer on int(sigma * 1000) / 1000.
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

FLUX_SCHEDULER = {
    "base_image_seq_len": 256,
    "base_shift": 0.5,
    "max_image_seq_len": 4096,
    "max_shift": 1.15,
    "num_train_timesteps": 1000,
    "shift": 3.0,
    "use_dynamic_shifting": True,
}


def published_grid(n: int, shift: float) -> np.ndarray:
    """sd3_time_shift over linspace(1, 0, n + 1), in float64."""
    t = np.array([1 - k / n for k in range(n + 1)], dtype=np.float64)
    return shift * t / (1 + (shift - 1) * t)


@pytest.mark.parametrize("n", [16, 20, 25])
@pytest.mark.parametrize("shift", [3.0, 5.0])
def test_time_shift_grid_is_the_published_formula(n, shift):
    ours = time_shift_schedule(n, shift=shift)
    ref = published_grid(n, shift)
    got = ours.sigmas.double().numpy()
    assert got.shape == (n + 1,) and ours.sigmas.dtype == torch.float32
    np.testing.assert_allclose(got, ref, rtol=0, atol=3e-7)  # float32 rounding of values in [0, 1]
    assert got[0] == 1.0 and got[-1] == 0.0
    np.testing.assert_allclose(ours.timesteps.double().numpy(), ref[:-1] * 1000, rtol=1e-6)
    assert ours.model_sigmas is None  # the model sees sigma itself unless integer_timesteps


@pytest.mark.parametrize("n, last", [(16, 1 / 6), (20, 3 / 22), (25, 1 / 9)])
def test_last_nonzero_sigma_of_the_flux_recipes(n, last):
    """The published FLUX runs: on their 16 / 20 / 25-step grids the last nonzero sigma is 0.11-0.17 (3 / (n + 2)).

    FLUX's own dynamic-shift grid (diffusers, 512 px) ends near 0.002 and differs by more than 0.15.
    """
    sig = time_shift_schedule(n, shift=3.0).sigmas.double().numpy()
    assert sig[-2] == pytest.approx(last, abs=1e-7) and 0.11 <= sig[-2] <= 0.17
    dynamic = flow_schedule(n, image_seq_len=(512 // 16) ** 2, config=FLUX_SCHEDULER).sigmas.double().numpy()
    assert dynamic[-2] < 0.01
    assert np.abs(sig - dynamic).max() > 0.15


@pytest.mark.parametrize("n", [16, 20, 25])
def test_integer_timesteps_are_int_of_1000_sigma(n):
    ours = time_shift_schedule(n, shift=3.0, integer_timesteps=True)
    ref = published_grid(n, 3.0)[:-1] * 1000
    got = ours.model_sigmas.double().numpy() * 1000
    floor = np.floor(ref)
    # int() of a float32 sigma: where 1000 sigma is (nearly) an integer, rounding may land either side
    near = np.abs(ref - np.round(ref)) < 1e-3
    ok = np.isclose(got, floor, atol=1e-3) | (near & np.isclose(got, np.round(ref) - 1, atol=1e-3))
    ok |= near & np.isclose(got, np.round(ref), atol=1e-3)
    assert ok.all(), (got, ref)
    assert got[0] == pytest.approx(1000.0)
    np.testing.assert_allclose(ours.sigmas.double().numpy(), published_grid(n, 3.0), atol=3e-7)  # kernels: exact


class RecordingToy(ToyAdapter):
    def __init__(self):
        super().__init__()
        self.times: list[float] = []

    def model_output(self, latents, t, embeds, guidance_scale, cfg_mode="full"):
        self.times += t.double().tolist()
        return super().model_output(latents, t, embeds, guidance_scale, cfg_mode)


def test_the_sampler_walks_the_named_grid_and_conditions_on_the_integer_times():
    adapter = RecordingToy()
    cfg = SamplerConfig(
        num_steps=16,
        schedule={"name": "time_shift", "shift": 3.0, "integer_timesteps": True},
        cfg_mode="none",
        height=16,
        width=16,
    )
    tree = Sampler(cfg).run(adapter, ["a cat"], build_plan("full_sde", 16), 2, torch.Generator().manual_seed(0))
    np.testing.assert_allclose(tree.schedule.sigmas.double().numpy(), published_grid(16, 3.0), atol=3e-7)
    seen = sorted(set(round(t * 1000, 3) for t in adapter.times), reverse=True)
    expected = [math.floor(round(s * 1000, 4)) for s in published_grid(16, 3.0)[:-1]]
    assert seen == pytest.approx(expected, abs=1e-3)


def test_schedule_config_is_strict():
    assert SamplerConfig().schedule.name == "scheduler"
    with pytest.raises(ValueError, match="shift applies to the 'scheduler' grid"):
        SamplerConfig(schedule={"name": "time_shift", "shift": 3.0}, shift=3.0)
    with pytest.raises(ValueError, match="unknown sigma grid 'time_shit'"):
        SamplerConfig(schedule={"name": "time_shit"})
    with pytest.raises(ValueError, match="has no setting 'mu'"):
        SamplerConfig(schedule={"name": "time_shift", "mu": 1.0})
    eps_model = ToyAdapter(prediction="epsilon")
    sampler = Sampler(SamplerConfig(num_steps=4, schedule={"name": "time_shift"}, sde_kernel={"name": "ddim"}))
    with pytest.raises(ValueError, match="epsilon-prediction model"):
        sampler.schedule(eps_model)


def published_flash_grid(n: int, shift: float, last_sde: int, ratio: float) -> np.ndarray:
    """MixGRPO run_sample_step, dpm_apply_strategy "post": the grid after the last SDE step, rebuilt."""
    full = published_grid(n, shift)
    num_post = int(max((n + 1 - 1 - last_sde) * ratio, 1))  # sigma_schedule.size(0) = n + 1
    t_post = 1 - (last_sde + 1) / n
    u = np.array([t_post * (1 - k / (num_post - 1)) for k in range(num_post)])
    return np.concatenate([full[: last_sde + 1], shift * u / (1 + (shift - 1) * u)])


@pytest.mark.parametrize("size, start, ratio", [(4, 0, 0.2), (4, 0, 0.4), (4, 5, 0.4), (2, 10, 0.5)])
def test_compressed_tail_is_mixgrpo_flashs_grid(size, start, ratio):
    n = 25
    adapter = RecordingToy()
    cfg = SamplerConfig(
        num_steps=n, schedule={"name": "time_shift", "shift": 3.0}, cfg_mode="none", height=16, width=16
    )
    plan = build_plan(
        "window",
        n,
        0,
        schedule="fixed",
        start=start,
        size=size,
        post_solver="dpm2m",
        post_compress=ratio,
        share_prefix=False,
    )
    ref = published_flash_grid(n, 3.0, start + size - 1, ratio)
    assert plan.num_steps == len(ref) - 1 < n and plan.grid_steps == n
    assert [s.sde for s in plan.steps] == [start <= i < start + size for i in range(plan.num_steps)]
    tree = Sampler(cfg).run(adapter, ["a cat"], plan, 2, torch.Generator().manual_seed(0))
    np.testing.assert_allclose(tree.schedule.sigmas.double().numpy(), ref, rtol=0, atol=3e-7)
    assert tree.num_steps == plan.num_steps and int(tree.edge_step.max()) == plan.num_steps - 1
    assert sorted(set(adapter.times), reverse=True) == pytest.approx(list(ref[:-1]), abs=3e-7)


def test_compressed_tail_needs_the_time_shift_grid_and_a_tail():
    from flowgrpo.t2i.config import T2IConfig

    with pytest.raises(ValueError, match="post_compress rebuilds the tail of the time_shift grid"):
        T2IConfig(
            model={"tiny": True}, sampler={"num_steps": 25}, plan={"name": "window", "size": 4, "post_compress": 0.4}
        )
    with pytest.raises(ValueError, match="would not reach sigma 0"):
        build_plan("window", 25, 0, schedule="fixed", start=20, size=4, post_compress=0.4)
