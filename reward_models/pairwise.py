"""Pairwise preference from a pointwise scorer: P(a beats b) = sigmoid((s_a - s_b) / temperature).

With PickScore and temperature 1 this is the model's own two-way softmax over its
exp(logit_scale)-scaled scores (the model card's preference probability). A NaN score on either
side gives NaN, not a tie.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from .base import PairwiseScorer, Scorer
from .registry import ScorerConfig, build_scorer, register


class PointwiseAsPairwise(PairwiseScorer):
    name = "pointwise_as_pairwise"

    def __init__(self, scorer: Scorer, *, temperature: float = 1.0, batch_size: int = 64):
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        super().__init__(batch_size=batch_size)
        self.scorer, self.temperature = scorer, float(temperature)
        self.requires_prompts = scorer.requires_prompts
        self.metadata_keys = scorer.metadata_keys

    def compare_batch(self, a, b, prompts, metadata):
        s_a = self.scorer(a, prompts, metadata)[self.scorer.key]
        s_b = self.scorer(b, prompts, metadata)[self.scorer.key]
        return torch.sigmoid((s_a - s_b.to(s_a.device)) / self.temperature)

    def close(self) -> None:
        self.scorer.close()


@register("pointwise_as_pairwise", kind="pairwise")
def build_pointwise_as_pairwise(*, scorer: "str | Mapping[str, Any] | ScorerConfig", temperature: float = 1.0,
                                batch_size: int = 64) -> PointwiseAsPairwise:
    """sigmoid((s_a - s_b) / temperature) over any pointwise scorer."""
    inner = build_scorer(scorer)
    if not isinstance(inner, Scorer):
        raise TypeError("pointwise_as_pairwise needs a pointwise scorer")
    return PointwiseAsPairwise(inner, temperature=temperature, batch_size=batch_size)
