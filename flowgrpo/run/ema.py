"""The EMA of the trained weights: diffusers' EMAModel, stepped on the schedule `EMAConfig` names."""

from __future__ import annotations

from typing import Optional

import torch

from .config import EMAConfig


def flow_grpo_decay(cfg: EMAConfig, clock: int) -> Optional[float]:
    """Flow-GRPO's EMAModuleWrapper.step(params, clock): its decay, or None where it does not update."""
    if (clock + 1) % cfg.update_every:
        return None
    return min((1 + clock) / (10 + clock), cfg.decay)


class ScheduledEMA:
    """An EMAModel of the trained weights and when / how strongly it moves.

    `clock` is the published trainers' `global_step`: optimizer steps taken (plus idle iterations where the
    config counts them). "flow_grpo" replays their calls: one per training batch, i.e. `updates_per_step - 1`
    calls before an optimizer step (the batches it accumulates) and one after it, each at the clock of the call.
    """

    def __init__(self, params: list[torch.nn.Parameter], cfg: EMAConfig) -> None:
        from diffusers.training_utils import EMAModel

        self.cfg = cfg
        self.clock = 0
        # "flow_grpo" sets the decay per update; update_after_step -1 keeps EMAModel off its "first update copies"
        after = 0 if cfg.schedule == "constant" else -1
        # not foreach: torch has no DTensor sharding rule for the _foreach_copy_ it uses, and its fused update rounds
        # differently from the per-tensor one, which would make an FSDP2 run's EMA differ from the plain run's
        self.model = EMAModel(params, decay=cfg.decay, min_decay=cfg.decay, update_after_step=after)

    def _call(self, params: list[torch.nn.Parameter]) -> None:
        decay = flow_grpo_decay(self.cfg, self.clock)
        if decay is not None:
            self.model.decay = self.model.min_decay = decay
            self.model.step(params)

    def before_step(self, params: list[torch.nn.Parameter]) -> None:
        """The calls after the batches an optimizer step accumulates, before it updates the weights."""
        if self.cfg.schedule == "flow_grpo":
            for _ in range(self.cfg.updates_per_step - 1):
                self._call(params)

    def after_step(self, params: list[torch.nn.Parameter]) -> None:
        self.clock += 1
        if self.cfg.schedule == "flow_grpo":
            self._call(params)
        elif self.clock % self.cfg.update_every == 0:  # "constant": EMAModel's own decay (its first update copies)
            self.model.step(params)

    def idle_iteration(self) -> None:
        """An iteration without a policy update (a discriminator iteration); advances the clock if configured."""
        if self.cfg.count_idle_iterations:
            self.clock += 1


def build_ema(params: list[torch.nn.Parameter], cfg: EMAConfig) -> Optional[ScheduledEMA]:
    return ScheduledEMA(params, cfg) if cfg.enabled else None
