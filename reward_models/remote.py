"""Client scorer for any HTTP reward server speaking reward_models.wire (JSON + PNG, no pickle).

The transport (bounded attempts and deadline, retries with backoff and jitter, bearer token) is
reward_models.http_client.HttpClient, set by the HttpSettings keys of the config entry: HTTP 500 (the
server's scorer raised), 429, 502, 503, 504 and connection resets are retried; when the attempts run out, a
RemoteRewardError names the URL, the status and the attempts on one line, whatever on_bad_response says
(a server that keeps failing is down, not a bad answer). Here:
- a bad answer (HTTP 400 / 404 / 413, non-JSON, a Content-Type other than JSON, over max_response_bytes,
  wrong lengths, ...) raises, or with on_bad_response="nan" gives NaN rows and counts
  counters["bad_responses"];
- a health check (GET /health) runs before the first request and tells the client which prompts
  and metadata the server's scorer needs, and whether it scores images or videos (a mismatch raises).

remote_video: any reward server speaking reward_models.wire with "videos" (scripts/reward_server.py serving a
    video scorer, or your own): each clip travels as per-frame PNGs (`clip_format: png`, lossless, no dependency),
    per-frame JPEGs (`jpeg`, about 10x smaller) or one H.264 mp4 (`mp4`, needs PyAV on both sides; lossy, `fps`).
    Transport, retries and failures as above: bounded attempts, then a one-line
    RemoteRewardError; a bad answer raises or (on_bad_response: nan) gives NaN rows.
videoalign: remote_video for a server running VideoAlign (VideoReward, KwaiVGI), whose answer carries the three
    heads '<key>/VQ' (visual quality), '<key>/MQ' (motion quality), '<key>/TA' (text alignment). The score is
    vq * VQ + mq * MQ + ta * TA (VideoAlign's own "Overall" is the unweighted sum: the defaults 1, 1, 1); the
    three heads are kept as extras. DanceGRPO's HunyuanVideo run trains on VQ alone (vq 1, mq 0). An answer
    without one of the three heads is a bad answer.
"""

from __future__ import annotations

import json
from typing import Any

import torch

from .base import Scorer
from .http_client import HttpClient, HttpSettings, HTTPStatusError, RemoteRewardError
from .http_client import RETRY_STATUSES, resolve_token  # noqa: F401  (their import path before http_client)
from .registry import register, with_settings
from .video import VideoScorer
from .wire import CLIP_FORMATS, WireError, decode_scores, encode_request, encode_video_request

BAD_RESPONSE_POLICIES = ("raise", "nan")
VIDEOALIGN_HEADS = ("VQ", "MQ", "TA")


