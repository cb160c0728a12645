"""method: grpo - the clipped policy objective over the trained edges of a rollout (every GRPO-family recipe).

credit.assign_credit gives one advantage per trained edge; then `train.inner_epochs` passes x
`train.mini_batches` optimizer steps in a seeded order. Each mini-batch has ONE global loss normaliser and
accumulates micro-batches: the edges are re-scored under the current weights (sampler.rescore) and
flowgrpo.core.policy_loss is back-propagated. The first pass is scored by the weights that sampled the
rollout, so it is the on-policy check.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from ..core import LossNormalizer
from ..core.advantages import ESTIMATORS
from ..metrics import LossMetrics
from ..run.ratio_check import FirstPassCheck
from .credit import assign_credit
from .methods import METHODS, Method, ScoredRollout
from .objectives import EdgeBatch, EdgeObjective, edge_batch

if TYPE_CHECKING:
    from .config import T2IConfig
    from .trainer import T2ITrainer

SUSPECTS = (
    "Rollout and training compute different transitions (precision, batch-dependent kernels, a CFG "
    "or scheduler mismatch?)"
)


def edge_order(n: int, seed: int, step: int, epoch: int, shuffle: bool) -> torch.Tensor:
    """The order of the n trained edges in pass `epoch` of training step `step` (seeded, resumable)."""
    if not shuffle:
        return torch.arange(n)
    g = torch.Generator().manual_seed(seed * 1_000_003 + step * 1009 + epoch)
    return torch.randperm(n, generator=g)


@METHODS.register("grpo")
class GRPOMethod(Method):
    """Flow-GRPO's clipped surrogate (any flowgrpo.core loss preset) over re-scored edges."""

    per_sample_steps = True

    def __init__(self, trainer: T2ITrainer) -> None:
        super().__init__(trainer)
        self.objective = EdgeObjective(trainer.sampler, trainer.cfg.loss, trainer.reference)

    @staticmethod
    def needs_reference(cfg: T2IConfig) -> bool:
        return cfg.loss.kl.coef != 0

    @staticmethod
    def check_config(cfg: T2IConfig) -> None:
        """A plan whose rewards only some estimators read (their registered `plan`) trains with one of them."""
        est, plan = cfg.advantage.estimator.name, cfg.plan.name
        readers = [n for n in ESTIMATORS.names() if ESTIMATORS.get(n).plan == plan]
        if readers and ESTIMATORS.get(est).plan != plan:
            kind = "node-level" if plan == "tree" else "per-step"
            raise ValueError(f"plan '{plan}' needs the {kind} estimator {' or '.join(map(repr, readers))}, not '{est}'")

    def update(self, rollout: ScoredRollout, record: dict[str, Any]) -> None:
        t = self.trainer
        credit = assign_credit(
            rollout.global_tree, rollout.leaf_values, rollout.probe_values, rollout.preferences, t.cfg, t.step
        )
        record.update(credit.metrics)
        cfg, tree = t.cfg, rollout.tree
        E = credit.edges.numel()
        metrics = LossMetrics()
        check = FirstPassCheck(cfg.ratio_check.enabled, cfg.ratio_check.tolerance)
        on_policy, backwards, padding = True, 0, 0
        pad: EdgeBatch | None = None  # a sharded run's padding edge, found the first time one is needed
        for epoch in range(cfg.train.inner_epochs):
            order = edge_order(E, cfg.seed, t.step, epoch, cfg.train.shuffle)
            for mini in order.chunk(cfg.train.mini_batches) if E else []:
                mine, local_ids = t.dist.localize(credit.edges[mini], rollout.nodes_per_chunk)
                part = edge_batch(tree, local_ids, credit.advantages[mini][mine], credit.weights[mini][mine])
                norm = t.dist.reduce_normalizer(LossNormalizer.from_inputs(part.inputs()))
                micros = torch.arange(local_ids.numel()).split(cfg.train.micro_batch_size)
                for _ in range(t.dist.passes_to_pad(len(micros))):  # sharded: as many passes as the busiest rank
                    pad = pad if pad is not None else self._padding_batch(t, credit, rollout)
                    t.optimizer_step.backward(
                        self.objective(t.adapter, tree, pad, rollout.prompts, norm).output.loss.mul(0.0)
                    )
                    padding += 1
                for micro in micros:
                    rows = part.rows(micro)
                    edge_loss = self.objective(t.adapter, tree, rows, rollout.prompts, norm)
                    if on_policy:
                        dev = ((edge_loss.logp.float().cpu() - rows.logp_old).exp() - 1).abs().max()
                        check.observe(float(dev), micro.numel())
                    t.optimizer_step.backward(edge_loss.output.loss)
                    backwards += 1
                    metrics.add(edge_loss.output.metrics, micro.numel())
                t.optimizer_step()
                on_policy = False
        if t.dist.active:  # every rank's micro-batches, so the record describes the global batch
            metrics = LossMetrics.merged(t.dist.gather_objects([metrics]))
            check.reduce(t.dist)
        record.update(metrics.result(len(t.optimizer_step.norms)))
        record["backward_passes"] = backwards  # this rank's; the trainer sums the counts over ranks
        if t.dist.lockstep:
            record["padding_passes"] = padding
        check.report(record, f"iteration {t.step + 1}", SUSPECTS)

    @staticmethod
    def _padding_batch(t: T2ITrainer, credit: Any, rollout: ScoredRollout) -> EdgeBatch:
        """A sharded run's padding pass: the first trained edge this rank owns (a transition with a finite
        log-prob), with zero advantage and weight."""
        _, own = t.dist.localize(credit.edges, rollout.nodes_per_chunk)
        if own.numel() == 0:
            raise RuntimeError(f"rank {t.dist.rank} holds no trained edge this iteration; nothing to pad with")
        zero = torch.zeros(1)
        return edge_batch(rollout.tree, own[:1], zero, zero)
