"""The wire side of the VLM judges: chat requests with images to an OpenAI-compatible endpoint.

POST {url}/v1/chat/completions with images as base64 data URLs (JPEG q=95 by default, PNG
selectable), on the shared reward_models.http_client.HttpClient (the same policy as every remote scorer:
retries of 429 / 500 / 502-504 and dropped connections, per-attempt timeouts, an optional deadline, no
redirect to another host, answers only as JSON and up to max_response_bytes), with at most `concurrency`
requests in flight. A judge's settings are
HttpSettings plus JudgeSettings. The scorers that build the prompts and read the verdicts live in
reward_models.vlm_judge.
"""

from __future__ import annotations

import base64
import io
import json
import logging
import threading
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass, replace
from typing import Any, Mapping, Sequence

from PIL import Image

from .http_client import HttpClient, HttpSettings, HTTPStatusError, RemoteRewardError
from .remote import BAD_RESPONSE_POLICIES

log = logging.getLogger(__name__)

IMAGE_FORMATS = ("jpeg", "png")


@dataclass(frozen=True)
class JudgeSettings:
    """What a VLM judge's config sets besides HttpSettings: the served model, how images travel, the chat
    request, how many requests run at once and what an unusable reply gives."""

    model: str | None = None  # the served model name; None: the first one GET /v1/models lists
    api_key: str | None = None  # OpenAI's name for the bearer token (HttpSettings.token), a value or env:NAME
    concurrency: int = 16
    max_tokens: int = 1024
    temperature: float | None = 0.0  # None: not sent, the server's default applies (Pref-GRPO's request)
    image_format: str = "jpeg"
    jpeg_quality: int = 95
    max_side: int | None = None
    request_params: Mapping[str, Any] | None = None  # merged into every request body
    on_bad_response: str = "nan"


def image_data_url(
    image: Image.Image, *, image_format: str = "jpeg", jpeg_quality: int = 95, max_side: int | None = None
) -> str:
    """An RGB image as a base64 data URL, downscaled (bicubic) so its longer side <= max_side."""
    image = image.convert("RGB")
    if max_side is not None and max(image.size) > max_side:
        scale = max_side / max(image.size)
        size = (max(1, round(image.width * scale)), max(1, round(image.height * scale)))
        image = image.resize(size, Image.BICUBIC)
    buf = io.BytesIO()
    if image_format == "jpeg":
        image.save(buf, format="JPEG", quality=int(jpeg_quality))
    else:
        image.save(buf, format="PNG", compress_level=1)
    return f"data:image/{image_format};base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def reply_text(payload: Any) -> str:
    """choices[0].message.content of a chat completion (text parts joined); ValueError otherwise."""
    try:
        content = payload["choices"][0]["message"]["content"]
    except (KeyError, IndexError, TypeError):
        raise ValueError(f"not a chat completion: {str(payload)[:200]}") from None
    if isinstance(content, list):  # content parts
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
    if content is None:
        content = ""
    if not isinstance(content, str):
        raise ValueError(f"chat completion content is {type(content).__name__}, not text")
    return content


def _bearer(api_key: str | None, token: str | None) -> str | None:
    if api_key and token and api_key != token:
        raise ValueError("set `token` or `api_key` (the same bearer token), not two different ones")
    return api_key or token


def _base_url(url: str) -> str:
    """Accept http://host:port, .../v1 or .../v1/chat/completions; return .../v1."""
    url = url.rstrip("/").removesuffix("/chat/completions")
    return url if url.endswith("/v1") else url + "/v1"


