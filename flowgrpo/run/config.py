"""Config sections both trainers share: the update's passes, the optimizer and its schedule, checkpoints, the
on-policy check, EMA."""

from __future__ import annotations

from typing import Annotated, Literal, Optional

from pydantic import Field, model_validator

from ..core.config import StrictModel
from .loss_scale import LossScaleConfig


class UpdateConfig(StrictModel):
    """How one iteration's batch is trained on (the `train` section; flowgrpo.run.update runs it)."""

    inner_epochs: int = Field(1, ge=1)  # passes over each batch (TRL's num_iterations, mu)
    mini_batches: int = Field(1, ge=1)  # optimizer steps per pass, each with one global loss normaliser
    micro_batch_size: int = Field(16, ge=1)  # rows (edges, NFT samples, sequences) per forward / backward
    shuffle: bool = True  # a new seeded order of the rows at every pass


# An Adam beta: a moment's decay per step, in [0, 1) (torch refuses anything else, but only once the models are built)
Beta = Annotated[float, Field(ge=0, lt=1)]


class OptimConfig(StrictModel):
    lr: float = Field(1e-5, ge=0)
    schedule: Literal["constant", "linear", "cosine"] = "constant"
    warmup_steps: int = Field(0, ge=0)
    min_lr_ratio: float = Field(0.0, ge=0, le=1)
    weight_decay: float = Field(0.0, ge=0)  # negative: the weights would grow every step
    betas: tuple[Beta, Beta] = (0.9, 0.999)
    eps: float = Field(1e-8, gt=0)  # Adam's denominator floor (0: a weight whose gradient is 0 becomes NaN)
    max_grad_norm: Optional[float] = Field(1.0, gt=0)  # None = no clipping (the norm is still logged)
    # fp16 loss scaling (flowgrpo.run.loss_scale): none | dynamic (torch's GradScaler in the optimizer step)
    loss_scale: LossScaleConfig = Field(default_factory=LossScaleConfig)


class RatioCheckConfig(StrictModel):
    """The live on-policy check: the first pass over a fresh batch must give ratio 1."""

    enabled: bool = True
    tolerance: float = Field(1e-4, gt=0)


class CheckpointConfig(StrictModel):
    every: int = Field(10, ge=0)  # steps between checkpoints; 0 = only at the end (and on SIGINT / SIGTERM)
    keep_last: int = Field(2, ge=1)
    dir: Optional[str] = None  # default: <output_dir>/checkpoints
    save_final_model: bool = True  # the trained weights in their library's format at the end


class EMAConfig(StrictModel):
    """The EMA of the trained weights (used for evaluation and the saved `lora_ema/`).

    schedule "constant": after optimizer steps k = update_every, 2 update_every, ... one update at `decay`
    (diffusers' EMAModel: its first update copies the weights). "flow_grpo": Flow-GRPO's EMAModuleWrapper (also
    in TempFlow-GRPO, TP-GRPO, Adv-GRPO, DiffusionNFT), called with the trainer's global step g after every
    training batch: an update when (g + 1) % update_every == 0, at decay min((1 + g) / (10 + g), decay).
    """

    enabled: bool = True
    decay: float = Field(0.9, ge=0, le=1)
    update_every: int = Field(1, ge=1)  # optimizer steps between EMA updates
    schedule: Literal["constant", "flow_grpo"] = "constant"
    # "flow_grpo": EMA calls per optimizer step, one per training batch it accumulates (Flow-GRPO's
    # gradient_accumulation_steps; 1 where the trainer calls it only after the step, as DiffusionNFT does)
    updates_per_step: int = Field(1, ge=1)
    # Iterations without a policy update advance the EMA's step count (Adv-GRPO's global_step += 1 on every
    # discriminator epoch)
    count_idle_iterations: bool = False

    @model_validator(mode="after")
    def _schedule_settings(self) -> "EMAConfig":
        if self.schedule == "constant" and (self.updates_per_step != 1 or self.count_idle_iterations):
            raise ValueError(
                "ema: updates_per_step and count_idle_iterations replay Flow-GRPO's EMA calls; set schedule: flow_grpo"
            )
        return self
