"""AdamW with its learning-rate schedule, and the optimizer step both trainers take.

The step is the one place where gradients become weights: all-reduce over ranks (FSDP2 reduce-scatters them
in backward instead), unscale (fp16 loss scaling, `optim.loss_scale`: flowgrpo.run.loss_scale), clip, AdamW, zero
the gradients, EMA. The run's `NonFiniteGuard` refuses a NaN / inf gradient here, so no trainer can forget it.
The trainers back-propagate the policy's losses through `OptimizerStep.backward`: in a ZeRO run (a DeepSpeed
launch) the step owns a DeepSpeed engine, which reduces, clips and steps (flowgrpo.scaling.zero).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

import torch

from ..distributed import Distributed
from ..guards import NonFiniteGuard
from ..scaling.sharding import clip_grad_norm
from .config import OptimConfig
from .ema import ScheduledEMA
from .loss_scale import LossScaleConfig, LossScaler, ScaledOptimizerState

if TYPE_CHECKING:
    from ..scaling.zero import ZeroEngine


def lr_factor(step: int, cfg: OptimConfig, total_steps: int) -> float:
    """Multiplier of the base learning rate at training step `step` (0-based)."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return (step + 1) / (cfg.warmup_steps + 1)
    if cfg.schedule == "constant":
        return 1.0
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps))
    if cfg.schedule == "linear":
        shape = 1.0 - progress
    else:  # cosine
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * shape


@dataclass(frozen=True)
class ScheduledOptimizer:
    """AdamW over the trained parameters and its learning-rate schedule."""

    optimizer: torch.optim.AdamW
    scheduler: torch.optim.lr_scheduler.LambdaLR  # stepped once per training step


def build_optimizer(
    params: list[torch.nn.Parameter], cfg: OptimConfig, total_steps: int, *, fused: bool
) -> ScheduledOptimizer:
    """AdamW over `params` and its schedule (stepped once per training step; its state is plain numbers).

    `fused`: torch's one-pass kernel where it has one (about 2x faster on CPU for many small tensors; TRL and
    transformers use it by default). The image trainer keeps the multi-tensor kernel its runs were measured with
    (measured: with the fused kernel its two-process loss metrics left the bound tests/t2i/test_two_process.py sets
    from other micro-batch sizes, 2.7e-9 against 4.7e-10). The multi-tensor kernel is asked for by name: torch
    picks it by default on CUDA only, and on CPU its per-tensor loop costs ~0.3 ms a step more for 22 LoRA
    tensors (the same arithmetic: bit-identical weights).
    """
    if not params:
        raise ValueError("the model has no trainable parameters")
    fused = fused and all(
        p.device.type in ("cpu", "cuda") and p.dtype in (torch.float32, torch.float16, torch.bfloat16) for p in params
    )
    optimizer = torch.optim.AdamW(
        params,
        lr=cfg.lr,
        betas=cfg.betas,
        eps=cfg.eps,
        weight_decay=cfg.weight_decay,
        fused=fused or None,
        foreach=None if fused else True,
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, cfg, max(total_steps, 1)))
    return ScheduledOptimizer(optimizer, scheduler)


