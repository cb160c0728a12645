"""Dynamic loss scaling for fp16 training (the `optim.loss_scale` setting), around torch's `torch.amp.GradScaler`.

An fp16 backward (fp16 weights, or fp32 weights under fp16 autocast) flushes activation gradients below 6e-8 to
zero; every published fp16 run multiplies the loss by a large scale first and divides the gradients by it before
the optimizer sees them: accelerate's native AMP (`mixed_precision: fp16` -> a `GradScaler`), DiffusionNFT's
explicit `GradScaler`, DeepSpeed's dynamic loss scale. `OptimizerStep` applies it where both trainers step:

    backward   loss x scale, micro-batch by micro-batch (the scaled gradients accumulate)
    step       sum over ranks -> unscale (/ scale) -> clip at optim.max_grad_norm (the true norm) -> a finite
               norm steps AdamW; a NaN / inf one skips the step (weights and moments untouched) and halves the
               scale; `growth_interval` finite steps in a row double it (torch's and DeepSpeed's rule)

A skipped step of a scaled run is an overflow, expected while the scale settles: it is counted in
`train/skipped_steps` (the scale in `train/loss_scale`), and the step's clocks advance as in the published loops
(they call `scaler.step` / `engine.step` and count the batch either way: the optimizer-step count and the EMA
call, on unchanged weights). Only once the scale has fallen to `min_scale` does a non-finite gradient go to the
run's non-finite guard (a NaN that no scale removes: counted there, the run stops after `guards.max_bad_updates`),
like DeepSpeed, which stops at its `min_loss_scale`.

Over ranks the verdict is the same everywhere: data-parallel gradients are summed before the check, and FSDP2's
DTensor gradients reduce GradScaler's inf flag over the mesh (torch's DTensor handler of
`_amp_foreach_non_finite_check_and_unscale_`); the skip itself follows the global gradient norm.
"""

from __future__ import annotations

from typing import Any, Literal, Optional

import torch
from pydantic import Field, model_validator

from ..core.config import StrictModel

GROUP_KEY = "loss_scaler"  # where a checkpoint keeps the scaler's state: the optimizer's first param group


class LossScaleConfig(StrictModel):
    """`optim.loss_scale`: `none` (default) or `dynamic`; the shorthand `loss_scale: dynamic` is accepted."""

    mode: Literal["none", "dynamic"] = "none"
    init_scale: float = Field(default=2.0**16, gt=0)  # torch's GradScaler and DeepSpeed (initial_scale_power 16) alike
    # finite steps in a row before the scale doubles: torch's GradScaler (accelerate, DiffusionNFT) 2000,
    # DeepSpeed's loss_scale_window 1000
    growth_interval: int = Field(default=2000, ge=1)
    # DeepSpeed's min_loss_scale; at it a non-finite gradient is the guard's to judge
    min_scale: float = Field(default=1.0, gt=0)

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, data: Any) -> Any:
        return {"mode": data} if isinstance(data, str) else data

    @model_validator(mode="after")
    def _floor(self) -> "LossScaleConfig":
        if self.min_scale > self.init_scale:
            raise ValueError(f"min_scale {self.min_scale} is above init_scale {self.init_scale}")
        return self

    @property
    def enabled(self) -> bool:
        return self.mode == "dynamic"


class LossScaler:
    """torch's GradScaler for one optimizer, with the step verdict taken from the global gradient norm."""

    def __init__(self, cfg: LossScaleConfig, params: list[torch.nn.Parameter]) -> None:
        if any(p.dtype == torch.float16 for p in params):
            raise ValueError(
                "optim.loss_scale: the trained parameters are float16; GradScaler unscales fp32 gradients only "
                "(train fp32 weights: LoRA is fp32 on any base, a full fine-tune needs model.dtype float32)"
            )
        device = _local(params[0]).device.type if params else "cpu"
        self.cfg = cfg
        self.scaler = torch.amp.GradScaler(
            device, init_scale=cfg.init_scale, growth_factor=2.0, backoff_factor=0.5,
            growth_interval=cfg.growth_interval,
        )  # fmt: skip
        self.skipped = 0  # overflow skips of the current training step

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return self.scaler.scale(loss)

    def unscale(self, optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter]) -> bool:
        """Divide the gradients by the scale; False when no parameter has a gradient (nothing to check)."""
        if all(p.grad is None for p in params):
            return False
        self.scaler.unscale_(optimizer)
        return True

    def update(self, finite: bool, checked: bool) -> bool:
        """After the step's verdict (`finite`: the global gradient norm; `checked`: gradients were unscaled): torch's
        rule backs off or counts towards growth. True when a skip is an overflow that the scale explains (the scale
        was above `min_scale` and came down); False when it is the guard's to judge."""
        before = self.scaler.get_scale()
        if checked:
            self.scaler.update()  # from the inf flag unscale_ recorded: the same on every rank
        if finite:
            return True
        after = self.scaler.get_scale()
        if after < self.cfg.min_scale:
            self.scaler.update(new_scale=float(self.cfg.min_scale))
        if before <= self.cfg.min_scale or not after < before:
            return False
        self.skipped += 1
        return True

    def get_scale(self) -> float:
        return float(self.scaler.get_scale())

    def state_dict(self) -> dict[str, Any]:
        return self.scaler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scaler.load_state_dict(state)


class ScaledOptimizerState:
    """What a checkpoint saves as the optimizer of a loss-scaled run: the optimizer's state, with the scaler's
    (scale, growth tracker: plain numbers) in its first param group, which the checkpoint writes as JSON. A
    checkpoint without it (saved before the setting existed) leaves the scaler at its initial state."""

    def __init__(self, inner: Any, scaler: LossScaler) -> None:
        self.inner, self.scaler = inner, scaler

    def state_dict(self) -> dict[str, Any]:
        sd = self.inner.state_dict()
        groups = [dict(g) for g in sd["param_groups"]]
        groups[0][GROUP_KEY] = self.scaler.state_dict()
        return {**sd, "param_groups": groups}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        groups = [dict(g) for g in sd["param_groups"]]
        saved: Optional[dict[str, Any]] = groups[0].pop(GROUP_KEY, None) if groups else None
        for g in groups[1:]:
            g.pop(GROUP_KEY, None)
        self.inner.load_state_dict({**sd, "param_groups": groups})
        if saved is not None:
            self.scaler.load_state_dict(saved)

    def __getattr__(self, name: str) -> Any:  # param_groups, state, ... of the optimizer it wraps
        return getattr(self.inner, name)


def _local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if type(p).__name__ == "DTensor" else p  # type: ignore[attr-defined]
