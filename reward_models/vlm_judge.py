"""Vision-language judges over an OpenAI-compatible chat endpoint (vLLM, sglang, ...).

vlm_judge (pointwise): one request per image, [image, text] with the text from `template`
    ("{prompt}" is replaced by the prompt; no other placeholder, so braces in a template are safe).
    The score is the last match of `score_pattern` in the reply (group 1), checked to lie in
    [score_min, score_max] and normalised to (s - score_min) / (score_max - score_min).
    Defaults: a 1-10 score after "Final Score:" -> [0, 1]. Flow-GRPO's UnifiedReward recipe
    (a 1-5 "Final Score", divided by 5) is score_min=0, score_max=5 with its own template.
    A reply without a usable score is NaN and counted (counters["unparseable"],
    counters["out_of_range"]); Flow-GRPO turned such replies into a silent 0.
vlm_judge_pairwise: P(a beats b) from a UnifiedReward-Think style request (Pref-GRPO): content =
    [image a ("Image 1"), image b ("Image 2"), text]; the verdict is the last
    <answer>...</answer> block, "Image 1 is better" -> 1, "Image 2 is better" -> 0, anything
    else (no block, both, neither) -> 0.5, a tie, counted in counters["undecided"], as Pref-GRPO
    does. both_orders=True also asks (b, a) and averages p(a,b) and 1 - p(b,a), cancelling the
    judge's position bias (Pref-GRPO always puts image i first); pairs whose two verdicts both
    name the same position are counted in counters["order_disagreements"].
    The built-in template paraphrases the published protocol (three criteria scored 1-10,
    reasoning in <think>, verdict in <answer>); it is not the verbatim UnifiedReward-Think prompt
    [unverified wording]. A judge fine-tuned on its own prompt should get that prompt via
    `template` for parity.

Transport (reward_models.remote.HttpClient): POST {url}/v1/chat/completions, images as base64
JPEG q=95 data URLs (Pref-GRPO's protocol; PNG selectable), temperature 0, bounded retries with
capped exponential backoff and jitter, per-attempt timeouts, an optional per-request deadline,
and at most `concurrency` requests in flight (a thread pool). A batch takes at most about
ceil(requests / concurrency) x the per-request bound. A health check (GET /v1/models) runs
before the first request and, when `model` is unset, takes the first served model. A server that
stays down raises RemoteRewardError (the other requests of the batch stop early); a reply that is
not a chat completion (non-JSON, no choices, HTTP 500, ...) is NaN and counted in
counters["bad_responses"] (on_bad_response="nan", the default) or raises (on_bad_response="raise").
The replies of the last call stay in `last_replies` for logging (with both_orders: the (a, b)
replies of a micro-batch, then its (b, a) replies).
"""

from __future__ import annotations

import base64
import io
import json
import logging
import math
import re
import threading
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from typing import Any, Mapping, Sequence

import torch
from PIL import Image

from .base import PairwiseScorer, Scorer
from .registry import register
from .remote import BAD_RESPONSE_POLICIES, RETRY_STATUSES, HttpClient, HTTPStatusError, RemoteRewardError, resolve_token

log = logging.getLogger(__name__)

POINTWISE_TEMPLATE = (
    "You are an expert judge of AI-generated images.\n"
    'The image was generated from the text prompt: "{prompt}"\n'
    "Judge how faithfully the image follows the prompt (objects, counts, attributes, spatial "
    "relations, text) and its overall visual quality (plausibility, detail, aesthetics).\n"
    "Think briefly, then end your reply with one line of the form\n"
    "Final Score: X\n"
    "where X is a number from 1 (very poor) to 10 (excellent)."
)
SCORE_PATTERN = r"Final Score\s*[:=]\s*\**\s*([-+]?\d+(?:\.\d+)?)"

PAIRWISE_TEMPLATE = (
    "You are given two images, Image 1 and Image 2, both generated from the text prompt: "
    '"{prompt}"\n'
    "Compare them on three criteria: semantic consistency with the prompt, aesthetics, and "
    "authenticity (how realistic and free of artefacts each image is). You may add up to two "
    "further criteria that matter for this prompt. Give each image a score from 1 to 10 for every "
    "criterion with a short reason, then add up each image's total.\n"
    "Write all of this reasoning inside <think> and </think>. After the reasoning, give the final "
    "verdict inside <answer> and </answer>: exactly <answer>Image 1 is better</answer> or "
    "<answer>Image 2 is better</answer>."
)