class JudgeClient:
    """Chat requests with images, many at a time, on the shared HttpClient."""

    def __init__(self, url: str, *, counters=None, **settings: Any):
        """`settings`: the HttpSettings and JudgeSettings fields."""
        http = HttpSettings.take(url, settings)
        judge = JudgeSettings(**settings)
        token = _bearer(judge.api_key, http.token)
        model, concurrency, max_side = judge.model, judge.concurrency, judge.max_side
        on_bad_response, image_format, health_check = judge.on_bad_response, judge.image_format, http.health_check
        if on_bad_response not in BAD_RESPONSE_POLICIES:
            raise ValueError(f"on_bad_response must be one of {BAD_RESPONSE_POLICIES}, got {on_bad_response!r}")
        if image_format not in IMAGE_FORMATS:
            raise ValueError(f"image_format must be one of {IMAGE_FORMATS}, got {image_format!r}")
        if int(concurrency) < 1:
            raise ValueError(f"concurrency must be >= 1, got {concurrency}")
        if max_side is not None and int(max_side) < 1:
            raise ValueError(f"max_side must be >= 1 or None, got {max_side}")
        if model is None and not health_check:
            raise ValueError(
                "set `model` (the served model name) when health_check is off; the health check "
                "would otherwise pick the first model the server lists"
            )
        self.http = HttpClient(replace(http, url=_base_url(http.url), token=token), counters=counters, what="VLM judge")
        self.model = model
        self.concurrency = int(concurrency)
        self.max_tokens = int(judge.max_tokens)
        self.temperature = None if judge.temperature is None else float(judge.temperature)
        self.image_format, self.jpeg_quality = image_format, int(judge.jpeg_quality)
        self.max_side = None if max_side is None else int(max_side)
        self.request_params = dict(judge.request_params or {})
        self.on_bad_response = on_bad_response
        self.health_check = health_check
        self.served_models: list[str] | None = None
        self._pool: ThreadPoolExecutor | None = None

    @property
    def url(self) -> str:
        return self.http.url

    def health(self) -> list[str]:
        """GET /v1/models: the served model ids; picks the first when `model` is unset."""
        try:
            payload = self.http.get_json("/models")
            ids = [m["id"] for m in payload["data"]]
        except HTTPStatusError as e:
            raise RemoteRewardError(
                f"VLM judge {self.url}/models: {e} (an OpenAI-compatible server "
                "serves GET /v1/models; set health_check=False to skip this check)"
            ) from None
        except (ValueError, KeyError, TypeError) as e:
            raise RemoteRewardError(f"VLM judge {self.url}/models answered no model list: {e}") from None
        if not ids:
            raise RemoteRewardError(f"VLM judge {self.url} serves no model")
        if self.model is None:
            self.model = ids[0]
        elif self.model not in ids:
            raise RemoteRewardError(
                f"VLM judge {self.url} does not serve model '{self.model}'; it serves {ids} (vLLM: --served-model-name)"
            )
        self.served_models = ids
        return ids

    def request(self, images: Sequence[Image.Image], text: str) -> dict:
        content = [
            {
                "type": "image_url",
                "image_url": {
                    "url": image_data_url(
                        im, image_format=self.image_format, jpeg_quality=self.jpeg_quality, max_side=self.max_side
                    )
                },
            }
            for im in images
        ]
        content.append({"type": "text", "text": text})
        body = {
            "model": self.model,
            "messages": [{"role": "user", "content": content}],
            "max_tokens": self.max_tokens,
        }
        if self.temperature is not None:  # None: the server's default sampling (vLLM: the model's generation config)
            body["temperature"] = self.temperature
        body.update(self.request_params)
        return body

    def _ask(self, images: Sequence[Image.Image], text: str, stop: threading.Event) -> str | None:
        try:
            payload = json.loads(
                self.http.send("POST", "/chat/completions", json.dumps(self.request(images, text)).encode(), stop=stop)
            )
            reply = reply_text(payload)
        except (HTTPStatusError, ValueError) as e:  # json errors are ValueErrors
            self.http.count("bad_responses")
            message = f"VLM judge {self.url}/chat/completions gave an unusable answer: {e}"
            if self.on_bad_response == "raise":
                raise RemoteRewardError(message) from None
            log.warning("%s (scored NaN)", message)
            return None
        self.http.count("replies")
        return reply

    def ask_many(self, requests: Sequence[tuple[Sequence[Image.Image], str]]) -> list[str | None]:
        """Replies in order (None = unusable answer, counted). The first hard failure stops the
        other requests of the batch and is raised."""
        if self.health_check and self.served_models is None:
            self.health()
        stop = threading.Event()
        if self.concurrency == 1 or len(requests) <= 1:
            return [self._ask(images, text, stop) for images, text in requests]
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=self.concurrency, thread_name_prefix="vlm-judge")
        futures = [self._pool.submit(self._ask, images, text, stop) for images, text in requests]
        try:
            done, pending = wait(futures, return_when=FIRST_EXCEPTION)
        except BaseException:  # interrupted while waiting
            stop.set()
            for f in futures:
                f.cancel()
            raise
        if pending:  # a request failed: stop the others (queued ones never start) and raise
            stop.set()
            for f in pending:
                f.cancel()
            raise next(f.exception() for f in futures if f in done and f.exception() is not None)
        return [f.result() for f in futures]

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
