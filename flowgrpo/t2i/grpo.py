"""method: grpo - the clipped policy objective over the trained edges of a rollout (every GRPO-family recipe).

credit.assign_credit gives one advantage per trained edge; then `train.inner_epochs` passes x
`train.mini_batches` optimizer steps in a seeded order (the shared update loop, flowgrpo.run.update). Each
mini-batch has ONE global loss normaliser and accumulates micro-batches: the edges are re-scored under the
current weights (sampler.rescore) and flowgrpo.core.policy_loss is back-propagated. The first pass is scored
by the weights that sampled the rollout, so it is the on-policy check.
"""

from __future__ import annotations

from typing import Any, Iterator

import torch

from ..core import LossNormalizer
from ..run.ratio_check import FirstPassCheck
from ..run.update import MiniBatch, MicroLoss, pass_order, record_update, run_update
from .credit import Credit, assign_credit
from .methods import METHODS, ImageContext, ImageMethod, ScoredRollout
from .objectives import EdgeBatch, EdgeObjective, edge_batch

SUSPECTS = (
    "Rollout and training compute different transitions (precision, batch-dependent kernels, a CFG "
    "or scheduler mismatch?)"
)


@METHODS.register("grpo")
class GRPOMethod(ImageMethod):
    """Flow-GRPO's clipped surrogate (any flowgrpo.core loss preset) over re-scored edges."""

    per_sample_steps = True

    def __init__(self, ctx: ImageContext) -> None:
        super().__init__(ctx)
        self.objective = EdgeObjective(ctx.sampler, ctx.cfg.loss, ctx.reference)

    @staticmethod
    def needs_reference(cfg: Any) -> bool:
        return cfg.loss.kl.coef != 0

    def update(self, rollout: ScoredRollout, record: dict[str, Any]) -> None:
        ctx, cfg = self.ctx, self.ctx.cfg
        credit = self.assign(rollout)
        record.update(credit.metrics)
        pad: list[EdgeBatch] = []  # a sharded run's padding edge, found the first time one is needed

        def micro_loss(rows: EdgeBatch, norm: LossNormalizer, on_policy: bool) -> MicroLoss:
            edge_loss = self.objective(ctx.adapter, rollout.tree, rows, rollout.prompts, norm)
            dev = None
            if on_policy:
                dev = (
                    float(((edge_loss.logp.float().cpu() - rows.logp_old).exp() - 1).abs().max()),
                    rows.edges.numel(),
                )
            return MicroLoss(edge_loss.output.loss, edge_loss.output.metrics, rows.edges.numel(), dev)

        def padding_loss(norm: LossNormalizer) -> torch.Tensor:
            if not pad:
                pad.append(self._padding_batch(credit, rollout))
            return self.objective(ctx.adapter, rollout.tree, pad[0], rollout.prompts, norm).output.loss

        check = FirstPassCheck(cfg.ratio_check.enabled, cfg.ratio_check.tolerance)
        result = run_update(
            self._passes(credit, rollout), micro_loss, padding_loss, ctx.optimizer_step, ctx.dist, check
        )
        record_update(record, result, len(ctx.optimizer_step.norms), ctx.dist.lockstep)
        check.report(record, f"iteration {ctx.iteration + 1}", SUSPECTS)

    def assign(self, rollout: ScoredRollout) -> Credit:
        """One advantage per trained edge (GARDO's plug-in overrides it: flowgrpo/t2i/gardo_methods.py)."""
        return assign_credit(
            rollout.global_tree, rollout.leaf_values, rollout.probe_values, rollout.preferences, self.ctx.cfg,
            self.ctx.iteration, rollout.prompt_ids, rollout.prompt_state,
        )  # fmt: skip

    def _passes(self, credit: Credit, rollout: ScoredRollout) -> Iterator[Iterator[MiniBatch]]:
        """Per inner epoch, its mini-batches: this rank's edges, one global normaliser, micro-batches of edges."""
        cfg, dist = self.ctx.cfg, self.ctx.dist
        E = credit.edges.numel()

        def minis(epoch: int) -> Iterator[MiniBatch]:
            order = pass_order(E, cfg.seed, self.ctx.iteration, epoch, cfg.train.shuffle)
            for mini in order.chunk(cfg.train.mini_batches) if E else []:
                mine, local_ids = dist.localize(credit.edges[mini], rollout.nodes_per_chunk)
                part = edge_batch(rollout.tree, local_ids, credit.advantages[mini][mine], credit.weights[mini][mine])
                norm = dist.reduce_normalizer(LossNormalizer.from_inputs(part.inputs()))
                micros = torch.arange(local_ids.numel()).split(cfg.train.micro_batch_size)
                yield MiniBatch([part.rows(m) for m in micros], norm)

        return (minis(epoch) for epoch in range(cfg.train.inner_epochs))

    def _padding_batch(self, credit: Credit, rollout: ScoredRollout) -> EdgeBatch:
        """A sharded run's padding pass: the first trained edge this rank owns (a transition with a finite
        log-prob), with zero advantage and weight."""
        _, own = self.ctx.dist.localize(credit.edges, rollout.nodes_per_chunk)
        if own.numel() == 0:
            raise RuntimeError(f"rank {self.ctx.dist.rank} holds no trained edge this iteration; nothing to pad with")
        zero = torch.zeros(1)
        return edge_batch(rollout.tree, own[:1], zero, zero)
