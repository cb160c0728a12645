"""Loss of a micro-batch of trained edges: re-score under the current weights, then flowgrpo.core.policy_loss.

Each edge (one denoising transition) is one action: LossInputs rows are edges, [M, 1]. The reference
(KL) and the rollout-time mean (GRPO-Guard) enter as mean-square distances of transition means.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import Tensor

from ..core import LossConfig, LossInputs, LossNormalizer, LossOutput, mean_sqdist, policy_loss
from ..core.losses import KL_ESTIMATORS, RATIOS, SURROGATES


def reads_old_means(loss: LossConfig) -> bool:
    """Whether the configured ratio or surrogate reads the rollout-time transition means (GRPO-Guard's ratio_norm,
    Flow-DPPO's trust region): the sampler then keeps them and the objective hands them to the loss."""
    parts = (RATIOS.get(loss.ratio.name), SURROGATES.get(loss.surrogate.name))
    return any("mean_sqdist_old" in p.requires for p in parts)


@dataclass
class EdgeBatch:
    """The trained edges of one rollout batch, with what the loss needs (all [E])."""

    edges: Tensor
    advantages: Tensor
    weights: Tensor
    logp_old: Tensor
    std: Tensor
    dt: Tensor

    def rows(self, index: Tensor) -> "EdgeBatch":
        return EdgeBatch(
            *(getattr(self, f)[index] for f in ("edges", "advantages", "weights", "logp_old", "std", "dt"))
        )

    def inputs(self, logp: Optional[Tensor] = None, **extra) -> LossInputs:
        n = self.edges.numel()
        dev = self.advantages.device
        return LossInputs(
            logp=(torch.zeros(n, 1, device=dev) if logp is None else logp.view(n, 1)),
            logp_old=self.logp_old.view(n, 1),
            advantages=self.advantages,
            mask=torch.ones(n, 1, dtype=torch.bool, device=dev),
            sample_weight=self.weights,
            std=self.std.view(n, 1),
            dt=self.dt.view(n, 1),
            **{k: v.view(n, 1) for k, v in extra.items() if v is not None},
        )


def step_sizes(tree, edges: Tensor) -> Tensor:
    """sigma_i - sigma_{i+1} of each edge's step (flow schedules); 1 for DDIM (no inv_dt weighting there)."""
    schedule = tree.schedule
    steps = tree.edge_step[edges]
    if hasattr(schedule, "sigmas"):
        s = schedule.sigmas.float().cpu()
        return s[steps] - s[steps + 1]
    return torch.ones(steps.shape)


def edge_batch(tree, edges: Tensor, advantages: Tensor, weights: Tensor) -> EdgeBatch:
    return EdgeBatch(
        edges,
        advantages.float(),
        weights.float(),
        tree.edge_logp[edges].float(),
        tree.edge_std[edges].float(),
        step_sizes(tree, edges).float(),
    )


@dataclass(frozen=True)
class EdgeLoss:
    """The loss of a micro-batch of edges and the log-probs it re-scored them to."""

    output: LossOutput  # policy_loss's result (loss to back-propagate, per-action terms, metrics)
    logp: Tensor  # [M] log-probs of the edges under the current weights, detached (the on-policy check)


class EdgeObjective:
    """policy_loss over edges; `reference` is a context manager giving the KL reference policy."""

    def __init__(self, sampler, loss: LossConfig, reference: Optional[Callable] = None):
        self.sampler = sampler
        self.loss = loss
        self.reference = reference
        self.needs_old_mean = reads_old_means(loss)
        # closed-form estimators (gaussian, flow_grpo) read the reference mean; k1-k3 its log-prob
        self.kl_closed_form = loss.kl.coef != 0 and "mean_sqdist_ref" in KL_ESTIMATORS.get(loss.kl.estimator).requires
        self.kl_logp = loss.kl.coef != 0 and not self.kl_closed_form

    def __call__(self, adapter, tree, batch: EdgeBatch, prompts: list[str], norm: LossNormalizer) -> EdgeLoss:
        """Re-score the edges of `batch` under `adapter` and their policy loss."""
        edges = batch.edges
        out = self.sampler.rescore(adapter, tree, edges, prompts)
        extra: dict[str, Optional[Tensor]] = {}
        if self.needs_old_mean:
            extra["mean_sqdist_old"] = mean_sqdist(out.mean, tree.edge_mean[edges].to(out.mean.device))
        if self.kl_closed_form or self.kl_logp:
            with torch.no_grad(), self.reference() as ref:
                ref_out = self.sampler.rescore(ref, tree, edges, prompts)
            if self.kl_closed_form:
                extra["mean_sqdist_ref"] = mean_sqdist(out.mean, ref_out.mean)
            else:
                extra["logp_ref"] = ref_out.logp.float()
        dev = out.logp.device
        moved = EdgeBatch(
            *(getattr(batch, f).to(dev) for f in ("edges", "advantages", "weights", "logp_old", "std", "dt"))
        )
        inputs = moved.inputs(out.logp.float(), **extra)
        return EdgeLoss(policy_loss(inputs, self.loss, norm), out.logp.detach())
