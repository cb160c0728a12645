"""Pairwise preference from a pointwise scorer, and group win rates from any pairwise scorer.

pointwise_as_pairwise: P(a beats b) = sigmoid((s_a - s_b) / temperature). With PickScore and
temperature 1 this is the model's own two-way softmax over its exp(logit_scale)-scaled scores
(the model card's preference probability). A NaN score on either side gives NaN, not a tie.

Group win rates (Pref-GRPO): preference_matrix judges all G(G-1)/2 unordered pairs (i < j, image
i shown first) of one prompt's group in one call of the pairwise scorer, so a remote judge sends
them concurrently, and fills P[i, j] = p, P[j, i] = 1 - p. win_rates gives
w_i = (wins_i + 0.5 ties_i) / (G - 1) = sum_{j != i} P[i, j] / (G - 1), where a NaN verdict (could
not judge) counts as a tie, as flowgrpo.core's "win_rate" estimator does with the same matrix
(GroupBatch.preferences [P, G, G]); count the NaNs from the matrix to log them.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch

from .base import PairwiseScorer, Scorer
from .images import ImageBatch
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
def build_pointwise_as_pairwise(
    *, scorer: "str | Mapping[str, Any] | ScorerConfig", temperature: float = 1.0, batch_size: int = 64
) -> PointwiseAsPairwise:
    """sigmoid((s_a - s_b) / temperature) over any pointwise scorer."""
    inner = build_scorer(scorer)
    if not isinstance(inner, Scorer):
        raise TypeError("pointwise_as_pairwise needs a pointwise scorer")
    return PointwiseAsPairwise(inner, temperature=temperature, batch_size=batch_size)


def preference_matrices(
    judge: PairwiseScorer,
    groups: Sequence,
    prompts: Sequence[str | None] | None = None,
    metadata: Sequence[Mapping[str, Any] | None] | None = None,
) -> list[torch.Tensor]:
    """One [G_k, G_k] float32 matrix per group: P[i, j] = P(image i beats image j), diagonal NaN.
    All unordered pairs of all groups go to the judge in one call (a remote judge sends them
    concurrently). `metadata[k]` holds one value per key for group k."""
    n_groups = len(groups)
    prompts = [None] * n_groups if prompts is None else list(prompts)
    metadata = [None] * n_groups if metadata is None else list(metadata)
    if len(prompts) != n_groups or len(metadata) != n_groups:
        raise ValueError(f"{n_groups} groups but {len(prompts)} prompts and {len(metadata)} metadata entries")
    if any(p is None for p in prompts) and any(p is not None for p in prompts):
        raise ValueError("give a prompt for every group or for none")
    keys = sorted({k for m in metadata if m for k in m})
    a, b, pair_prompts, pair_meta, index = [], [], [], {k: [] for k in keys}, []
    sizes = []
    for k, (images, prompt, meta) in enumerate(zip(groups, prompts, metadata)):
        batch = ImageBatch.of(images)
        g = len(batch)
        sizes.append(g)
        items = list(images.unbind(0)) if isinstance(images, torch.Tensor) else batch.pil()
        for i in range(g):
            for j in range(i + 1, g):
                a.append(items[i])
                b.append(items[j])
                pair_prompts.append(prompt)
                for key in keys:
                    pair_meta[key].append((meta or {}).get(key))
                index.append((k, i, j))
    out = [torch.full((g, g), float("nan")) for g in sizes]
    if not index:
        return out
    if all(isinstance(x, torch.Tensor) for x in a + b) and len({tuple(x.shape) for x in a + b}) == 1:
        a, b = torch.stack(a), torch.stack(b)
    else:  # PIL groups, or tensor groups of different sizes
        a, b = [_pil(x) for x in a], [_pil(x) for x in b]
    p = judge(a, b, None if pair_prompts[0] is None else pair_prompts, pair_meta or None).detach().float().cpu()
    for (k, i, j), value in zip(index, p.tolist()):
        out[k][i, j] = value
        out[k][j, i] = 1.0 - value  # NaN stays NaN
    return out


def _pil(image):
    return image if not isinstance(image, torch.Tensor) else ImageBatch(image[None]).pil()[0]


def preference_matrix(
    judge: PairwiseScorer, images, prompt: str | None = None, metadata: Mapping[str, Any] | None = None
) -> torch.Tensor:
    """[G, G] float32 for one group; see preference_matrices."""
    return preference_matrices(judge, [images], [prompt], [metadata])[0]


def win_rates(preferences: torch.Tensor) -> torch.Tensor:
    """[..., G, G] -> [..., G]: (wins + 0.5 ties) / (G - 1); NaN verdicts off the diagonal count
    as ties; the diagonal is ignored."""
    g = preferences.shape[-1]
    if preferences.shape[-2] != g or g < 2:
        raise ValueError(f"preferences must be [..., G, G] with G >= 2, got {tuple(preferences.shape)}")
    off = ~torch.eye(g, dtype=torch.bool, device=preferences.device)
    pref = torch.where(torch.isnan(preferences), torch.full_like(preferences, 0.5), preferences.float())
    return torch.where(off, pref, torch.zeros_like(pref)).sum(-1) / (g - 1)


def group_win_rates(
    judge: PairwiseScorer, images, prompt: str | None = None, metadata: Mapping[str, Any] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Judge every unordered pair of one group: (win rates [G], preference matrix [G, G])."""
    pref = preference_matrix(judge, images, prompt, metadata)
    return win_rates(pref), pref


def groups_win_rates(
    judge: PairwiseScorer,
    groups: Sequence,
    prompts: Sequence[str | None] | None = None,
    metadata: Sequence[Mapping[str, Any] | None] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """P groups of equal size G in one judge call: (win rates [P, G], preferences [P, G, G]), the
    preferences in the layout of flowgrpo.core's GroupBatch.preferences."""
    prefs = preference_matrices(judge, groups, prompts, metadata)
    if len({m.shape for m in prefs}) > 1:
        raise ValueError(f"groups differ in size {[m.shape[0] for m in prefs]}; use preference_matrices")
    stacked = torch.stack(prefs)
    return win_rates(stacked), stacked
