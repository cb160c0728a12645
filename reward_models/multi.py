"""MultiReward: several scorers, their weights, and every per-reward output kept.

The output holds each scorer's keys unchanged (for logging, and for per-reward normalisation as in
GDPO / Pref-GRPO, which normalise each reward over the group before weighting) plus
'total' = sum_i weight_i * main score_i (Flow-GRPO's multi_score, weighted before normalisation).
A NaN in any weighted score makes the total NaN: the sample could not be fully scored. Weight 0
keeps a reward for logging only; it never enters the total.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch

from .base import Scorer
from .images import ImageBatch
from .registry import build_scorer, register

TOTAL = "total"


class MultiReward(Scorer):
    name = "multi"

    def __init__(self, scorers: Sequence[tuple[Scorer, float]]):
        super().__init__(batch_size=1, key=TOTAL)  # children batch themselves
        if not scorers:
            raise ValueError("MultiReward needs at least one scorer")
        keys = [s.key for s, _ in scorers]
        dupes = sorted({k for k in keys if keys.count(k) > 1})
        if dupes:
            raise ValueError(f"two rewards share the key(s) {dupes}; give one of them a distinct 'key' setting")
        if TOTAL in keys:
            raise ValueError(f"'{TOTAL}' is reserved for the weighted sum; set another 'key'")
        self.scorers = [(s, float(w)) for s, w in scorers]
        self.requires_prompts = any(s.requires_prompts for s, _ in scorers)
        self.metadata_keys = tuple(dict.fromkeys(k for s, _ in scorers for k in s.metadata_keys))
        self.differentiable = all(s.differentiable for s, w in scorers if w != 0)

    @property
    def weights(self) -> dict[str, float]:
        """Main output key -> weight (per-reward advantages use these)."""
        return {s.key: w for s, w in self.scorers}

    def __call__(self, images, prompts=None, metadata=None) -> dict[str, torch.Tensor]:
        batch = ImageBatch.of(images)  # one batch object: PIL conversions are shared by all scorers
        out: dict[str, torch.Tensor] = {}
        total = None
        for scorer, weight in self.scorers:
            result = scorer(batch, prompts, metadata)
            out.update(result)
            if weight != 0:
                term = weight * result[scorer.key].to(batch.device)
                total = term if total is None else total + term
        if total is None:
            total = torch.zeros(len(batch), device=batch.device)
        out[TOTAL] = total
        self.counters["calls"] += 1
        self.counters["images"] += len(batch)
        self.counters["nan"] += int(torch.isnan(total.detach()).sum())
        return out

    def to(self, device=None, dtype=None):
        for s, _ in self.scorers:
            s.to(device, dtype)
        return self

    def close(self) -> None:
        for s, _ in self.scorers:
            s.close()


@register("multi")
def build_multi(*, rewards: Sequence[Mapping[str, Any]]) -> MultiReward:
    """Weighted rewards: rewards=[{"name": ..., "weight": 1.0, **settings}, ...]."""
    scorers = []
    for cfg in rewards:
        cfg = dict(cfg)
        weight = cfg.pop("weight", 1.0)
        scorer = build_scorer(cfg)
        if not isinstance(scorer, Scorer):
            raise TypeError(f"multi: '{cfg.get('name')}' is not a pointwise scorer")
        scorers.append((scorer, weight))
    return MultiReward(scorers)
