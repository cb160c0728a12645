"""The contract of a method plug-in, for either trainer: what it receives (`MethodContext`) and what it does.

A method turns a scored rollout into optimizer steps (through the shared update loop, flowgrpo.run.update)
and may add state to checkpoints. It never holds the trainer: it gets a context with the config, the process
group, the optimizer step, the trained parameters, the KL reference and the iteration counter, and the
trainer's own context adds what its modality has (the image adapter and sampler, the text model). A method
is registered by name in its trainer's registry; its own config rules run with the config's cross-checks.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Optional

from torch import Tensor

from ..distributed import Distributed
from .optim import OptimizerStep


@dataclass(frozen=True)
class MethodContext:
    """What every method plug-in may use."""

    cfg: Any  # the trainer's config (T2IConfig, TextConfig)
    dist: Distributed
    optimizer_step: OptimizerStep
    params: list[Tensor]  # the trained parameters (as the optimizer holds them)
    reference: Optional[Callable[[], ContextManager[Any]]]  # the KL reference (LoRA off / a frozen copy), if kept
    completed: Callable[[], int]  # iterations completed before the one in progress (its 0-based index)

    @property
    def iteration(self) -> int:
        """The 0-based index of the iteration in progress (seeds, schedules)."""
        return self.completed()


class Method:
    """A method plug-in: the defaults sample with the current policy and keep no state of their own."""

    def __init__(self, ctx: Any) -> None:
        self.ctx = ctx

    @staticmethod
    def check_config(cfg: Any) -> None:
        """This method's own config rules (the config's cross-checks call them): a ValueError names the problem."""

    @staticmethod
    def needs_reference(cfg: Any) -> bool:
        """A KL term against the reference policy: the trainer keeps one (a frozen copy when fully fine-tuned)."""
        return False

    def rollout_policy(self) -> ContextManager[Any]:
        """The weights that sample the rollout (the image trainer's hook; NFT samples with its old policy)."""
        return contextlib.nullcontext()

    def update(self, rollout: Any, record: dict[str, Any]) -> None:
        """Turn the scored rollout into optimizer steps (ctx.optimizer_step); metrics into `record`."""
        raise NotImplementedError

    def checkpoint_parts(self, parts: Any) -> None:
        """Add this method's own tensors / optimizers / state to a checkpoint (flowgrpo.checkpoint's parts)."""

    def restore(self, ckpt: Any) -> None:
        """Load what `checkpoint_parts` saved."""