class RemoteScorer(Scorer):
    name = "remote"

    def __init__(
        self,
        url: str,
        *,
        on_bad_response: str = "raise",
        batch_size: int = 16,
        key: str | None = None,
        **http,
    ):
        """`http`: the HttpSettings fields (timeout_s, max_attempts, token, health_check, ...)."""
        super().__init__(batch_size=batch_size, key=key)
        if on_bad_response not in BAD_RESPONSE_POLICIES:
            raise ValueError(f"on_bad_response must be one of {BAD_RESPONSE_POLICIES}, got {on_bad_response!r}")
        settings = HttpSettings(url, **http)
        self.client = HttpClient(settings, counters=self.counters)
        self.url = self.client.url
        self.on_bad_response = on_bad_response
        self.health_check = settings.health_check
        self.server_info: dict | None = None
        self._server_key: str | None = None
        self._send_prompts = True

    @property
    def key(self) -> str:
        return self._key or self._server_key or self.name

    # -- transport -------------------------------------------------------------------------------

    def backoff(self, attempt: int) -> float:
        return self.client.backoff(attempt)

    def _send(self, method: str, path: str, body: bytes | None = None) -> bytes:
        return self.client.send(method, path, body)

    # -- protocol --------------------------------------------------------------------------------

    def health(self) -> dict:
        """GET /health; raises RemoteRewardError unless the server says it is ok."""
        info = self.server_info = self.client.health()
        self._server_key = info.get("key") if isinstance(info.get("key"), str) else None
        self.requires_prompts = bool(info.get("requires_prompts", False))
        self.metadata_keys = tuple(info.get("metadata_keys") or ())
        served, wanted = info.get("inputs", "images"), getattr(self, "inputs", "images")
        if served != wanted:  # an image client on a video server (or the reverse) would only get 400s
            scorer = "remote_video" if served == "videos" else "remote"
            raise RemoteRewardError(f"reward server {self.url} scores {served}, not {wanted}: use scorer '{scorer}'")
        return info

    def __call__(self, images, prompts=None, metadata=None):
        if self.health_check and self.server_info is None:
            self.health()
        # No prompts travel as null, not as empty strings, so a server that needs them says so.
        self._send_prompts = prompts is not None
        return super().__call__(images, prompts, metadata)

    def score_batch(self, images, prompts, metadata):
        return self._post(encode_request(images, prompts if self._send_prompts else None, metadata), len(prompts))

    def _post(self, request: dict, n: int) -> dict[str, torch.Tensor]:
        """POST /score; the scores of n rows renamed after this client's key (a bad answer: raise or NaN rows)."""
        body = json.dumps(request, allow_nan=False).encode()
        try:
            server_key, scores = decode_scores(json.loads(self._send("POST", "/score", body)), n)
            return self._rename(server_key, scores)
        except (HTTPStatusError, WireError, ValueError) as e:  # json errors are ValueErrors
            self.counters["bad_responses"] += 1
            message = f"reward server {self.url}/score gave an unusable answer: {e}"
            if self.on_bad_response == "raise":
                raise RemoteRewardError(message) from None
            return {self.key: torch.full((n,), float("nan"))}

    def _rename(self, server_key: str, scores: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Server keys -> this client's key (main score '<key>', extras '<key>/<what>')."""
        self._server_key = self._server_key or server_key
        out = {}
        for name, value in scores.items():
            if name == server_key:
                out[self.key] = value
            elif name.startswith(server_key + "/"):
                out[self.key + name[len(server_key) :]] = value
            else:
                raise WireError(f"score '{name}' is not named after the main key '{server_key}'")
        return out


@register("remote")
@with_settings(HttpSettings)
def build_remote(
    *, on_bad_response: str = "raise", batch_size: int = 16, key: str | None = None, **http
) -> RemoteScorer:
    """Any HTTP reward server speaking reward_models.wire (see scripts/reward_server.py); `token`: the
    server's bearer token, or `env:NAME` to read it from an environment variable."""
    return RemoteScorer(on_bad_response=on_bad_response, batch_size=batch_size, key=key, **http)


# ---- video clips ---------------------------------------------------------------------------------------------


def _check_clip_format(clip_format: str, fps: float) -> None:
    if clip_format not in CLIP_FORMATS:
        raise ValueError(f"clip_format must be one of {CLIP_FORMATS}, got {clip_format!r}")
    if not float(fps) > 0:
        raise ValueError(f"fps must be > 0, got {fps}")


class RemoteVideoScorer(RemoteScorer, VideoScorer):
    """A reward server's scores of clips (the request's "videos"); see the module docstring."""

    name = "remote_video"

    def __init__(
        self, url: str, *, clip_format: str = "png", fps: float = 8.0, jpeg_quality: int = 95,
        on_bad_response: str = "raise", batch_size: int = 4, key: str | None = None, **http: Any,
    ):  # fmt: skip
        _check_clip_format(clip_format, fps)
        super().__init__(url, on_bad_response=on_bad_response, batch_size=batch_size, key=key, **http)
        self.clip_format, self.fps, self.jpeg_quality = clip_format, float(fps), int(jpeg_quality)

    def score_clips(self, clips, prompts, metadata):
        request = encode_video_request(
            clips, prompts if self._send_prompts else None, metadata, self.clip_format,
            fps=self.fps, jpeg_quality=self.jpeg_quality,
        )  # fmt: skip
        return self._post(request, len(prompts))


class VideoAlignScorer(RemoteVideoScorer):
    """VideoAlign's three heads from a reward server, combined as vq * VQ + mq * MQ + ta * TA."""

    name = "videoalign"

    def __init__(self, url: str, *, vq: float = 1.0, mq: float = 1.0, ta: float = 1.0, **settings: Any):
        super().__init__(url, **settings)
        self.weights = {"VQ": float(vq), "MQ": float(mq), "TA": float(ta)}

    @property
    def key(self) -> str:  # "videoalign" (or the config's), whatever the server calls its main score
        return self._key or self.name

    def _rename(self, server_key: str, scores: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        named = super()._rename(server_key, scores)
        heads = {h: named.get(f"{self.key}/{h}") for h in VIDEOALIGN_HEADS}
        missing = [h for h, v in heads.items() if v is None]
        if missing:
            raise WireError(f"VideoAlign answer without the heads {missing}; it has {sorted(named)}")
        out = {f"{self.key}/{h}": v for h, v in heads.items() if v is not None}
        weights = torch.tensor([self.weights[h] for h in VIDEOALIGN_HEADS])
        out[self.key] = (torch.stack([out[f"{self.key}/{h}"] for h in VIDEOALIGN_HEADS], 1) * weights).sum(1)
        return out


@register("remote_video")
@with_settings(HttpSettings)
def build_remote_video(
    *, clip_format: str = "png", fps: float = 8.0, jpeg_quality: int = 95, on_bad_response: str = "raise",
    batch_size: int = 4, key: str | None = None, **http,
) -> RemoteVideoScorer:  # fmt: skip
    """A reward server scoring clips (wire "videos"): frames as PNG / JPEG, or an mp4 (PyAV); `token`: the
    server's bearer token or `env:NAME`."""
    return RemoteVideoScorer(
        clip_format=clip_format, fps=fps, jpeg_quality=jpeg_quality, on_bad_response=on_bad_response,
        batch_size=batch_size, key=key, **http,
    )  # fmt: skip


@register("videoalign")
@with_settings(HttpSettings)
def build_videoalign(
    *, vq: float = 1.0, mq: float = 1.0, ta: float = 1.0, clip_format: str = "png", fps: float = 8.0,
    jpeg_quality: int = 95, on_bad_response: str = "raise", batch_size: int = 4, key: str | None = None, **http,
) -> VideoAlignScorer:  # fmt: skip
    """VideoAlign (VQ / MQ / TA heads) on a reward server: vq * VQ + mq * MQ + ta * TA, the heads as extras."""
    return VideoAlignScorer(
        vq=vq, mq=mq, ta=ta, clip_format=clip_format, fps=fps, jpeg_quality=jpeg_quality,
        on_bad_response=on_bad_response, batch_size=batch_size, key=key, **http,
    )  # fmt: skip
