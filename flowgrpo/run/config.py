"""Config sections both trainers share: the optimizer and its schedule, checkpoints, the on-policy check, EMA."""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field

from ..core.config import StrictModel


class OptimConfig(StrictModel):
    lr: float = Field(1e-5, ge=0)
    schedule: Literal["constant", "linear", "cosine"] = "constant"
    warmup_steps: int = Field(0, ge=0)
    min_lr_ratio: float = Field(0.0, ge=0, le=1)
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    max_grad_norm: Optional[float] = 1.0  # None = no clipping (the norm is still logged)


class RatioCheckConfig(StrictModel):
    """The live on-policy check: the first pass over a fresh batch must give ratio 1."""

    enabled: bool = True
    tolerance: float = 1e-4


class CheckpointConfig(StrictModel):
    every: int = Field(10, ge=0)  # steps between checkpoints; 0 = only at the end (and on SIGINT / SIGTERM)
    keep_last: int = Field(2, ge=1)
    dir: Optional[str] = None  # default: <output_dir>/checkpoints
    save_final_model: bool = True  # the trained weights in their library's format at the end


class EMAConfig(StrictModel):
    enabled: bool = True
    decay: float = Field(0.9, ge=0, le=1)
    update_every: int = Field(1, ge=1)  # optimizer steps between EMA updates
