"""Score samples with reward_models scorers, in batches of images loaded from disk.

Pointwise scorers give every image one value per output key (the main key, e.g. 'pickscore', and
extras named '<key>/<what>'); NaN means "could not score" and is kept as NaN. Pairwise scorers are
used only in comparisons: for every matched pair they give P(run B's image beats run A's).

An edit's input images (metadata "images": paths, see sources.py) are loaded for the scorers as
metadata["source_images"]: per image, a list of uint8 [3, H, W] tensors (the edit scorers resize them).

Videos (a run of .mp4 / animated .webp files, flowgrpo/video_io.py) are read back as clips, uint8
[B, F, 3, H, W], and scored by video scorers (reward_models/video.py: per_frame wraps any image scorer); an image
scorer given videos, a video scorer given images, or a run that mixes both is a one-line error.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np
from PIL import Image
from tqdm.auto import tqdm

from ..video_io import is_video, read_video
from .config import ScorerSpec
from .sources import SOURCES, EvaluationError, Sample

SOURCE_KEY = "source_images"  # reward_models.edit_scores.SOURCE_KEY


def build_scorers(specs: Sequence[ScorerSpec]) -> tuple[list, list]:
    """(pointwise, pairwise) lists of (spec, scorer) built by reward_models.build_scorer."""
    from reward_models import build_scorer

    pointwise, pairwise = [], []
    for spec in specs:
        try:
            scorer = build_scorer({"name": spec.name, **spec.settings})
        except (ValueError, TypeError, FileNotFoundError) as err:
            raise EvaluationError(f"scorer '{spec.name}': {err}") from err
        (pairwise if spec.kind == "pairwise" else pointwise).append((spec, scorer))
    names = [s.name for s, _ in pairwise]
    if len(set(names)) != len(names):
        raise EvaluationError(f"pairwise scorers must have distinct names, got {names}")
    return pointwise, pairwise


def close_scorers(*groups: list) -> None:
    for group in groups:
        for _, scorer in group:
            scorer.close()


def resolve(root: str | Path, sample: Sample) -> Path:
    path = Path(sample.file)
    return path if path.is_absolute() else Path(root) / path


def load_images(root: str | Path, samples: Sequence[Sample]) -> list[Image.Image]:
    images = []
    for s in samples:
        path = resolve(root, s)
        try:
            with Image.open(path) as im:
                images.append(im.convert("RGB"))
        except (OSError, ValueError) as err:
            raise EvaluationError(f"cannot read image {path}: {err}") from None
    return images


def metadata_columns(samples: Sequence[Sample], root: str | Path | None = None) -> dict[str, list]:
    """Per-image metadata as the scorers take it: a dict of lists (None where an image lacks a key); with `root`,
    edits' input images as "source_images" (an empty list for an image without)."""
    keys = list(dict.fromkeys(k for s in samples for k in s.metadata))
    columns = {k: [s.metadata.get(k) for s in samples] for k in keys}
    if root is not None and SOURCES in columns:
        columns[SOURCE_KEY] = [source_images(root, s) for s in samples]
    return columns


def source_images(root: str | Path, sample: Sample) -> list:
    """The sample's input images (metadata "images") as uint8 [3, H, W] tensors."""
    import torch

    out = []
    for name in sample.metadata.get(SOURCES) or []:
        path = Path(name) if Path(name).is_absolute() else Path(root) / name
        image = load_images(root, [Sample(str(path), sample.prompt, sample.index)])[0]
        out.append(torch.from_numpy(np.asarray(image).copy()).permute(2, 0, 1).contiguous())
    return out


def holds_videos(root: str | Path, samples: Sequence[Sample]) -> bool:
    """Whether the samples are videos (all of them) or images (all of them); a mix is an error."""
    kinds = {is_video(resolve(root, s)) for s in samples}
    if len(kinds) > 1:
        raise EvaluationError(f"{root}: a run holds images or videos, not both")
    return kinds == {True}


