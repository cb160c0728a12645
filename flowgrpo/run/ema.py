"""The EMA of the trained weights: diffusers' EMAModel, stepped on the schedule `EMAConfig` names."""

from __future__ import annotations

from typing import Optional

import torch

from .config import EMAConfig


def ema_decays(cfg: EMAConfig, step: int) -> list[Optional[float]]:
    """The decays of the EMA updates after optimizer step `step` (1-based), in order; [] = no update.

    None = the EMAModel's own decay ("constant": `decay`, except that its first update copies the weights).
    """
    if cfg.schedule == "constant":
        return [None] if step % cfg.update_every == 0 else []
    if (step + 1) % cfg.update_every:
        return []
    return [min((1 + step) / (10 + step), cfg.decay)] * cfg.updates_per_step


class ScheduledEMA:
    """An EMAModel of `params` and when / how strongly it moves; `after_step(k)` follows optimizer step k."""

    def __init__(self, params: list[torch.nn.Parameter], cfg: EMAConfig) -> None:
        from diffusers.training_utils import EMAModel

        self.cfg = cfg
        if cfg.schedule == "constant":
            self.model = EMAModel(params, decay=cfg.decay, min_decay=cfg.decay)
        else:  # the decay is set per update; update_after_step -1 keeps EMAModel off its "first update copies" path
            self.model = EMAModel(params, decay=cfg.decay, min_decay=cfg.decay, update_after_step=-1)

    def after_step(self, step: int, params: list[torch.nn.Parameter]) -> None:
        for decay in ema_decays(self.cfg, step):
            if decay is not None:
                self.model.decay = self.model.min_decay = decay
            self.model.step(params)


def build_ema(params: list[torch.nn.Parameter], cfg: EMAConfig) -> Optional[ScheduledEMA]:
    return ScheduledEMA(params, cfg) if cfg.enabled else None
