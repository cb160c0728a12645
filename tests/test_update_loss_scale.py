"""fp16 loss scaling in the shared optimizer step (`optim.loss_scale`, flowgrpo.run.loss_scale): the same update as an
unscaled run in fp32, an overflow skipped with the scale halved, the guard only at the scale's floor, the scale
through a checkpoint, and the setting in both trainers' configs."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from flowgrpo.checkpoint import load_checkpoint, save_checkpoint
from flowgrpo.config import ConfigError
from flowgrpo.distributed import Distributed
from flowgrpo.guards import GuardConfig, NonFiniteGuard
from flowgrpo.run import OptimConfig, OptimizerStep, build_optimizer
from flowgrpo.run.loss_scale import LossScaleConfig

DYNAMIC = LossScaleConfig(mode="dynamic", init_scale=2.0**12, growth_interval=3)


class Clock:
    """The EMA's side of a step: its clock advances after every step the run counts."""

    clock = 0

    def before_step(self, params) -> None:
        pass

    def after_step(self, params) -> None:
        self.clock += 1


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 1))


def _step(model, loss_scale=None, guard=None, ema=None, max_norm=0.05) -> OptimizerStep:
    params = list(model.parameters())
    optimizer = build_optimizer(params, OptimConfig(lr=1e-2, weight_decay=1e-4), 10, fused=False).optimizer
    return OptimizerStep(params, optimizer, max_norm, Distributed(), ema, guard=guard, loss_scale=loss_scale)


def _train(model, step, batches, micro: int = 2) -> list[dict]:
    """Each batch: `micro` micro-batches accumulated into one optimizer step."""
    records = []
    for x in batches:
        step.begin()
        for part in x.chunk(micro):
            step.backward(model(part).pow(2).mean() / micro)
        step()
        records.append(step.metrics())
    return records


def test_scaled_and_unscaled_give_the_same_update_in_fp32():
    batches = [torch.randn(8, 6, generator=torch.Generator().manual_seed(i)) for i in range(5)]
    plain, scaled = _model(), _model()
    plain_records = _train(plain, _step(plain), batches)
    step = _step(scaled, DYNAMIC)
    scaled_records = _train(scaled, step, batches)
    for a, b in zip(plain.parameters(), scaled.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)  # a power-of-two scale: the same bits in practice
    assert plain_records[0]["grad_norm"] > 0.05  # clipping acted, on the unscaled norm
    for a, b in zip(plain_records, scaled_records):
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-6)
    # 5 finite steps with growth_interval 3: doubled once
    assert [r["train/loss_scale"] for r in scaled_records] == [2.0**12] * 2 + [2.0**13] * 3
    assert all(r["train/skipped_steps"] == 0 for r in scaled_records) and step.total == 5
    assert "train/loss_scale" not in plain_records[0]  # off by default: the records of a plain run are unchanged


def test_an_overflow_is_skipped_the_scale_halves_and_the_guard_is_not_charged():
    model = _model()
    guard = NonFiniteGuard(GuardConfig(max_bad_updates=1), "step")
    ema = Clock()
    step = _step(model, LossScaleConfig(mode="dynamic", init_scale=2.0**16, min_scale=2.0**15), guard, ema)
    before = [p.detach().clone() for p in model.parameters()]
    x = torch.ones(2, 6)
    step.begin()
    step.backward(model(x).sum() * 1e34)  # finite loss, x 65536 overflows float32 in the backward
    norm = step()
    assert math.isinf(norm) or math.isnan(norm)
    assert all(torch.equal(a, p.detach()) for a, p in zip(before, model.parameters()))
    assert step.optimizer.state_dict()["state"] == {}  # AdamW never saw it
    assert all(p.grad is None for p in model.parameters())
    assert step.metrics() == {"optimizer_steps": 1, "train/loss_scale": 2.0**15, "train/skipped_steps": 1}
    assert guard.skipped_steps == 0 and step.total == 1 and ema.clock == 1  # counted as the published loops do
    # at the floor the scale explains nothing: the guard judges (and would stop the run)
    step.begin()
    step.backward(model(x).sum() * 1e35)
    step()
    assert guard.skipped_steps == 1 and step.scaler.get_scale() == 2.0**15 and step.total == 1
    # a finite step afterwards trains as usual
    step.begin()
    step.backward(model(x).sum())
    assert math.isfinite(step()) and step.total == 2
    assert not all(torch.equal(a, p.detach()) for a, p in zip(before, model.parameters()))


def test_resume_restores_the_scale(tmp_path: Path):
    model = _model()
    step = _step(model, LossScaleConfig(mode="dynamic", init_scale=2.0**10, growth_interval=2))
    _train(model, step, [torch.randn(4, 6) for _ in range(3)])  # 3 finite steps: doubled once, tracker 1
    step.begin()
    step.backward(model(torch.ones(1, 6)).sum() * 1e36)
    step()  # an overflow: halved again, tracker 0
    step.begin()
    step.backward(model(torch.ones(1, 6)).sum())
    step()  # tracker 1
    saved = step.scaler.state_dict()
    assert saved["scale"] == 2.0**10 and saved["_growth_tracker"] == 1
    path = save_checkpoint(tmp_path, 1, optimizers={"policy": step.checkpointed})
    fresh = _step(_model(1), LossScaleConfig(mode="dynamic", init_scale=2.0**10, growth_interval=2))
    load_checkpoint(path, optimizers={"policy": fresh.checkpointed}, restore_rng=False)
    assert fresh.scaler.state_dict() == saved
    assert "loss_scaler" not in fresh.optimizer.param_groups[0]  # the scaler's state left the optimizer's groups
    assert fresh.optimizer.state_dict()["state"][0]["step"] == step.optimizer.state_dict()["state"][0]["step"]
    # the next finite step grows the restored scale, as the uninterrupted run's would
    fresh.begin()
    fresh.backward(fresh.params[0].sum() * 0 + list(fresh.params)[-1].sum())
    fresh()
    assert fresh.scaler.get_scale() == 2.0**11


def test_settings_and_refusals():
    assert OptimConfig().loss_scale.mode == "none" and not OptimConfig().loss_scale.enabled
    assert OptimConfig(loss_scale="dynamic").loss_scale == LossScaleConfig(mode="dynamic")
    with pytest.raises(ValueError, match="min_scale"):
        LossScaleConfig(mode="dynamic", init_scale=1.0, min_scale=2.0)
    half = torch.nn.Linear(2, 2).half()
    with pytest.raises(ConfigError, match="float16"):
        _step(half, DYNAMIC)
    from flowgrpo.t2i.config import load_t2i_config
    from flowgrpo.text.config import TextConfig

    assert load_t2i_config(None, ["optim.loss_scale=dynamic"]).optim.loss_scale.enabled
    assert TextConfig.model_fields["optim"].annotation is OptimConfig
