"""Video rewards on hand-made clips: per-frame image scores aggregated, temporal consistency, motion magnitude."""

import pytest
import torch

from reward_models import available, build_scorer
from reward_models.video import motion_magnitude, temporal_consistency


def uniform_clip(levels) -> torch.Tensor:
    """One clip [1, F, 3, 8, 8] whose frame t is grey at levels[t]."""
    return torch.tensor(levels, dtype=torch.float32).view(1, -1, 1, 1, 1).expand(1, len(levels), 3, 8, 8).clone()


def checker(inverse: bool = False) -> torch.Tensor:
    ij = torch.arange(8)
    board = ((ij[:, None] + ij[None, :]) % 2).float()
    return (1 - board if inverse else board).expand(3, 8, 8)


def test_registered():
    assert {"per_frame", "temporal_consistency", "motion_magnitude"} <= set(available("pointwise"))


def test_static_clips_have_no_motion_and_full_consistency():
    torch.manual_seed(0)
    frame = torch.rand(3, 16, 16)
    clips = torch.stack([frame.expand(4, 3, 16, 16), torch.zeros(4, 3, 16, 16)])  # a textured and a black clip
    motion, consistency = build_scorer("motion_magnitude"), build_scorer("temporal_consistency")
    assert torch.equal(motion(clips)["motion_magnitude"], torch.zeros(2))
    torch.testing.assert_close(consistency(clips)["temporal_consistency"], torch.ones(2))


def test_flicker_and_fades_by_hand():
    flicker = torch.stack([checker(), checker(True), checker(), checker(True)])[None]  # orthogonal frames
    fade = uniform_clip([0.2, 0.4, 0.8, 0.8])
    clips = torch.cat([flicker, fade])
    # flicker: every pixel changes by 1; fade: |0.2| + |0.4| + 0 over 3 pairs
    torch.testing.assert_close(motion_magnitude(clips), torch.tensor([1.0, 0.2]))
    # flicker: cosine 0 between a board and its inverse; fade: grey levels are parallel vectors (cosine 1)
    torch.testing.assert_close(temporal_consistency(clips, features=lambda x: x.flatten(1)), torch.tensor([0.0, 1.0]))
    full = build_scorer({"name": "temporal_consistency", "size": 8})(clips)["temporal_consistency"]
    torch.testing.assert_close(full, torch.tensor([0.0, 1.0]))
    # a 4x4 area downsample averages each 2x2 cell of the board to grey: pixel-scale flicker is not seen
    coarse = build_scorer({"name": "temporal_consistency", "size": 4})(clips)["temporal_consistency"]
    torch.testing.assert_close(coarse, torch.tensor([1.0, 1.0]))
    one_frame = temporal_consistency(uniform_clip([0.5]))
    assert torch.isnan(one_frame).all() and motion_magnitude(uniform_clip([0.5])).item() == 0.0


@pytest.mark.parametrize("aggregate,frames,expected", [
    ("mean", None, [0.5, 0.3]), ("min", None, [0.2, 0.1]), ("max", None, [0.9, 0.6]),
    ("mean", [0, -1], [0.55, 0.4]),  # the first and the last frame only
])  # fmt: skip
def test_per_frame_aggregates_an_image_scorer(aggregate, frames, expected):
    clips = torch.cat([uniform_clip([0.2, 0.4, 0.9]), uniform_clip([0.6, 0.1, 0.2])])
    scorer = build_scorer({"name": "per_frame", "reward": "brightness", "aggregate": aggregate, "frames": frames})
    out = scorer(clips)
    assert set(out) == {"brightness"}
    torch.testing.assert_close(out["brightness"], torch.tensor(expected))


def test_nan_clips_prompts_and_errors():
    clips = torch.cat([uniform_clip([0.2, 0.4]), uniform_clip([0.5, 0.5])])
    clips[1, 1, 0, 0, 0] = float("nan")
    for name in ("per_frame", "motion_magnitude", "temporal_consistency"):
        settings = {"reward": {"name": "brightness", "key": "b"}, "key": "video_b"} if name == "per_frame" else {}
        scorer = build_scorer({"name": name, **settings})
        out = scorer(clips, ["a cat", "a dog"])
        score = out[scorer.key]
        assert torch.isfinite(score[0]) and torch.isnan(score[1]) and scorer.counters["nan"] == 1
    assert set(out) == {"temporal_consistency"}
    per_frame = build_scorer({"name": "per_frame", "reward": "brightness", "frames": [0, 5]})
    with pytest.raises(ValueError, match="out of range"):
        per_frame(clips)
    with pytest.raises(ValueError, match="aggregate"):
        build_scorer({"name": "per_frame", "reward": "brightness", "aggregate": "median"})
    with pytest.raises(ValueError, match=r"\[B, F, 3, H, W\]"):
        build_scorer("motion_magnitude")(torch.zeros(2, 3, 8, 8))


def test_per_frame_renames_keys_and_keeps_gradients():
    clips = uniform_clip([0.2, 0.4, 0.6]).requires_grad_(True)
    scorer = build_scorer({"name": "per_frame", "reward": {"name": "brightness", "key": "b"}, "key": "video_b"})
    assert scorer.differentiable
    out = scorer(clips)["video_b"]
    out.sum().backward()
    assert clips.grad is not None and clips.grad.abs().sum() > 0
    clips.grad = None
    build_scorer("motion_magnitude")(clips)["motion_magnitude"].sum().backward()
    assert clips.grad.abs().sum() > 0