class OptimizerStep:
    """Gradients summed over ranks -> unscaled -> clipped -> AdamW -> zeroed -> EMA; counts steps and grad norms.
    With a `guard`, a step whose (global) gradient norm is NaN / inf is skipped: the gradients are zeroed, the
    weights, the AdamW moments and the EMA stay as they were, and the guard counts it. With `loss_scale` dynamic,
    `backward` scales each loss and a NaN / inf norm is first an overflow (flowgrpo.run.loss_scale: the scale
    halves, the skip is counted in `train/skipped_steps`, the clocks advance as in the published loops)."""

    def __init__(
        self,
        params: list[torch.nn.Parameter],
        optimizer: torch.optim.Optimizer,
        max_grad_norm: Optional[float],
        dist: Distributed,
        ema: Optional[ScheduledEMA] = None,
        guard: Optional[NonFiniteGuard] = None,
        module: Optional[torch.nn.Module] = None,
        loss_scale: Optional[LossScaleConfig] = None,
    ) -> None:
        """`module`: the model that holds `params` (the DeepSpeed engine of a ZeRO run wraps it); `loss_scale`: the
        recipe's `optim.loss_scale` (None: off)."""
        self.params, self.optimizer, self.dist, self.guard = params, optimizer, dist, guard
        self.max_norm = max_grad_norm if max_grad_norm is not None else math.inf
        self.ema = ema
        self.total = 0  # optimizer steps over the run (saved in checkpoints)
        self.norms: list[float] = []  # grad norms of the current training step
        self.zero: Optional[ZeroEngine] = None
        self.checkpointed: Any = optimizer  # what a checkpoint saves as the optimizer (state_dict / load_state_dict)
        if dist.zero is not None:
            from ..config import ConfigError
            from ..scaling.zero import FullOptimizerState, ZeroEngine, ZeroError

            if module is None:
                raise ValueError("a ZeRO run's OptimizerStep needs the module that holds the parameters")
            try:
                self.zero = ZeroEngine(module, optimizer, dist.zero, max_grad_norm, dist.world_size)
            except ZeroError as err:
                raise ConfigError(f"accelerate DeepSpeed config: {err}") from None
            self.checkpointed = FullOptimizerState(self.zero)
        self.scaler: Optional[LossScaler] = None
        if loss_scale is not None and loss_scale.enabled:
            from ..config import ConfigError

            if self.zero is not None:
                raise ConfigError(
                    "optim.loss_scale dynamic under a DeepSpeed launch: the engine reduces and clips the gradients "
                    "itself, before flowgrpo could unscale them; launch with ddp.yaml or fsdp2.yaml"
                )
            try:
                self.scaler = LossScaler(loss_scale, params)
            except ValueError as err:
                raise ConfigError(str(err)) from None
            self.checkpointed = ScaledOptimizerState(optimizer, self.scaler)

    def gather_state(self) -> None:
        """Every rank, before rank 0 writes a checkpoint: a ZeRO engine's AdamW moments gathered from the
        partitions (a collective)."""
        if self.zero is not None:
            self.checkpointed.gather()

    def weights_loaded(self) -> None:
        """The trained weights were written from outside the step (a resume): a ZeRO engine's fp32 master copy
        takes them."""
        if self.zero is not None:
            self.zero.load_master_weights()

    def backward(self, loss: torch.Tensor) -> None:
        """Back-propagate a policy loss (through the DeepSpeed engine in a ZeRO run)."""
        if self.zero is not None:
            self.zero.backward(loss)
        elif self.scaler is not None:
            self.scaler.scale(loss).backward()  # type: ignore[no-untyped-call]
        else:
            loss.backward()  # type: ignore[no-untyped-call]  # (Tensor.backward: what the bench probe times)

    def begin(self) -> None:
        """A new training step: its grad norms start empty."""
        self.norms = []
        if self.scaler is not None:
            self.scaler.skipped = 0

    def __call__(self) -> float:
        if self.ema is not None:
            self.ema.before_step(self.params)
        if self.zero is not None:
            return self._zero_step()
        self.dist.all_reduce_grads(self.params)
        checked = self.scaler is not None and self.scaler.unscale(self.optimizer, self.params)
        norm = clip_grad_norm(self.params, self.max_norm)  # over every shard when FSDP2 shards the weights
        if self.scaler is not None and self.scaler.update(math.isfinite(norm), checked) and not math.isfinite(norm):
            self.optimizer.zero_grad(set_to_none=True)  # an overflow, not in grad_norm; the published loops count
            self._advance()  # the step and call the EMA on the unchanged weights
            return norm
        self.norms.append(norm)
        if self.guard is not None and not self.guard.step_ok(norm):  # the same norm on every rank: all skip
            self.optimizer.zero_grad(set_to_none=True)
            return norm
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self._advance()
        return norm

    def _advance(self) -> None:
        self.total += 1
        if self.ema is not None:
            self.ema.after_step(self.params)

    def _zero_step(self) -> float:
        """DeepSpeed reduces, clips and steps; it skips a step whose gradients hold NaN / inf itself."""
        assert self.zero is not None
        norm, applied = self.zero.step()
        self.norms.append(norm)
        if not applied:  # the weights, moments and EMA stay as they were; the guard counts the skip
            if self.guard is not None:
                self.guard.step_ok(math.nan)
            return norm
        self.total += 1
        if self.ema is not None:
            self.ema.after_step(self.params)
        return norm

    def metrics(self) -> dict[str, float]:
        """optimizer_steps of this training step, and the mean / max grad norm over them (a loss-scaled run: the
        scale after the step, `train/loss_scale`, and its overflow skips, `train/skipped_steps`, which count as
        steps but not in the norms)."""
        skipped = self.scaler.skipped if self.scaler is not None else 0
        out: dict[str, float] = {"optimizer_steps": len(self.norms) + skipped}
        if self.norms:
            out["grad_norm"] = sum(self.norms) / len(self.norms)
            out["grad_norm_max"] = max(self.norms)
        if self.scaler is not None:
            out["train/loss_scale"] = self.scaler.get_scale()
            out["train/skipped_steps"] = self.scaler.skipped
        return out
