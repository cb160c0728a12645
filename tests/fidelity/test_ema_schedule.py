"""The EMA schedule against Flow-GRPO's EMAModuleWrapper and the loop that steps it.

yifan123/flow_grpo flow_grpo/ema.py (the same class in DiffusionNFT, TempFlow-GRPO, TP-GRPO, Adv-GRPO):
    decay(g) = min((1 + g) / (10 + g), decay)
    step(params, g): if (g + 1) % update_step_interval == 0: ema += (1 - decay(g)) * (p - ema)
scripts/train_sd3.py calls `ema.step(params, global_step)` after every training batch, where `global_step` counts
the optimizer steps taken and an optimizer step closes every `gradient_accumulation_steps` batches; DiffusionNFT's
train_nft_sd3.py calls it only after the batch that closes an optimizer step. The reference below replays that
loop in float64 numpy (batches, accumulation, the global step counter), written from the formula, not our code.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from flowgrpo.run import EMAConfig, ScheduledEMA, ema_decays


def published_ema(
    weights: list[np.ndarray],
    batches_per_epoch: int,
    accumulation: int,
    interval: int,
    decay: float,
    every_batch: bool = True,
) -> list[np.ndarray]:
    """EMA after each optimizer step k = 1..K (and the batches up to the next step) of the published loop.

    `weights[k]` is the trained weight after k optimizer steps (weights[0] = initial).
    """
    ema = weights[0].copy()
    out: list[np.ndarray] = []
    global_step, batch = 0, 0
    steps = len(weights) - 1
    while global_step < steps:
        for i in range(batches_per_epoch):
            closes = (i + 1) % accumulation == 0
            if closes:
                global_step += 1
                if global_step > steps:
                    break
                out.append(None)  # filled once every call with this global_step has run
            if every_batch or closes:
                g = global_step
                if (g + 1) % interval == 0:
                    d = min((1 + g) / (10 + g), decay)
                    ema = ema + (1 - d) * (weights[g] - ema)
            if global_step >= 1:
                out[global_step - 1] = ema.copy()
            batch += 1
    return out


def ours(weights: list[np.ndarray], cfg: EMAConfig) -> list[np.ndarray]:
    p = torch.nn.Parameter(torch.tensor(weights[0], dtype=torch.float64))
    ema = ScheduledEMA([p], cfg)
    out = []
    for k in range(1, len(weights)):
        with torch.no_grad():
            p.copy_(torch.tensor(weights[k], dtype=torch.float64))
        ema.after_step(k, [p])
        out.append(ema.model.shadow_params[0].detach().numpy().copy())
    return out


@pytest.fixture
def weights() -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    return [rng.normal(size=6) for _ in range(101)]


@pytest.mark.parametrize(
    "name, batches, accumulation, interval, every_batch",
    [
        ("flow_grpo, tempflow, tp_grpo: 4 batches, 2 steps, every 8", 4, 2, 8, True),
        ("adv_grpo: 12 batches, 2 steps, every 8", 12, 6, 8, True),
        ("diffusion_nft: stepped at the optimizer step, every 1", 1, 1, 1, False),
    ],
)
def test_flow_grpo_schedule_matches_the_published_loop(weights, name, batches, accumulation, interval, every_batch):
    reference = published_ema(weights, batches, accumulation, interval, 0.9, every_batch)
    calls = accumulation if every_batch else 1
    cfg = EMAConfig(decay=0.9, update_every=interval, schedule="flow_grpo", updates_per_step=calls)
    got = ours(weights, cfg)
    assert len(got) == len(reference) == 100
    np.testing.assert_allclose(np.stack(got), np.stack(reference), rtol=0, atol=1e-12)
    # the constant schedule (the default) is a different average: the mechanism is what makes them equal
    plain = ours(weights, EMAConfig(decay=0.9, update_every=interval))
    assert np.abs(np.stack(plain) - np.stack(reference)).max() > 1e-2


def test_decays_warm_up_to_the_set_decay():
    cfg = EMAConfig(decay=0.9, update_every=8, schedule="flow_grpo", updates_per_step=2)
    assert [k for k in range(1, 40) if ema_decays(cfg, k)] == [7, 15, 23, 31, 39]
    assert ema_decays(cfg, 7) == [pytest.approx(8 / 17)] * 2
    assert ema_decays(cfg, 79) == [pytest.approx(80 / 89)] * 2 and ema_decays(cfg, 159) == [0.9] * 2
    constant = EMAConfig(decay=0.9, update_every=8)
    assert [k for k in range(1, 40) if ema_decays(constant, k)] == [8, 16, 24, 32]
