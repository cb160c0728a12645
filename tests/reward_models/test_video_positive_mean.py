"""per_frame's positive_mean: Flow-GRPO's video OCR rule (the mean over frames scoring > 0, else 0).

The rule is OcrScorer_video_or_image in flow_grpo/ocr.py, read in the fork zhtmike/flow_grpo@def7b84 (not stored for
yifan123/flow_grpo): per frame 1 - min(distance, len) / len, kept when > 0; the clip is their mean, 0 if none is kept;
an OCR failure scores the frame 0 (so it is left out). Here the real `ocr` scorer runs with a scripted engine.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from reward_models import build_scorer
from reward_models.ocr import OCRScorer
from reward_models.video import PerFrameScorer

# what the scripted engine "reads" from a grey frame, by grey level in tenths; None: the engine fails
TEXTS = {0: "", 2: "hel", 4: "hello", 6: "xyzzy", 8: None}
TARGET = "hello"


class ScriptedEngine:
    def read(self, image):
        text = TEXTS[round(float(np.asarray(image).mean()) / 255 * 10)]
        if text is None:
            raise RuntimeError("engine failure")
        return [(text, 0.9)]


def clip(levels) -> torch.Tensor:
    return torch.tensor(levels, dtype=torch.float32).view(1, -1, 1, 1, 1).expand(1, len(levels), 3, 8, 8).clone()


def published(levels) -> float:
    """The source's clip reward, by hand (Levenshtein without the image OCR's substring shortcut: no substring here)."""
    from rapidfuzz.distance import Levenshtein

    kept = []
    for level in levels:
        text = TEXTS[round(level * 10)]
        dist = len(TARGET) if text is None else min(Levenshtein.distance(text, TARGET), len(TARGET))
        reward = 1 - dist / len(TARGET)
        if reward > 0:
            kept.append(reward)
    return sum(kept) / len(kept) if kept else 0.0


def test_positive_mean_is_the_published_video_ocr_rule():
    levels = [[0.4, 0.0, 0.2, 0.8], [0.0, 0.6, 0.0, 0.6], [0.8, 0.8, 0.8, 0.8]]
    clips = torch.cat([clip(row) for row in levels])
    prompts = [f'a sign that says "{TARGET}"'] * 3
    scorer = PerFrameScorer(OCRScorer(ScriptedEngine(), workers=1), aggregate="positive_mean")
    out = scorer(clips, prompts)
    assert set(out) == {"ocr", "ocr/distance"}
    # clip 0: frames 1.0 and 0.6 kept, the empty read (0) and the failed frame left out; clip 1: none kept -> 0
    assert out["ocr"][:2].tolist() == pytest.approx([published(levels[0]), published(levels[1])])
    assert out["ocr"][:2].tolist() == pytest.approx([0.8, 0.0])
    # distance over the frames the score averages (clip 1: over every frame that could be scored)
    assert out["ocr/distance"][:2].tolist() == pytest.approx([1.0, 5.0])
    # no frame could be scored: NaN, "could not score" (the published code gives 0), counted
    assert math.isnan(out["ocr"][2]) and math.isnan(out["ocr/distance"][2]) and scorer.counters["nan"] == 1
    mean = PerFrameScorer(OCRScorer(ScriptedEngine(), workers=1), aggregate="mean")(clips, prompts)["ocr"]
    assert math.isnan(mean[0]) and float(mean[1]) == 0.0  # the plain mean: a failed frame makes its clip NaN


def test_positive_mean_keeps_gradients_and_is_named_in_errors():
    frames = clip([0.0, 0.2, 0.6]).requires_grad_(True)
    scorer = build_scorer({"name": "per_frame", "reward": "brightness", "aggregate": "positive_mean"})
    score = scorer(frames)["brightness"]
    assert float(score.detach()) == pytest.approx(0.4)  # the black frame (brightness 0) is left out; "mean" gives 0.267
    score.sum().backward()
    assert frames.grad is not None and frames.grad[0, 0].abs().sum() == 0 and frames.grad[0, 1:].abs().sum() > 0
    with pytest.raises(ValueError, match="positive_mean"):
        build_scorer({"name": "per_frame", "reward": "brightness", "aggregate": "median"})


def test_substring_match_off_is_the_plain_edit_distance():
    from reward_models.ocr import ocr_distance

    assert ocr_distance("xxhelloxx", "hello") == (1.0, 0)  # the image OCR: a substring is distance 0
    assert ocr_distance("xxhelloxx", "hello", substring_match=False) == (1.0 - 4 / 5, 4)  # Flow-GRPO's video OCR
