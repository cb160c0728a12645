"""Video rewards: clips [B, F, 3, H, W] float in [0, 1] (what a video adapter's decode gives) -> {key: float32 [B]}.

per_frame:            any pointwise image scorer on every (or the chosen) frame of a clip, aggregated per clip by
                      mean / min / max (a frame that could not be scored, NaN, makes its clip NaN) or positive_mean:
                      Flow-GRPO's video OCR rule, the mean over the frames that score above 0, and 0 when none does
                      (OcrScorer_video_or_image in flow_grpo/ocr.py, read in the fork zhtmike/flow_grpo@def7b84). There
                      a frame whose OCR fails scores 0 and is left out; here a NaN frame is left out too, and the clip
                      is NaN only when no chosen frame could be scored (the published code gives 0: not silently).
temporal_consistency: mean cosine similarity of consecutive frames' features; by default the frames downsampled
                      (area) to `size` x `size` pixels, a dependency-free stand-in for a learned encoder (CLIP /
                      DINO features plug in through `temporal_consistency(clips, features=...)`). Pixel features
                      are non-negative, so scores sit near 1 for most clips: compare clips, not absolute values.
                      A static clip scores 1 (two all-zero frames count as identical); a one-frame clip is NaN.
motion_magnitude:     mean absolute difference of consecutive frames, on the 0..1 pixel scale (a static clip: 0).

Clips with non-finite pixels score NaN (never 0), as in every scorer here; scores keep the gradient of tensor
input (temporal_consistency, motion_magnitude, and per_frame over a differentiable scorer).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import torch
import torch.nn.functional as F

from .base import Scorer, check_metadata, check_prompts
from .registry import build_scorer, register

AGGREGATES = ("mean", "min", "max", "positive_mean")


def check_videos(videos: Any, name: str) -> torch.Tensor:
    """Clips as one float tensor [B, F, 3, H, W] (a list of equal-shape [F, 3, H, W] clips is stacked; uint8 / 255)."""
    if isinstance(videos, (list, tuple)):
        if not all(isinstance(v, torch.Tensor) for v in videos):
            raise TypeError(f"scorer '{name}': videos must be a tensor [B, F, 3, H, W] or a list of [F, 3, H, W]")
        if len({tuple(v.shape) for v in videos}) > 1:
            raise ValueError(f"scorer '{name}': clips differ in shape {sorted({tuple(v.shape) for v in videos})}")
        videos = torch.stack(list(videos)) if videos else torch.empty(0, 1, 3, 1, 1)
    if not isinstance(videos, torch.Tensor) or videos.ndim != 5 or videos.shape[2] != 3:
        got = tuple(videos.shape) if isinstance(videos, torch.Tensor) else type(videos).__name__
        raise ValueError(f"scorer '{name}': videos must be [B, F, 3, H, W], got {got}")
    if videos.dtype == torch.uint8:
        return videos.float() / 255.0
    if not videos.is_floating_point():
        raise TypeError(f"scorer '{name}': videos must be float in [0, 1] (or uint8), got {videos.dtype}")
    return videos


class VideoScorer(Scorer):
    """Pointwise scorer over clips. Subclasses implement `score_clips` on one micro-batch of finite clips."""

    inputs = "videos"  # what a reward server serving this scorer reads from a request (reward_models.serving)

    def score_clips(
        self, clips: torch.Tensor, prompts: list[str], metadata: dict[str, list]
    ) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def __call__(self, videos, prompts: Sequence[str] | None = None, metadata: Mapping | None = None):
        clips = check_videos(videos, self.name)
        n = clips.shape[0]
        prompts = check_prompts(prompts, n, self.requires_prompts, self.name)
        metadata = check_metadata(metadata, n, self.metadata_keys, self.name)
        ok = torch.isfinite(clips.detach()).flatten(1).all(1)
        if not bool(ok.all()):  # score zeros in their place, then mark those rows NaN
            clips = torch.where(ok[:, None, None, None, None], clips, torch.zeros_like(clips))
        parts = []
        for start in range(0, n, self.batch_size):
            sl = slice(start, start + self.batch_size)
            out = self.score_clips(clips[sl], prompts[sl], {k: v[sl] for k, v in metadata.items()})
            parts.append(self._check_output(out, len(prompts[sl])))
        if not parts:
            return {self.key: torch.empty(0)}
        result = {k: torch.cat([p[k].to(device=clips.device, dtype=torch.float32) for p in parts]) for k in parts[0]}
        result = {k: torch.where(ok, v, torch.full_like(v, float("nan"))) for k, v in result.items()}
        self.counters["calls"] += 1
        self.counters["videos"] += n
        self.counters["nan"] += int(torch.isnan(result[self.key].detach()).sum())
        return result


# ---- per-frame image scores ------------------------------------------------------------------------------------


def _reduce(scores: torch.Tensor, aggregate: str) -> torch.Tensor:
    """[B, K] -> [B]; NaN anywhere in a row gives NaN (amin / amax propagate it, as mean does)."""
    return {"mean": scores.mean, "min": scores.amin, "max": scores.amax}[aggregate](dim=1)


def _masked_mean(values: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Row means of `values` [B, K] over `keep`; rows keeping nothing give 0 (torch.where: no NaN in the gradient)."""
    total = torch.where(keep, values, torch.zeros_like(values)).sum(1)
    return total / keep.sum(1).clamp_min(1).to(values.dtype)


