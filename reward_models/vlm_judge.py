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

Transport (reward_models.judge_client.JudgeClient on reward_models.http_client.HttpClient, set by the
HttpSettings and JudgeSettings keys of the config entry): POST {url}/v1/chat/completions, images as base64
JPEG q=95 data URLs (Pref-GRPO's protocol; PNG selectable), temperature 0 (`temperature: null` sends
none, as Pref-GRPO's request: the server's default sampling then applies), bounded retries with
capped exponential backoff and jitter, per-attempt timeouts, an optional per-request deadline,
and at most `concurrency` requests in flight (a thread pool). A batch takes at most about
ceil(requests / concurrency) x the per-request bound. A health check (GET /v1/models) runs
before the first request and, when `model` is unset, takes the first served model. A server that
stays down, or keeps answering 500 / 429 / 502-504 (retried like a dropped connection), raises
RemoteRewardError (the other requests of the batch stop early), as does a redirect to another host (the
bearer token never follows it); a reply that is not a chat completion (non-JSON, a Content-Type other
than JSON, over max_response_bytes, no choices, HTTP 400, ...) is NaN and counted in
counters["bad_responses"] (on_bad_response="nan", the default) or raises (on_bad_response="raise").
The replies of the last call stay in `last_replies` for logging (with both_orders: the (a, b)
replies of a micro-batch, then its (b, a) replies).
"""

from __future__ import annotations

import math
import re
from typing import Any

import torch

from .base import PairwiseScorer, Scorer
from .http_client import HttpSettings
from .judge_client import JudgeClient, JudgeSettings
from .registry import register, with_settings

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


def scores_of_replies(judge: Any, replies: list[str | None]) -> dict[str, torch.Tensor]:
    """A pointwise judge's replies -> {key: score scaled to [0, 1], key/raw: the judge's number}; an unparseable or
    out-of-range reply is NaN and counted. `judge` has key, pattern, score_min, score_max and client."""
    raw = []
    for reply in replies:
        value = None if reply is None else parse_score(reply, judge.pattern)
        if reply is not None and value is None:
            judge.client.http.count("unparseable")
        elif value is not None and not judge.score_min <= value <= judge.score_max:
            judge.client.http.count("out_of_range")
            value = None
        raw.append(float("nan") if value is None else value)
    raw_t = torch.tensor(raw, dtype=torch.float32)
    low, high = judge.score_min, judge.score_max
    return {judge.key: (raw_t - low) / (high - low), f"{judge.key}/raw": raw_t}


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
        self.client = JudgeClient(url, counters=self.counters, **client)
        self.last_replies: list[str | None] = []

    def __call__(self, images, prompts=None, metadata=None):
        self.last_replies = []
        return super().__call__(images, prompts, metadata)

    def score_batch(self, images, prompts, metadata):
        texts = [self.template.replace("{prompt}", p) for p in prompts]
        replies = self.client.ask_many([([im], t) for im, t in zip(images.pil(), texts)])
        self.last_replies.extend(replies)
        return scores_of_replies(self, replies)

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
        # room for the judge's reasoning (Pref-GRPO vllm_request.py: 2048 in the paper's release 6d405e8, 4096 from c9b70d0)
        client.setdefault("max_tokens", 4096)
        client.setdefault("timeout_s", 300.0)
        self.template, self.both_orders = template, bool(both_orders)
        self.requires_prompts = "{prompt}" in template
        self.client = JudgeClient(url, counters=self.counters, **client)
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
        return self._combine_orders(verdicts, n)

    def _combine_orders(self, verdicts: list[float], n: int) -> torch.Tensor:
        """P(a beats b) of the first n verdicts; with both_orders, averaged with 1 - the (b, a) verdicts after them
        over the orders that could be judged (NaN only when neither could). Flipped verdicts are counted."""
        p_ab = torch.tensor(verdicts[:n], dtype=torch.float32)
        if not self.both_orders:
            return p_ab
        p_ba = torch.tensor(verdicts[n:], dtype=torch.float32)
        both = torch.stack([p_ab, 1.0 - p_ba])
        valid = ~torch.isnan(both)
        flips = (p_ab == p_ba) & (p_ab != 0.5)  # the same position won both times
        self.client.http.count("order_disagreements", int(flips.sum()))
        return torch.where(valid, both, torch.zeros_like(both)).sum(0) / valid.sum(0)

    def close(self) -> None:
        self.client.close()


@register("vlm_judge")
@with_settings(HttpSettings, JudgeSettings)
def build_vlm_judge(
    *,
    template: str = POINTWISE_TEMPLATE,
    score_pattern: str = SCORE_PATTERN,
    score_min: float = 1.0,
    score_max: float = 10.0,
    batch_size: int = 64,
    key: str | None = None,
    **client,
) -> VLMJudge:
    """VLM judge over an OpenAI-compatible endpoint: a parsed score, normalised to [0, 1]. `token` (or its
    OpenAI name `api_key`): the server's bearer token, a value or `env:NAME`."""
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
@with_settings(HttpSettings, JudgeSettings, timeout_s=300.0, max_tokens=4096)
def build_vlm_judge_pairwise(
    *, template: str = PAIRWISE_TEMPLATE, both_orders: bool = False, batch_size: int = 64, **client
) -> PairwiseVLMJudge:
    """Pairwise VLM judge (UnifiedReward-Think protocol): P(a beats b), 0.5 when undecided. `token` / `api_key`:
    the server's bearer token, a value or `env:NAME`."""
    return PairwiseVLMJudge(template=template, both_orders=both_orders, batch_size=batch_size, **client)
