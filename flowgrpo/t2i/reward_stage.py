"""The reward stage: decode latents and score them on worker threads, so scoring overlaps the next rollout (an
iteration's last batch is scored in the calling thread: nothing is left to overlap it with, and a thread handoff
there only adds latency: measured 0.4-0.6 points of the tiny recipes' time outside model calls).

A video run (`video=True`: a family whose decode gives clips [B, F, 3, H, W]) takes video scorers only (per_frame
wraps an image scorer; temporal_consistency, motion_magnitude); an image run takes image scorers only. A scorer of
the other kind is refused when the stage is built, before any model loads.

Pointwise scorers give one value per image. A pairwise scorer judges every pair of a prompt's group
(the final images only): its value for an image is its win rate (wins + half the ties and unreadable
verdicts, over G - 1), and the full preference matrix is kept for the `win_rate` estimator.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch

from .config import RewardConfig
from .monitor_config import GoldScorer


@dataclass
class Scored:
    values: torch.Tensor  # [n, K] float32, NaN = could not score
    preferences: Optional[torch.Tensor] = None  # [P, G, G] P(i beats j), leaves only
    extras: dict[str, float] = field(default_factory=dict)  # means of scorers' extra outputs
    seconds: float = 0.0
    calls: int = 0
    images: Optional[torch.Tensor] = None  # the final images [P * G, 3, H, W] when asked for (grids)


VIDEO_SCORERS = "per_frame, temporal_consistency, motion_magnitude"


def input_problem(name: str, scorer: Any, video: bool) -> Optional[str]:
    """Why `scorer` cannot score this run's samples (None: it can): clips need a video scorer, images an image one."""
    from reward_models.video import VideoScorer

    if video and not isinstance(scorer, VideoScorer):
        return (
            f"scorer '{name}' scores images [B, 3, H, W], but this model makes video clips [B, F, 3, H, W]: wrap it "
            f"as {{name: per_frame, reward: {{name: {name}}}}} (aggregate: mean | min | max | positive_mean) or use a video scorer "
            f"({VIDEO_SCORERS})"
        )
    if not video and isinstance(scorer, VideoScorer):
        return f"scorer '{name}' scores video clips [B, F, 3, H, W], but this model makes images: use an image scorer"
    return None


class InlineJob:
    """A reward job run by whoever first asks for its `result()` (a worker's error would surface there too)."""

    def __init__(self, fn: Callable[..., Scored], args: tuple) -> None:
        self._fn, self._args = fn, args
        self._result: Optional[Scored] = None

    def result(self) -> Scored:
        if self._result is None:
            self._result = self._fn(*self._args)
        return self._result


class RewardStage:
    def __init__(self, specs: Sequence[RewardConfig | GoldScorer], workers: int = 2, video: bool = False):
        from reward_models import build_scorer, get_entry

        self.specs = list(specs)
        self.labels = [s.label for s in self.specs]
        self.weights = [s.weight for s in self.specs]
        self.kinds = [get_entry(s.name).kind for s in self.specs]
        self.scorers = [build_scorer({"name": s.name, **s.settings}) for s in self.specs]
        for spec, scorer in zip(self.specs, self.scorers):
            if problem := input_problem(spec.name, scorer, video):
                for built in self.scorers:
                    built.close()
                raise ValueError(problem)
        self.pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="reward")

    @property
    def has_pairwise(self) -> bool:
        return "pairwise" in self.kinds

    def scorer(self, label: str):
        return self.scorers[self.labels.index(label)]

    def submit(
        self,
        decode: Callable[[torch.Tensor], torch.Tensor],
        latents: torch.Tensor,
        prompts: list[str],
        metadata: list[dict[str, Any]],
        group_size: int,
        num_leaves: int,
        keep_images: bool = False,
        inline: bool = False,
    ) -> Future | InlineJob:
        """Score `latents` (the first `num_leaves` are the final images, [P * G] in group order) on a worker
        thread; `inline`: in the thread that asks for the result, when it asks (a caller that would only wait for
        a worker: no thread handoff)."""
        args = (decode, latents, prompts, metadata, group_size, num_leaves, keep_images)
        return InlineJob(self._run, args) if inline else self.pool.submit(self._run, *args)

    def _run(self, decode, latents, prompts, metadata, group_size, num_leaves, keep_images) -> Scored:
        t0 = time.perf_counter()
        with torch.no_grad():
            images = decode(latents)
        scored = self.score(images, prompts, metadata, group_size, num_leaves, started=t0)
        if keep_images:
            scored.images = images[:num_leaves].float().cpu()
        return scored

    def score(
        self,
        images: torch.Tensor,
        prompts: list[str],
        metadata: list[dict[str, Any]],
        group_size: int,
        num_leaves: int,
        started: Optional[float] = None,
    ) -> Scored:
        t0 = started if started is not None else time.perf_counter()
        n = images.shape[0]
        keys = sorted({k for m in metadata for k in m})
        meta = {k: [m.get(k) for m in metadata] for k in keys}
        columns, prefs, extras, calls = [], None, {}, 0
        for label, kind, scorer in zip(self.labels, self.kinds, self.scorers):
            if kind == "pairwise":
                rate, prefs = self._pairwise(
                    scorer,
                    images[:num_leaves],
                    prompts[:num_leaves],
                    {k: v[:num_leaves] for k, v in meta.items()},
                    group_size,
                )
                col = torch.full((n,), float("nan"))
                col[:num_leaves] = rate
                calls += 1
            else:
                out = scorer(images, prompts, meta)
                calls += 1
                col = out[scorer.key].detach().float().cpu()
                for k, v in out.items():
                    if k != scorer.key:
                        v = v.detach().float()
                        extras[f"rewards/{label}/{k[len(scorer.key) + 1 :]}"] = (
                            float(v[torch.isfinite(v)].mean()) if bool(torch.isfinite(v).any()) else float("nan")
                        )
            columns.append(col)
        return Scored(torch.stack(columns, 1), prefs, extras, time.perf_counter() - t0, calls)

    @staticmethod
    def _pairwise(scorer, images, prompts, meta, G: int) -> tuple[torch.Tensor, torch.Tensor]:
        P = images.shape[0] // G
        i, j = torch.triu_indices(G, G, offset=1)
        rows_a = (torch.arange(P).unsqueeze(1) * G + i).reshape(-1)
        rows_b = (torch.arange(P).unsqueeze(1) * G + j).reshape(-1)
        p_ab = (
            scorer(
                images[rows_a],
                images[rows_b],
                [prompts[r] for r in rows_a.tolist()],
                {k: [v[r] for r in rows_a.tolist()] for k, v in meta.items()},
            )
            .detach()
            .float()
            .cpu()
        )
        prefs = torch.full((P, G, G), float("nan"))
        p_ab = p_ab.view(P, -1)
        prefs[:, i, j] = p_ab
        prefs[:, j, i] = 1 - p_ab
        filled = torch.where(torch.isnan(prefs), torch.full_like(prefs, 0.5), prefs)
        eye = torch.eye(G, dtype=torch.bool)
        wins = torch.where(eye, torch.zeros_like(filled), filled).sum(-1)
        return (wins / max(G - 1, 1)).reshape(-1), prefs

    def close(self) -> None:
        self.pool.shutdown(wait=True)
        for s in self.scorers:
            s.close()