def _positive_means(outputs: dict[str, torch.Tensor], key: str) -> dict[str, torch.Tensor]:
    """positive_mean of every output [B, K] over the frames where `key` scores > 0 (NaN does not count).

    The score of a clip with no such frame is 0, as published; its other outputs (e.g. ocr/distance) are then averaged
    over the frames that could be scored. A clip none of whose frames could be scored is NaN in every output.
    """
    score = outputs[key]
    scored = ~torch.isnan(score.detach())
    counted = score.detach() > 0
    fallback = counted.any(1, keepdim=True)
    unscorable = ~scored.any(1)
    result = {}
    for name, values in outputs.items():
        keep = counted if name == key else torch.where(fallback, counted, scored)
        mean = _masked_mean(values, keep)
        result[name] = torch.where(unscorable, torch.full_like(mean, float("nan")), mean)
    return result


class PerFrameScorer(VideoScorer):
    """An image scorer on the chosen frames of each clip (prompts and metadata repeated per frame), aggregated."""

    name = "per_frame"

    def __init__(
        self, scorer: Scorer, *, aggregate: str = "mean", frames: Sequence[int] | None = None, batch_size: int = 8,
        key: str | None = None,
    ):  # fmt: skip
        if not isinstance(scorer, Scorer) or isinstance(scorer, VideoScorer):
            raise TypeError(
                f"per_frame: the frame scorer must be a pointwise image scorer, got {type(scorer).__name__}"
            )
        if aggregate not in AGGREGATES:
            raise ValueError(f"per_frame: aggregate must be one of {AGGREGATES}, got '{aggregate}'")
        if frames is not None and (not frames or not all(isinstance(i, int) for i in frames)):
            raise ValueError(
                f"per_frame: frames must be a non-empty list of frame indices (or null: all), got {frames}"
            )
        super().__init__(batch_size=batch_size, key=key or scorer.key)
        self.scorer, self.aggregate = scorer, aggregate
        self.frames = None if frames is None else [int(i) for i in frames]
        self.requires_prompts, self.metadata_keys = scorer.requires_prompts, scorer.metadata_keys
        self.differentiable = scorer.differentiable

    def chosen(self, num_frames: int) -> list[int]:
        if self.frames is None:
            return list(range(num_frames))
        bad = [i for i in self.frames if not -num_frames <= i < num_frames]
        if bad:
            raise ValueError(f"per_frame: frame indices {bad} are out of range for clips of {num_frames} frames")
        return [i % num_frames for i in self.frames]

    def score_clips(self, clips, prompts, metadata):
        b, f = clips.shape[:2]
        idx = self.chosen(f)
        k = len(idx)
        frames = clips[:, idx].flatten(0, 1)  # [B * K, 3, H, W], clip-major
        repeat = lambda values: [v for v in values for _ in range(k)]  # noqa: E731
        out = self.scorer(frames, repeat(prompts), {name: repeat(v) for name, v in metadata.items()})
        inner = self.scorer.key
        per_frame = {name: v.view(b, k) for name, v in out.items()}
        if self.aggregate == "positive_mean":
            reduced = _positive_means(per_frame, inner)
        else:
            reduced = {name: _reduce(v, self.aggregate) for name, v in per_frame.items()}
        return {self.key + name[len(inner) :]: v for name, v in reduced.items()}

    def to(self, device=None, dtype=None):
        self.scorer.to(device, dtype)
        return self

    def close(self) -> None:
        self.scorer.close()