_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.S | re.I)
_VERDICT = re.compile(r"image\s*([12])\s+is\s+(?:the\s+)?(?:better|preferred)", re.I)
IMAGE_FORMATS = ("jpeg", "png")


def parse_score(text: str | None, pattern: "str | re.Pattern" = SCORE_PATTERN) -> float | None:
    """The last match of `pattern` (its group 1) as a float; None when absent or not finite."""
    if not isinstance(text, str):
        return None
    matches = re.findall(pattern, text)
    if not matches:
        return None
    last = matches[-1]
    if isinstance(last, tuple):  # a pattern with several groups: group 1
        last = last[0]
    try:
        value = float(last)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def parse_preference(text: str | None) -> float | None:
    """UnifiedReward-Think verdict: 1.0 if Image 1 wins, 0.0 if Image 2 wins, None if undecided
    (no <answer> block, or one that names both images or neither)."""
    if not isinstance(text, str):
        return None
    blocks = _ANSWER.findall(text)
    if not blocks:
        return None
    winners = set(_VERDICT.findall(blocks[-1]))
    if len(winners) != 1:
        return None
    return 1.0 if winners.pop() == "1" else 0.0


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


def _base_url(url: str) -> str:
    """Accept http://host:port, .../v1 or .../v1/chat/completions; return .../v1."""
    url = url.rstrip("/").removesuffix("/chat/completions")
    return url if url.endswith("/v1") else url + "/v1"


class JudgeClient:
    """Chat requests with images, many at a time, on the shared HttpClient."""

    def __init__(
        self,
        url: str,
        *,
        model: str | None = None,
        api_key: str | None = None,
        counters=None,
        timeout_s: float = 120.0,
        max_attempts: int = 4,
        backoff_s: float = 0.5,
        max_backoff_s: float = 10.0,
        deadline_s: float | None = None,
        retry_statuses: Sequence[int] = RETRY_STATUSES,
        concurrency: int = 16,
        max_tokens: int = 1024,
        temperature: float = 0.0,
        image_format: str = "jpeg",
        jpeg_quality: int = 95,
        max_side: int | None = None,
        request_params: Mapping[str, Any] | None = None,
        on_bad_response: str = "nan",
        health_check: bool = True,
        seed: int | None = None,
    ):
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
        # api_key is the judge server's bearer token (a value, or env:NAME)
        self.http = HttpClient(
            _base_url(url),
            timeout_s=timeout_s,
            max_attempts=max_attempts,
            backoff_s=backoff_s,
            max_backoff_s=max_backoff_s,
            deadline_s=deadline_s,
            retry_statuses=retry_statuses,
            seed=seed,
            counters=counters,
            what="VLM judge",
            token=resolve_token(api_key),
        )
        self.model = model
        self.concurrency = int(concurrency)
        self.max_tokens, self.temperature = int(max_tokens), float(temperature)
        self.image_format, self.jpeg_quality = image_format, int(jpeg_quality)
        self.max_side = None if max_side is None else int(max_side)
        self.request_params = dict(request_params or {})
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
            "temperature": self.temperature,
        }
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


def _client(counters, settings: dict) -> JudgeClient:
    return JudgeClient(settings.pop("url"), counters=counters, **settings)


