"""DiffusionNFT with CFG rollouts and Flow-Factory's discrete training times (flowgrpo/t2i/nft.py): the time draw
against a float64 re-derivation of TimeSampler.discrete (X-GenGroup/Flow-Factory @ a0b2bc5,
utils/noise_schedule.py), the first pass of a tiny CFG run against a float64 re-derivation of the guided
velocity and the objective, its forward counts, and the refusals that remain."""

from __future__ import annotations

import math

import pytest
import torch

from flowgrpo.t2i import load_t2i_config
from flowgrpo.t2i.nft import NFTMethod, discrete_times

from .learning_runs import RECIPES_DIR


def _ff_discrete(u: list[float], ts: list[float], count: int, fraction: float) -> list[int]:
    """TimeSampler.discrete (include_init=True, force_init=False) on scheduler timesteps `ts`, uniforms `u`."""
    valid = [i for i, t in enumerate(ts) if 1000 * (1 - fraction) - 1e-3 <= t <= 1000 + 1e-3]
    lo, hi = min(valid), max(valid)
    b = [lo + (hi - lo) * k / count for k in range(count + 1)]  # linspace(lo, hi, count + 1)
    low, up = [math.floor(x) for x in b[:-1]], [math.floor(x) for x in b[1:]]
    return [min(max(lw + math.floor(x * (h - lw)), 0), len(ts) - 1) for x, lw, h in zip(u, low, up)]


@pytest.mark.parametrize("steps, count, fraction", [(8, 2, 0.5), (14, 4, 0.5), (10, 3, 1.0), (6, 5, 0.3)])
def test_discrete_times_are_flow_factorys_stratified_draw(steps, count, fraction):
    t = torch.linspace(1, 0, steps + 1, dtype=torch.float64)
    sig = (3 * t / (1 + 2 * t)).float()  # a shift-3 grid: more than half of its sigmas are >= 0.5
    got = discrete_times(torch.Generator().manual_seed(steps), sig, count, fraction)
    u = torch.rand(count, generator=torch.Generator().manual_seed(steps)).tolist()
    idx = _ff_discrete(u, (sig[:-1].double() * 1000).tolist(), count, fraction)
    assert torch.equal(got, sig[idx])
    assert all(float(s) >= 1 - fraction - 1e-6 for s in got)
    with pytest.raises(Exception, match="keeps no grid sigma"):
        discrete_times(torch.Generator(), torch.tensor([0.4, 0.2, 0.0]), 2, 0.5)


def _cfg_run(recipe_config, *extra: str):
    return recipe_config(
        "diffusion_nft",
        "iterations=1",
        "group_size=4",
        "sampler.cfg_mode=full",
        "sampler.train_cfg_mode=full",
        "sampler.guidance_scale=3.0",
        "nft.timestep_fraction=0.34",  # int(6 * 0.34) = 2 times per sample
        "artifacts.grid_every=0",
        *extra,
    )


def test_cfg_first_pass_is_the_guided_on_policy_objective(recipe_config, monkeypatch):
    """First pass: old == trained policy, so v+ = v- = v_cfg = v_u + w (v_c - v_u) and the per-sample loss is
    adv_max / beta * L(v_cfg); both re-derived in float64 from the captured branches."""
    import flowgrpo.t2i.nft as nft_module
    from flowgrpo.t2i import train_t2i

    cfg = _cfg_run(recipe_config)
    w, calls, losses = cfg.sampler.guidance_scale, [], []
    velocity, loss_fn = NFTMethod.velocity, nft_module.nft_loss

    def spy_velocity(self, model, x_t, t, rows):
        out = velocity(self, model, x_t, t, rows)
        with torch.no_grad():  # the two branches at call time: uncond = full at w 0, cond = the conditional alone
            branches = (model.model_output(x_t, t, rows, 0.0, "full"), model.model_output(x_t, t, rows, w, "none"))
        calls.append((torch.is_grad_enabled(), out.detach().clone(), *branches))
        return out

    def spy_loss(v, v_old, x_t, x0, t, r, **kw):
        per = loss_fn(v, v_old, x_t, x0, t, r, **kw)
        losses.append((v.detach(), v_old, x_t, x0, t, r, per.detach(), kw))
        return per

    monkeypatch.setattr(NFTMethod, "velocity", spy_velocity)
    monkeypatch.setattr(nft_module, "nft_loss", spy_loss)
    (rec,) = train_t2i(cfg)
    n, T, steps = cfg.prompts_per_iteration * cfg.group_size, 2, cfg.sampler.num_steps
    assert len(losses) == T and len(calls) == 2 * T  # one micro-batch of n rows per time: old, then trained
    for k, (v, v_old, x_t, x0, t, r, per, kw) in enumerate(losses):
        old, new = calls[2 * k], calls[2 * k + 1]
        assert (old[0], new[0]) == (False, True)
        assert torch.equal(v, v_old)  # on policy: the old adapter starts equal and has not moved
        v64 = new[2].double() + w * (new[3].double() - new[2].double())
        assert torch.allclose(v.double(), v64, rtol=1e-5, atol=1e-5)
        assert not torch.allclose(v, new[3], atol=1e-3)  # the guidance matters on these inputs
        tt = t.double().view(-1, 1, 1, 1)
        err = (x_t.double() - tt * v64 - x0.double()).flatten(1)
        l64 = (err**2).mean(1) / err.abs().mean(1).clamp_min(1e-5)
        expect = kw["adv_max"] * (r.double() * l64 + (1 - r.double()) * l64) / kw["beta"]
        assert torch.allclose(per.double(), expect, rtol=1e-4, atol=1e-6)
    # CFG doubles every denoiser row: the rollout, the old policy's and the trained forwards
    assert rec["rollout_nfe_nograd"] == 2 * n * steps
    assert rec["nfe_grad"] == 2 * n * T
    assert rec["nfe_nograd"] == rec["rollout_nfe_nograd"] + 2 * n * T
    assert math.isfinite(rec["loss/policy"])


def test_discrete_times_and_epoch_clock_run(recipe_config):
    """Flow-Factory's geometry: 2 times per micro-batch of 1, the old policy's decay on the 0-based iteration."""
    from flowgrpo.t2i import train_t2i

    cfg = _cfg_run(
        recipe_config,
        "iterations=2",
        "nft.time_sampling=discrete",
        "nft.timesteps=2",
        "nft.timestep_fraction=0.5",
        "nft.decay_clock=iterations",
        "train.micro_batch_size=4",
    )
    first, second = train_t2i(cfg)
    n = cfg.prompts_per_iteration * cfg.group_size
    assert first["backward_passes"] == n // 4 * 2  # one backward per (micro-batch, time)
    assert first["nfe_grad"] == 2 * n * 2
    assert (first["nft/old_decay"], second["nft/old_decay"]) == (0.0, pytest.approx(0.001))  # min(0.001 epoch, 0.5)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["sampler.cfg_mode=full", "sampler.train_cfg_mode=detach_uncond"], "train_cfg_mode full"),
        (["sampler.cfg_mode=full", "sampler.train_cfg_mode=none"], "got 'none'"),
        (["method=nft_gardo", "sampler.cfg_mode=full", "sampler.train_cfg_mode=full"], "'nft_gardo' is CFG-free"),
    ],
)
def test_cfg_combinations_that_make_no_sense_are_refused(overrides, message):
    with pytest.raises(ValueError, match=message):
        load_t2i_config(RECIPES_DIR / "diffusion_nft.yaml", overrides)
