"""Additive regularisers of the policy loss (the `regularizer` slot of a LossConfig), by name.

Each is a per-action term added to the surrogate's loss as is (its strength `coef` is its own setting), before
the aggregation; like the KL term it is not multiplied by sample weights (a weight of 0 still removes the
action). Written from "Group-Relative REINFORCE Is Secretly an Off-Policy Algorithm" (Yao et al., 2025,
arXiv 2509.24203), as Trinity-RFT implements its REP family: yanxi-chen/Trinity-RFT @ 9051d63,
trinity/algorithm/policy_loss_fn/rec_policy_loss.py, `RECPolicyLossFn.__call__` (regularizer "k2" and
"forward-kl").
"""

from __future__ import annotations

from torch import Tensor

from .losses import LossContext
from .registry import Registry

REGULARIZERS = Registry("regularizer")


@REGULARIZERS.register("none")
def no_regularizer(ctx: LossContext) -> float:
    """No additive term."""
    return 0.0


@REGULARIZERS.register("opmd")
def opmd(ctx: LossContext, *, coef: float = 0.1) -> Tensor:
    """Kimi's OPMD (REP): coef * (log pi - log pi_old)^2 per action (Kimi's 1/2 is absorbed into coef, as in Trinity)."""
    return coef * ctx.raw_log_ratio**2


@REGULARIZERS.register("asymre")
def asymre(ctx: LossContext, *, coef: float = 0.1) -> Tensor:
    """Meta's AsymRE (REP): -coef * log pi per action, the sampled gradient of coef * KL(pi_old || pi)."""
    return -coef * ctx.inputs.logp