class VLMJudge(Scorer):
    """Pointwise VLM judge: a score parsed from the reply, normalised to [0, 1]."""

    name = "vlm_judge"

    def __init__(
        self,
        url: str,
        *,
        template: str = POINTWISE_TEMPLATE,
        score_pattern: str = SCORE_PATTERN,
        score_min: float = 1.0,
        score_max: float = 10.0,
        batch_size: int = 64,
        key: str | None = None,
        **client: Any,
    ):
        super().__init__(batch_size=batch_size, key=key)
        if not score_max > score_min:
            raise ValueError(f"score_max must be > score_min, got {score_min}..{score_max}")
        self.pattern = re.compile(score_pattern)
        if self.pattern.groups < 1:
            raise ValueError("score_pattern needs a group that captures the number")
        self.template, self.score_min, self.score_max = template, float(score_min), float(score_max)
        self.requires_prompts = "{prompt}" in template
        self.client = _client(self.counters, {"url": url, **client})
        self.last_replies: list[str | None] = []

    def __call__(self, images, prompts=None, metadata=None):
        self.last_replies = []
        return super().__call__(images, prompts, metadata)

    def score_batch(self, images, prompts, metadata):
        texts = [self.template.replace("{prompt}", p) for p in prompts]
        replies = self.client.ask_many([([im], t) for im, t in zip(images.pil(), texts)])
        self.last_replies.extend(replies)
        raw = []
        for reply in replies:
            value = None if reply is None else parse_score(reply, self.pattern)
            if reply is not None and value is None:
                self.client.http.count("unparseable")
            elif value is not None and not self.score_min <= value <= self.score_max:
                self.client.http.count("out_of_range")
                value = None
            raw.append(float("nan") if value is None else value)
        raw_t = torch.tensor(raw, dtype=torch.float32)
        return {self.key: (raw_t - self.score_min) / (self.score_max - self.score_min), f"{self.key}/raw": raw_t}

    def close(self) -> None:
        self.client.close()


class PairwiseVLMJudge(PairwiseScorer):
    """P(a beats b) from a UnifiedReward-Think style verdict; 0.5 when undecided."""

    name = "vlm_judge_pairwise"

    def __init__(
        self,
        url: str,
        *,
        template: str = PAIRWISE_TEMPLATE,
        both_orders: bool = False,
        batch_size: int = 64,
        **client: Any,
    ):
        super().__init__(batch_size=batch_size)
        client.setdefault("max_tokens", 4096)  # room for the judge's reasoning (Pref-GRPO: 4096)
        client.setdefault("timeout_s", 300.0)
        self.template, self.both_orders = template, bool(both_orders)
        self.requires_prompts = "{prompt}" in template
        self.client = _client(self.counters, {"url": url, **client})
        self.last_replies: list[str | None] = []

    def _verdicts(self, replies: list[str | None]) -> list[float]:
        out = []
        for reply in replies:
            if reply is None:  # unusable answer, already counted: could not judge
                out.append(float("nan"))
                continue
            p = parse_preference(reply)
            if p is None:
                self.client.http.count("undecided")
                p = 0.5
            out.append(p)
        return out

    def __call__(self, images_a, images_b, prompts=None, metadata=None):
        self.last_replies = []
        return super().__call__(images_a, images_b, prompts, metadata)

    def compare_batch(self, a, b, prompts, metadata):
        texts = [self.template.replace("{prompt}", p) for p in prompts]
        pa, pb = a.pil(), b.pil()
        requests = [([x, y], t) for x, y, t in zip(pa, pb, texts)]
        if self.both_orders:
            requests += [([y, x], t) for x, y, t in zip(pa, pb, texts)]
        replies = self.client.ask_many(requests)
        self.last_replies.extend(replies)
        verdicts = self._verdicts(replies)
        n = len(prompts)
        p_ab = torch.tensor(verdicts[:n], dtype=torch.float32)
        if not self.both_orders:
            return p_ab
        p_ba = torch.tensor(verdicts[n:], dtype=torch.float32)
        # Average the valid orders; NaN only when neither order could be judged.
        both = torch.stack([p_ab, 1.0 - p_ba])
        valid = ~torch.isnan(both)
        mean = torch.where(valid, both, torch.zeros_like(both)).sum(0) / valid.sum(0)
        flips = (p_ab == p_ba) & (p_ab != 0.5)  # the same position won both times
        self.client.http.count("order_disagreements", int(flips.sum()))
        return mean

    def close(self) -> None:
        self.client.close()


def _bearer(api_key: str | None, token: str | None) -> str | None:
    if api_key and token and api_key != token:
        raise ValueError("set `token` or `api_key` (the same bearer token), not two different ones")
    return api_key or token


