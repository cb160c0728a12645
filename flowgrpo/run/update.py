"""The update both trainers share: one iteration's inner epochs x mini-batches x micro-batches.

A method plug-in lays out the passes (per epoch, its mini-batches: this rank's micro-batches and the
mini-batch's global loss normaliser) and computes one micro-batch's loss; this loop owns the order that
every method must keep: a sharded run's padding passes first (every rank runs as many as the busiest one),
then each micro-batch's forward and backward, one optimizer step per mini-batch, the on-policy check on
every micro-batch before the first optimizer step, and the loss metrics merged over ranks at the end.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Optional, Protocol, Sequence

import torch
from torch import Tensor

from ..distributed import Distributed
from ..metrics import LossMetrics
from .optim import OptimizerStep
from .ratio_check import FirstPassCheck


@dataclass
class MiniBatch:
    """One optimizer step's share of the batch on this rank."""

    micros: Sequence[Any]  # this rank's micro-batches, in order; each is handed to the method's micro_loss
    norm: Any = None  # the mini-batch's global loss normaliser (flowgrpo.core.LossNormalizer), if the loss has one


@dataclass
class MicroLoss:
    """A micro-batch's loss to back-propagate, and what it tells the loop."""

    loss: Tensor
    metrics: Optional[Mapping[str, float]] = None  # loss-part metrics, weighted by `actions`
    actions: int = 0
    deviation: Optional[tuple[float, int]] = None  # before the first optimizer step: (max |ratio - 1|, rows)


class MicroLossFn(Protocol):
    def __call__(self, micro: Any, norm: Any, on_policy: bool) -> MicroLoss: ...


@dataclass
class UpdateResult:
    metrics: LossMetrics  # every rank's micro-batches
    backward_passes: int  # this rank's
    padding_passes: int  # this rank's


def run_update(
    passes: Iterable[Iterable[MiniBatch]],
    micro_loss: MicroLossFn,
    padding_loss: Callable[[Any], Tensor],
    optimizer_step: OptimizerStep,
    dist: Distributed,
    check: Optional[FirstPassCheck] = None,
) -> UpdateResult:
    """Run every pass; `padding_loss(norm)` is a real forward whose loss is zeroed (a sharded run's extra pass)."""
    metrics = LossMetrics()
    on_policy, backwards, padding = True, 0, 0
    for minis in passes:
        for mini in minis:
            for _ in range(dist.passes_to_pad(len(mini.micros))):
                optimizer_step.backward(padding_loss(mini.norm).mul(0.0))
                padding += 1
            for micro in mini.micros:
                out = micro_loss(micro, mini.norm, on_policy)
                if on_policy and check is not None and out.deviation is not None:
                    check.observe(*out.deviation)
                optimizer_step.backward(out.loss)
                backwards += 1
                if out.metrics is not None:
                    metrics.add(dict(out.metrics), out.actions)
            optimizer_step()
            on_policy = False
    if dist.active:  # every rank's micro-batches, so the record describes the global batch
        metrics = LossMetrics.merged(dist.gather_objects([metrics]))
        if check is not None:
            check.reduce(dist)
    return UpdateResult(metrics, backwards, padding)


def record_update(record: dict[str, Any], result: UpdateResult, optimizer_steps: int, lockstep: bool) -> None:
    """The loss metrics and this rank's pass counts (the trainer sums counts over ranks)."""
    record.update(result.metrics.result(optimizer_steps))
    record["backward_passes"] = result.backward_passes
    if lockstep:
        record["padding_passes"] = result.padding_passes


def pass_generator(seed: int, iteration: int, epoch: int) -> torch.Generator:
    """The generator of pass `epoch` of iteration `iteration`: seeded by these alone, so a resume draws the same."""
    return torch.Generator().manual_seed(seed * 1_000_003 + iteration * 1009 + epoch)


def pass_order(n: int, seed: int, iteration: int, epoch: int, shuffle: bool) -> Tensor:
    """The order of the n rows (edges, sequences) trained in pass `epoch` of iteration `iteration`."""
    if not shuffle:
        return torch.arange(n)
    return torch.randperm(n, generator=pass_generator(seed, iteration, epoch))
