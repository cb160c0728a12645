"""The ddim kernel reproduces diffusers' DDIMScheduler.step for the same noise."""

import pytest
import torch
from diffusers import DDIMScheduler

from pipelines.schedules import SD15_DDIM_CONFIG, ddim_schedule
from pipelines.steps import rescore, step


@pytest.mark.parametrize("prediction_type", ["epsilon", "v_prediction"])
@pytest.mark.parametrize("eta", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("n", [10, 50])
def test_ddim_matches_diffusers_step(n, eta, prediction_type):
    cfg = {**SD15_DDIM_CONFIG, "prediction_type": prediction_type}
    ref = DDIMScheduler(**cfg)
    ref.set_timesteps(n)
    sched = ddim_schedule(n, config=cfg)
    x = torch.randn(2, 4, 8, 8)
    for i, t in enumerate(ref.timesteps):
        out_model, noise = torch.randn_like(x), torch.randn_like(x)
        want = ref.step(out_model, t, x, eta=eta, variance_noise=noise)
        got = step("ddim", x, out_model, sched, i, noise, eta=eta)
        torch.testing.assert_close(got.x_next, want.prev_sample, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got.x0_hat, want.pred_original_sample, rtol=1e-5, atol=1e-4)
        assert torch.isfinite(got.logp).all()
        x = want.prev_sample


def test_ddim_std_is_eta_times_the_ddim_variance():
    sched = ddim_schedule(20)
    ab, abp = float(sched.alpha_bar[5]), float(sched.alpha_bar_prev[5])
    var = (1 - abp) / (1 - ab) * (1 - ab / abp)
    x = torch.randn(2, 4, 4, 4)
    out = step("ddim", x, torch.randn_like(x), sched, 5, eta=0.7)
    assert float(out.std) == pytest.approx(0.7 * var**0.5, rel=1e-5)
    again = rescore("ddim", x, out.x_next, torch.randn_like(x), sched, 5, eta=0.7)
    assert not torch.equal(again.logp, out.logp)  # a different model output moves the mean
