"""A VLM judge of video clips [B, F, 3, H, W] in [0, 1] over an OpenAI-compatible chat endpoint.

The reward-server side of clips (remote_video, videoalign) is reward_models.remote.

video_vlm_judge: a pointwise VLM judge of clips over POST {url}/v1/chat/completions (vLLM, sglang, ...): the
    clip as `num_frames` frames sampled evenly, sent as images in one message (`video_input: frames`, what every
    multimodal server accepts), or as one mp4 `video_url` part (`video_input: video_url`, for servers that take
    videos, e.g. vLLM with Qwen2.5-VL; needs PyAV). The score is parsed and normalised as vlm_judge's
    (reward_models.vlm_judge); an unusable reply is NaN and counted, a server that stays down raises.
"""

from __future__ import annotations

import base64
import re
from typing import Any, Sequence

import torch
from PIL import Image

from .http_client import HttpSettings
from .judge_client import JudgeClient, JudgeSettings
from .registry import register, with_settings
from .video import VideoScorer
from .vlm_judge import SCORE_PATTERN, scores_of_replies
from .wire import encode_mp4, frames_uint8

VIDEO_INPUTS = ("frames", "video_url")

VIDEO_TEMPLATE = (
    "You are an expert judge of AI-generated videos. You are shown one video (or its frames, in order).\n"
    'The video was generated from the text prompt: "{prompt}"\n'
    "Judge how faithfully the video follows the prompt (objects, actions, attributes), its visual quality "
    "(detail, artefacts) and its motion (smooth, plausible, consistent from frame to frame).\n"
    "Think briefly, then end your reply with one line of the form\n"
    "Final Score: X\n"
    "where X is a number from 1 (very poor) to 10 (excellent)."
)


class Mp4Clip:
    """A clip encoded as mp4, sent as one `video_url` part instead of images."""

    def __init__(self, data: bytes):
        self.data = data

    def url(self) -> str:
        return "data:video/mp4;base64," + base64.b64encode(self.data).decode("ascii")


class VideoJudgeClient(JudgeClient):
    """JudgeClient whose request carries either frames (images) or one Mp4Clip as a video_url part."""

    def request(self, images: Sequence[Image.Image] | Mp4Clip, text: str) -> dict:
        if not isinstance(images, Mp4Clip):
            return super().request(images, text)
        body = super().request([], text)
        body["messages"][0]["content"].insert(0, {"type": "video_url", "video_url": {"url": images.url()}})
        return body


def sample_frames(num_frames: int, count: int | None) -> list[int]:
    """`count` frame indices spread evenly over num_frames, first and last included (all when count is None)."""
    if count is None or count >= num_frames:
        return list(range(num_frames))
    if count == 1:
        return [num_frames // 2]
    return [round(i * (num_frames - 1) / (count - 1)) for i in range(count)]


class VideoVLMJudge(VideoScorer):
    """Pointwise VLM judge of clips: a parsed score, normalised to [0, 1] (vlm_judge's rules)."""

    name = "video_vlm_judge"

    def __init__(
        self, url: str, *, template: str = VIDEO_TEMPLATE, score_pattern: str = SCORE_PATTERN,
        score_min: float = 1.0, score_max: float = 10.0, num_frames: int | None = 8, video_input: str = "frames",
        fps: float = 8.0, batch_size: int = 16, key: str | None = None, **client: Any,
    ):  # fmt: skip
        super().__init__(batch_size=batch_size, key=key)
        if video_input not in VIDEO_INPUTS:
            raise ValueError(f"video_input must be one of {VIDEO_INPUTS}, got {video_input!r}")
        if num_frames is not None and int(num_frames) < 1:
            raise ValueError(f"num_frames must be >= 1 (or null: every frame), got {num_frames}")
        if not score_max > score_min:
            raise ValueError(f"score_max must be > score_min, got {score_min}..{score_max}")
        if not float(fps) > 0:
            raise ValueError(f"fps must be > 0, got {fps}")
        if video_input == "video_url":
            try:
                import av  # noqa: F401
            except ImportError:
                raise ValueError("video_input 'video_url' needs PyAV (pip install av); or use 'frames'") from None
        self.pattern = re.compile(score_pattern)
        if self.pattern.groups < 1:
            raise ValueError("score_pattern needs a group that captures the number")
        self.template, self.score_min, self.score_max = template, float(score_min), float(score_max)
        self.num_frames = None if num_frames is None else int(num_frames)
        self.video_input, self.fps = video_input, float(fps)
        self.requires_prompts = "{prompt}" in template
        self.client = VideoJudgeClient(url, counters=self.counters, **client)
        self.last_replies: list[str | None] = []

    def __call__(self, videos, prompts=None, metadata=None):
        self.last_replies = []
        return super().__call__(videos, prompts, metadata)

    def _content(self, clip: torch.Tensor) -> list[Image.Image] | Mp4Clip:
        frames = frames_uint8(clip[sample_frames(clip.shape[0], self.num_frames)])
        if self.video_input == "video_url":
            return Mp4Clip(encode_mp4(frames, self.fps))
        return [Image.fromarray(f) for f in frames]

    def score_clips(self, clips, prompts, metadata):
        texts = [self.template.replace("{prompt}", p) for p in prompts]
        replies = self.client.ask_many([(self._content(c), t) for c, t in zip(clips, texts)])  # type: ignore[misc]
        self.last_replies.extend(replies)
        return scores_of_replies(self, replies)

    def close(self) -> None:
        self.client.close()


@register("video_vlm_judge")
@with_settings(HttpSettings, JudgeSettings)
def build_video_vlm_judge(
    *, template: str = VIDEO_TEMPLATE, score_pattern: str = SCORE_PATTERN, score_min: float = 1.0,
    score_max: float = 10.0, num_frames: int | None = 8, video_input: str = "frames", fps: float = 8.0,
    batch_size: int = 16, key: str | None = None, **client,
) -> VideoVLMJudge:  # fmt: skip
    """A VLM judge of clips over an OpenAI-compatible endpoint: sampled frames as images in one message (or one
    mp4 video_url part), a parsed score normalised to [0, 1]. `token` / `api_key`: the bearer token."""
    return VideoVLMJudge(
        template=template, score_pattern=score_pattern, score_min=score_min, score_max=score_max,
        num_frames=num_frames, video_input=video_input, fps=fps, batch_size=batch_size, key=key, **client,
    )  # fmt: skip