# ---- temporal statistics ---------------------------------------------------------------------------------------


def pixel_features(frames: torch.Tensor, size: int = 16) -> torch.Tensor:
    """[N, 3, H, W] -> [N, 3 * size * size]: frames area-downsampled (no weights, no dependency)."""
    return F.adaptive_avg_pool2d(frames.float(), size).flatten(1)


def temporal_consistency(
    clips: torch.Tensor, features: Callable[[torch.Tensor], torch.Tensor] = pixel_features
) -> torch.Tensor:
    """Mean cosine of consecutive frames' features, [B, F, 3, H, W] -> [B] (NaN for one-frame clips)."""
    b, f = clips.shape[:2]
    if f < 2:
        return torch.full((b,), float("nan"), device=clips.device)
    feats = features(clips.flatten(0, 1)).view(b, f, -1).float()
    a, c = feats[:, :-1], feats[:, 1:]
    na, nc = a.norm(dim=-1), c.norm(dim=-1)
    cos = (a * c).sum(-1) / (na * nc).clamp_min(1e-12)
    both_zero = (na == 0) & (nc == 0)  # two all-zero frames are identical: cosine 1
    return torch.where(both_zero, torch.ones_like(cos), cos).mean(1)


def motion_magnitude(clips: torch.Tensor, size: int | None = None) -> torch.Tensor:
    """Mean |frame_{t+1} - frame_t| over pixels and pairs, [B, F, 3, H, W] -> [B] (0 for a static or 1-frame clip)."""
    b, f = clips.shape[:2]
    if f < 2:
        return torch.zeros(b, device=clips.device)
    x = clips.float()
    if size is not None:
        x = F.adaptive_avg_pool2d(x.flatten(0, 1), size).view(b, f, *x.shape[2:3], size, size)
    return (x[:, 1:] - x[:, :-1]).abs().flatten(1).mean(1)


class TemporalConsistencyScorer(VideoScorer):
    """Mean cosine of consecutive frames' downsampled pixels."""

    name = "temporal_consistency"
    differentiable = True

    def __init__(self, *, size: int = 16, batch_size: int = 16, key: str | None = None):
        if int(size) < 1:
            raise ValueError(f"temporal_consistency: size must be >= 1, got {size}")
        super().__init__(batch_size=batch_size, key=key)
        self.size = int(size)

    def score_clips(self, clips, prompts, metadata):
        return {self.key: temporal_consistency(clips, lambda x: pixel_features(x, self.size))}


class MotionMagnitudeScorer(VideoScorer):
    """Mean absolute difference of consecutive frames (0..1 pixel scale)."""

    name = "motion_magnitude"
    differentiable = True

    def __init__(self, *, size: int | None = None, batch_size: int = 16, key: str | None = None):
        if size is not None and int(size) < 1:
            raise ValueError(f"motion_magnitude: size must be >= 1 (or null: full resolution), got {size}")
        super().__init__(batch_size=batch_size, key=key)
        self.size = None if size is None else int(size)

    def score_clips(self, clips, prompts, metadata):
        return {self.key: motion_magnitude(clips, self.size)}


@register("per_frame")
def build_per_frame(
    *, reward: Any, aggregate: str = "mean", frames: Sequence[int] | None = None, batch_size: int = 8,
    key: str | None = None,
) -> PerFrameScorer:  # fmt: skip
    """An image scorer (reward: a name or {name, **settings}) on each frame of a clip, aggregated mean / min / max /
    positive_mean (mean over frames scoring > 0, else 0: Flow-GRPO's video OCR)."""
    return PerFrameScorer(build_scorer(reward), aggregate=aggregate, frames=frames, batch_size=batch_size, key=key)


@register("temporal_consistency")
def build_temporal_consistency(*, size: int = 16, batch_size: int = 16, key: str | None = None):
    """Mean cosine of consecutive frames' downsampled pixels (1: static)."""
    return TemporalConsistencyScorer(size=size, batch_size=batch_size, key=key)


@register("motion_magnitude")
def build_motion_magnitude(*, size: int | None = None, batch_size: int = 16, key: str | None = None):
    """Mean absolute difference of consecutive frames (0: static)."""
    return MotionMagnitudeScorer(size=size, batch_size=batch_size, key=key)