def check_media(scorers: list, videos: bool, what: str = "pointwise") -> None:
    """Video scorers for videos, image scorers for images: a one-line error naming the scorer otherwise."""
    from reward_models.video import VideoScorer

    for spec, scorer in scorers:
        if videos and what == "pairwise":
            raise EvaluationError(
                f"pairwise scorer '{spec.name}' compares images, but the runs hold videos; compare videos with "
                "pointwise video scorers"
            )
        if videos and not isinstance(scorer, VideoScorer):
            raise EvaluationError(
                f"scorer '{spec.name}' scores images, but the run holds videos; use a video scorer "
                f"(per_frame, temporal_consistency, motion_magnitude), e.g. {{name: per_frame, reward: {spec.name}}}"
            )
        if not videos and isinstance(scorer, VideoScorer):
            raise EvaluationError(f"scorer '{spec.name}' scores videos, but the run holds images")


def load_clips(root: str | Path, samples: Sequence[Sample]):
    """The samples' videos as one uint8 tensor [B, F, 3, H, W]."""
    import torch

    clips = []
    for s in samples:
        path = resolve(root, s)
        try:
            clips.append(torch.from_numpy(read_video(path)).permute(0, 3, 1, 2))
        except (OSError, ValueError) as err:
            raise EvaluationError(f"cannot read video {path}: {err}") from None
    shapes = sorted({tuple(c.shape) for c in clips})
    if len(shapes) > 1:
        raise EvaluationError(f"{root}: videos scored together must have one shape [F, 3, H, W], got {shapes}")
    return torch.stack(clips)


def _numpy(t) -> np.ndarray:
    return t.detach().float().cpu().numpy().astype(np.float64)


def score_samples(
    root: str | Path,
    samples: Sequence[Sample],
    scorers: list,
    batch_size: int = 32,
    progress: bool = True,
    desc: str = "score",
) -> dict[str, np.ndarray]:
    """{output key: float64 [N]} for every pointwise scorer's every output, in scorer order."""
    n = len(samples)
    scores: dict[str, np.ndarray] = {}
    owner: dict[str, int] = {}
    videos = holds_videos(root, samples)
    check_media(scorers, videos)
    bar = tqdm(total=n, desc=desc, unit="img", disable=not progress)
    for start in range(0, n, batch_size):
        chunk = samples[start : start + batch_size]
        images = load_clips(root, chunk) if videos else load_images(root, chunk)
        prompts = [s.prompt for s in chunk]
        metadata = metadata_columns(chunk, root)
        for i, (spec, scorer) in enumerate(scorers):
            for key, value in scorer(images, prompts, metadata).items():
                if owner.setdefault(key, i) != i:
                    raise EvaluationError(
                        f"scorers '{scorers[owner[key]][0].name}' and '{spec.name}' both give "
                        f"'{key}'; give one of them a distinct 'key' setting"
                    )
                if key not in scores:
                    scores[key] = np.full(n, np.nan)
                scores[key][start : start + len(chunk)] = _numpy(value)
        bar.update(len(chunk))
    bar.close()
    return scores


def score_pairs(
    root_a: str | Path,
    samples_a: Sequence[Sample],
    root_b: str | Path,
    samples_b: Sequence[Sample],
    scorers: list,
    batch_size: int = 32,
    progress: bool = True,
) -> dict[str, np.ndarray]:
    """{pairwise scorer name: float64 [M]}: P(image of B beats image of A) for each matched pair."""
    m = len(samples_a)
    out = {spec.name: np.full(m, np.nan) for spec, _ in scorers}
    if scorers and (holds_videos(root_a, samples_a) or holds_videos(root_b, samples_b)):
        check_media(scorers, True, "pairwise")  # the pairwise scorers compare images
    bar = tqdm(total=m, desc="compare", unit="pair", disable=not progress or not scorers)
    for start in range(0, m if scorers else 0, batch_size):
        a, b = samples_a[start : start + batch_size], samples_b[start : start + batch_size]
        images_a, images_b = load_images(root_a, a), load_images(root_b, b)
        prompts = [s.prompt for s in b]
        metadata = metadata_columns(b, root_b)
        for spec, scorer in scorers:
            p = scorer(images_b, images_a, prompts, metadata)
            out[spec.name][start : start + len(b)] = _numpy(p)
        bar.update(len(b))
    bar.close()
    return out