def _client_settings(
    url,
    model,
    api_key,
    timeout_s,
    max_attempts,
    backoff_s,
    max_backoff_s,
    deadline_s,
    retry_statuses,
    concurrency,
    max_tokens,
    temperature,
    image_format,
    jpeg_quality,
    max_side,
    request_params,
    on_bad_response,
    health_check,
    seed,
) -> dict:
    return dict(
        url=url,
        model=model,
        api_key=api_key,
        timeout_s=timeout_s,
        max_attempts=max_attempts,
        backoff_s=backoff_s,
        max_backoff_s=max_backoff_s,
        deadline_s=deadline_s,
        retry_statuses=retry_statuses,
        concurrency=concurrency,
        max_tokens=max_tokens,
        temperature=temperature,
        image_format=image_format,
        jpeg_quality=jpeg_quality,
        max_side=max_side,
        request_params=request_params,
        on_bad_response=on_bad_response,
        health_check=health_check,
        seed=seed,
    )


@register("vlm_judge")
def build_vlm_judge(
    *,
    url: str,
    model: str | None = None,
    api_key: str | None = None,
    template: str = POINTWISE_TEMPLATE,
    score_pattern: str = SCORE_PATTERN,
    score_min: float = 1.0,
    score_max: float = 10.0,
    concurrency: int = 16,
    max_tokens: int = 1024,
    temperature: float = 0.0,
    image_format: str = "jpeg",
    jpeg_quality: int = 95,
    max_side: int | None = None,
    request_params: Mapping[str, Any] | None = None,
    timeout_s: float = 120.0,
    max_attempts: int = 4,
    backoff_s: float = 0.5,
    max_backoff_s: float = 10.0,
    deadline_s: float | None = None,
    retry_statuses: Sequence[int] = RETRY_STATUSES,
    on_bad_response: str = "nan",
    health_check: bool = True,
    batch_size: int = 64,
    key: str | None = None,
    seed: int | None = None,
    token: str | None = None,
) -> VLMJudge:
    """VLM judge over an OpenAI-compatible endpoint: a parsed score, normalised to [0, 1]. `token` (or its
    OpenAI name `api_key`): the server's bearer token, a value or `env:NAME`."""
    client = _client_settings(
        url,
        model,
        _bearer(api_key, token),
        timeout_s,
        max_attempts,
        backoff_s,
        max_backoff_s,
        deadline_s,
        retry_statuses,
        concurrency,
        max_tokens,
        temperature,
        image_format,
        jpeg_quality,
        max_side,
        request_params,
        on_bad_response,
        health_check,
        seed,
    )
    return VLMJudge(
        template=template,
        score_pattern=score_pattern,
        score_min=score_min,
        score_max=score_max,
        batch_size=batch_size,
        key=key,
        **client,
    )


@register("vlm_judge_pairwise", kind="pairwise")
def build_vlm_judge_pairwise(
    *,
    url: str,
    model: str | None = None,
    api_key: str | None = None,
    template: str = PAIRWISE_TEMPLATE,
    both_orders: bool = False,
    concurrency: int = 16,
    max_tokens: int = 4096,
    temperature: float = 0.0,
    image_format: str = "jpeg",
    jpeg_quality: int = 95,
    max_side: int | None = None,
    request_params: Mapping[str, Any] | None = None,
    timeout_s: float = 300.0,
    max_attempts: int = 4,
    backoff_s: float = 0.5,
    max_backoff_s: float = 10.0,
    deadline_s: float | None = None,
    retry_statuses: Sequence[int] = RETRY_STATUSES,
    on_bad_response: str = "nan",
    health_check: bool = True,
    batch_size: int = 64,
    seed: int | None = None,
    token: str | None = None,
) -> PairwiseVLMJudge:
    """Pairwise VLM judge (UnifiedReward-Think protocol): P(a beats b), 0.5 when undecided. `token` / `api_key`:
    the server's bearer token, a value or `env:NAME`."""
    client = _client_settings(
        url,
        model,
        _bearer(api_key, token),
        timeout_s,
        max_attempts,
        backoff_s,
        max_backoff_s,
        deadline_s,
        retry_statuses,
        concurrency,
        max_tokens,
        temperature,
        image_format,
        jpeg_quality,
        max_side,
        request_params,
        on_bad_response,
        health_check,
        seed,
    )
    return PairwiseVLMJudge(template=template, both_orders=both_orders, batch_size=batch_size, **client)
