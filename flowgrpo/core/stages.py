"""The two stages a trainer calls: rewards -> advantages (`compute_advantages`), and the policy loss of a
(micro-)batch (`policy_loss`). Each reads its config and runs the registered parts it names.

This module sits above the registries (advantages, transforms, losses) and the configs that check names
against them, so none of those imports another in a circle.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional

import torch
from torch import Tensor

from .advantages import ESTIMATORS, advantage_metrics, reward_metrics
from .config import AdvantageConfig, LossConfig
from .contracts import AdvantageResult, GroupBatch, given
from .losses import (
    AGGREGATIONS,
    BOUNDS,
    KL_ESTIMATORS,
    RATIOS,
    STEP_WEIGHTINGS,
    SURROGATES,
    LossContext,
    LossInputs,
    LossNormalizer,
    LossOutput,
    mean_over_mask,
    ratio_metrics,
)
from .registry import Entry
from .regularizers import REGULARIZERS
from .transforms import TRANSFORMS


def compute_advantages(batch: GroupBatch, config: AdvantageConfig | None = None) -> AdvantageResult:
    """Run the configured estimator and transforms on a batch, and measure what happened."""
    config = config or AdvantageConfig()
    if batch.head_nan_policy != config.head_nan_policy:
        batch = replace(batch, head_nan_policy=config.head_nan_policy)
    entry = ESTIMATORS.get(config.estimator.name)
    transforms = [(TRANSFORMS.get(spec.name), spec.settings) for spec in config.transforms]
    for part, slot in [(entry, "advantage estimator"), *((t, "advantage transform") for t, _ in transforms)]:
        for need in part.requires:
            if getattr(batch, need) is None:
                raise ValueError(f"{slot} '{part.name}' needs GroupBatch.{need}, which is missing")
    result: AdvantageResult = entry.fn(batch, **config.estimator.settings)
    for transform, settings in transforms:
        result = transform.fn(result, batch, **settings)
    if batch.prompt_state is not None and batch.prompt_ids is not None:  # the prompt samplers' statistics
        r = batch.scalar_rewards()
        batch.prompt_state.observe(batch.prompt_ids, r, batch.usable(r), batch.step or 0)
    result.metrics.update(reward_metrics(batch))
    result.metrics.update(advantage_metrics(result))
    return result


def _check_requires(entry: Entry, inputs: LossInputs, slot: str) -> None:
    for need in entry.requires:
        if getattr(inputs, need) is None:
            raise ValueError(f"{slot} '{entry.name}' needs LossInputs.{need}, which is missing")


def policy_loss(
    inputs: LossInputs, config: Optional[LossConfig] = None, norm: Optional[LossNormalizer] = None
) -> LossOutput:
    """The configured policy loss of one (micro-)batch, its per-action terms and metrics.

    Pass the `norm` of the whole optimisation batch when the batch is split into micro-batches.
    """
    config = config or LossConfig()
    norm = norm or LossNormalizer.from_inputs(inputs)
    parts = {
        "ratio": RATIOS.get(config.ratio.name),
        "bounds": BOUNDS.get(config.bounds.name),
        "surrogate": SURROGATES.get(config.surrogate.name),
        "step weighting": STEP_WEIGHTINGS.get(config.step_weighting.name),
        "aggregation": AGGREGATIONS.get(config.aggregation.name),
        "regularizer": REGULARIZERS.get(config.regularizer.name),
    }
    kl_entry = KL_ESTIMATORS.get(config.kl.estimator) if config.kl.coef else None
    for slot, entry in parts.items():
        _check_requires(entry, inputs, slot)
    if kl_entry is not None:
        _check_requires(kl_entry, inputs, "KL estimator")
    if config.entropy_coef and inputs.entropy is None:
        raise ValueError("entropy_coef is set but LossInputs.entropy is missing")

    ctx = LossContext(inputs, norm, inputs.logp.float() - inputs.logp_old.float(), config.log_ratio_clamp)
    ctx.ratio = parts["ratio"].fn(ctx, **config.ratio.settings)
    ctx.low, ctx.high = parts["bounds"].fn(ctx, **config.bounds.settings)
    per_action = parts["surrogate"].fn(ctx, **config.surrogate.settings)
    weight = parts["step weighting"].fn(ctx, **config.step_weighting.settings)
    if inputs.sample_weight is not None:
        weight = inputs.sample_weight * weight
    per_action = per_action * weight

    def aggregate(values: Tensor) -> Tensor:
        out: Tensor = parts["aggregation"].fn(values, ctx, **config.aggregation.settings)
        return out

    # metrics as 0-dim tensors, read in one transfer at the end (one device sync per call, not one per metric)
    values = {"loss/policy": aggregate(per_action.detach())}
    m = inputs.mask
    if kl_entry is not None:
        kl = kl_entry.fn(ctx)
        per_action = per_action + config.kl.coef * kl
        values["kl/ref_mean"] = mean_over_mask(kl.detach(), m)
    if config.regularizer.name != "none":
        reg = parts["regularizer"].fn(ctx, **config.regularizer.settings)
        per_action = per_action + reg
        values[f"reg/{config.regularizer.name}_mean"] = mean_over_mask(reg.detach(), m)
    if config.entropy_coef:
        entropy = given(inputs.entropy, "LossInputs.entropy")
        per_action = per_action - config.entropy_coef * entropy
        values["entropy/mean"] = mean_over_mask(entropy.detach(), m)
    loss = aggregate(per_action)
    values.update(ratio_metrics(ctx))
    values["loss/total"] = loss.detach()
    numbers = torch.stack([v.reshape(()).float() for v in values.values()]).tolist()
    metrics = dict(zip(values, numbers))
    return LossOutput(loss, torch.where(m, per_action, torch.zeros_like(per_action)), metrics)
