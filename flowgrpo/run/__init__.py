"""What both trainers share: the run loop, the optimizer step, the on-policy check, prompt order, configs.

loop         RunLoop: process setup, when to checkpoint (flowgrpo.checkpoint saves and resumes), metrics.jsonl,
             progress, evaluation hooks, the non-finite guard's verdict per step, SIGINT / SIGTERM (finish the step,
             save, stop)
optim        AdamW + LR schedule (ScheduledOptimizer); OptimizerStep (all-reduce, clip, skip a NaN / inf gradient, step, EMA)
ema          ScheduledEMA: the EMA of the trained weights on its configured schedule
ratio_check  FirstPassCheck and OnPolicyRatioWarning
prompts      PromptSampler (seeded epochs, resumable)
config       OptimConfig, CheckpointConfig, RatioCheckConfig, EMAConfig
"""

from ..checkpoint import CheckpointParts
from .config import CheckpointConfig, EMAConfig, OptimConfig, RatioCheckConfig
from .ema import ScheduledEMA, build_ema, flow_grpo_decay
from .loop import RunLoop
from .optim import OptimizerStep, ScheduledOptimizer, build_optimizer, lr_factor
from .prompts import PromptOrderError, PromptSampler
from .ratio_check import FirstPassCheck, OnPolicyRatioWarning

__all__ = [
    "CheckpointConfig", "CheckpointParts", "EMAConfig", "FirstPassCheck", "OnPolicyRatioWarning", "OptimConfig",
    "OptimizerStep", "PromptOrderError", "PromptSampler", "RatioCheckConfig", "RunLoop", "ScheduledEMA",
    "ScheduledOptimizer", "build_ema", "build_optimizer", "flow_grpo_decay", "lr_factor",
]  # fmt: skip
