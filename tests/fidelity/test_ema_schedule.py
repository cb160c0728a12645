"""The EMA schedule against Flow-GRPO's EMAModuleWrapper and the loops that step it.

yifan123/flow_grpo flow_grpo/ema.py (the same class in DiffusionNFT, TempFlow-GRPO, TP-GRPO, Adv-GRPO):
    decay(g) = min((1 + g) / (10 + g), decay)
    step(params, g): if (g + 1) % update_step_interval == 0: ema += (1 - decay(g)) * (p - ema)
scripts/train_sd3.py (and the TempFlow-GRPO, TP-GRPO, Adv-GRPO scripts) call `ema.step(params, global_step)` after
every training batch; `global_step` counts optimizer steps, one every `gradient_accumulation_steps` batches.
DiffusionNFT's train_nft_sd3.py calls it only after the batch that closes an optimizer step. Adv-GRPO's
train_sd3_fast_dino_patch.py also does `global_step += 1` on each discriminator epoch (9 of every 10), which
trains no policy and calls no EMA. The reference replays those loops in float64 numpy, written from the
published code, not ours.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from flowgrpo.run import EMAConfig, ScheduledEMA, flow_grpo_decay


def published_ema(
    weights: list[np.ndarray],
    epochs: int,
    batches: int,
    accumulation: int,
    interval: int,
    every_batch: bool = True,
    d_times: int = 0,
) -> list[np.ndarray]:
    """The EMA at the end of each policy epoch. `weights[n]` = trained weights after n optimizer steps."""
    ema, global_step, steps, out = weights[0].copy(), 0, 0, []
    for epoch in range(epochs):
        if d_times and (epoch + 1) % d_times != 0:  # a discriminator epoch
            global_step += 1
            continue
        for i in range(batches):
            closes = (i + 1) % accumulation == 0
            if closes:
                steps += 1
                global_step += 1
            if every_batch or closes:
                g = global_step
                if (g + 1) % interval == 0:
                    d = min((1 + g) / (10 + g), 0.9)
                    ema = ema + (1 - d) * (weights[steps] - ema)
        out.append(ema.copy())
    return out


def ours(weights: list[np.ndarray], cfg: EMAConfig, epochs: int, steps_per_epoch: int, d_times: int = 0) -> list:
    p = torch.nn.Parameter(torch.tensor(weights[0], dtype=torch.float64))
    ema, steps, out = ScheduledEMA([p], cfg), 0, []
    for epoch in range(epochs):
        if d_times and (epoch + 1) % d_times != 0:
            ema.idle_iteration()
            continue
        for _ in range(steps_per_epoch):  # what OptimizerStep does around AdamW
            ema.before_step([p])
            steps += 1
            with torch.no_grad():
                p.copy_(torch.tensor(weights[steps], dtype=torch.float64))
            ema.after_step([p])
        out.append(ema.model.shadow_params[0].detach().numpy().copy())
    return out


@pytest.fixture
def weights() -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    return [rng.normal(size=6) for _ in range(301)]


CASES = [  # name, epochs, batches, accumulation, interval, every_batch, d_times
    ("flow_grpo / tempflow / tp_grpo / fast: 4 batches, 2 steps, every 8", 60, 4, 2, 8, True, 0),
    ("adv_grpo: 12 batches, 2 steps, every 8, D epochs counted", 300, 12, 6, 8, True, 10),
    ("diffusion_nft: called at the optimizer step only, every 1", 100, 1, 1, 1, False, 0),
]


@pytest.mark.parametrize(
    "name, epochs, batches, accumulation, interval, every_batch, d_times",
    CASES,
    ids=[c[0].split(":")[0] for c in CASES],
)
def test_flow_grpo_schedule_matches_the_published_loop(
    weights, name, epochs, batches, accumulation, interval, every_batch, d_times
):
    reference = published_ema(weights, epochs, batches, accumulation, interval, every_batch, d_times)
    cfg = EMAConfig(
        decay=0.9,
        update_every=interval,
        schedule="flow_grpo",
        updates_per_step=accumulation if every_batch else 1,
        count_idle_iterations=d_times > 0,
    )
    steps_per_epoch = batches // accumulation
    got = ours(weights, cfg, epochs, steps_per_epoch, d_times)
    assert len(got) == len(reference) >= 30
    np.testing.assert_allclose(np.stack(got), np.stack(reference), rtol=0, atol=1e-12)
    # the constant schedule (the default) is a different average: the mechanism is what makes them equal
    plain = ours(weights, EMAConfig(decay=0.9, update_every=interval), epochs, steps_per_epoch, d_times)
    assert np.abs(np.stack(plain) - np.stack(reference)).max() > 1e-2
    if d_times:  # and so is the clock without the discriminator epochs
        uncounted = ours(
            weights, cfg.model_copy(update={"count_idle_iterations": False}), epochs, steps_per_epoch, d_times
        )
        assert np.abs(np.stack(uncounted) - np.stack(reference)).max() > 1e-2


def test_decay_warms_up_to_the_set_decay():
    cfg = EMAConfig(decay=0.9, update_every=8, schedule="flow_grpo", updates_per_step=2)
    assert [g for g in range(40) if flow_grpo_decay(cfg, g) is not None] == [7, 15, 23, 31, 39]
    assert flow_grpo_decay(cfg, 7) == pytest.approx(8 / 17) and flow_grpo_decay(cfg, 79) == pytest.approx(80 / 89)
    assert flow_grpo_decay(cfg, 159) == 0.9
