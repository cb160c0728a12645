"""The shared advantage core: pure torch, no model library.

batch = GroupBatch(rewards=r)                                    # [P, G] or [P, G, K]
adv = compute_advantages(batch, AdvantageConfig(estimator="grpo"))
out = policy_loss(LossInputs(logp, logp_old, adv_per_row, mask), LossConfig(preset="dapo"))
"""

from . import etr, real, rover, thr  # noqa: F401  (register the ETR, REAL, ROVER and THR parts)
from .advantages import ESTIMATORS
from .config import AdvantageConfig, KLSpec, LossConfig, PartSpec, StrictModel
from .contracts import AdvantageResult, GroupBatch, TreeStructure
from .gaussian import gaussian_logprob, mean_sqdist
from .losses import (
    AGGREGATIONS,
    BOUNDS,
    KL_ESTIMATORS,
    PRESETS,
    RATIOS,
    STEP_WEIGHTINGS,
    SURROGATES,
    LossInputs,
    LossNormalizer,
    LossOutput,
    guard_log_ratio,
)
from .recipes import RECIPES
from .registry import Registry, UnknownNameError
from .regularizers import REGULARIZERS
from .stages import compute_advantages, policy_loss
from .transforms import TRANSFORMS

__all__ = [
    "AGGREGATIONS",
    "BOUNDS",
    "ESTIMATORS",
    "KL_ESTIMATORS",
    "PRESETS",
    "RATIOS",
    "RECIPES",
    "REGULARIZERS",
    "STEP_WEIGHTINGS",
    "SURROGATES",
    "TRANSFORMS",
    "AdvantageConfig",
    "AdvantageResult",
    "GroupBatch",
    "KLSpec",
    "LossConfig",
    "LossInputs",
    "LossNormalizer",
    "LossOutput",
    "PartSpec",
    "Registry",
    "StrictModel",
    "TreeStructure",
    "UnknownNameError",
    "compute_advantages",
    "gaussian_logprob",
    "guard_log_ratio",
    "mean_sqdist",
    "policy_loss",
]
