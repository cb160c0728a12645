"""Multimodal judges of image edits over an OpenAI-compatible chat endpoint: they see the source, the edit(s) and the
instruction (the prompt).

edit_judge (pointwise): one request per edit with content [source image(s)..., edited image, text], the text from
    `template` ("{prompt}" is replaced by the instruction). Scoring is vlm_judge's: the last match of `score_pattern`
    (group 1) in the reply, checked to lie in [score_min, score_max], normalised to (s - score_min) / (score_max -
    score_min); a reply without a usable score is NaN, counted in counters["unparseable"] / ["out_of_range"].
    Default: a 1-10 "Final Score" for instruction following (every requested change made, nothing else changed) and
    quality, the two axes of VIEScore (Ku et al. 2024: semantic consistency and perceptual quality, judged on the
    source and the edit). The built-in template paraphrases that protocol [unverified wording, not VIEScore's prompt];
    a judge fine-tuned on its own prompt should get it via `template`.
edit_judge_pairwise: P(edit a beats edit b) for two edits of the same source: content [source image(s)..., edit a
    ("Image 1"), edit b ("Image 2"), text]; the verdict is vlm_judge_pairwise's (the last <answer> block, "Image 1 is
    better" -> 1, "Image 2 is better" -> 0, undecided -> 0.5 counted in counters["undecided"]), both_orders=True also
    asks (b, a) and averages p(a,b) and 1 - p(b,a) (counters["order_disagreements"]). With group_win_rates, pass
    metadata={"source_images": sources of the group} and the instruction as the prompt.

Named templates (`template: edit_r1`): Edit-R1's judge prompt (PKU-YuanGroup/Edit-R1
reward_server/prompt_template.py:SCORE_LOGIT@4217f25, a 0-5 rating of the edit, "{requirement}" filled from
metadata["requirement"] when the rows carry it, else ""). `scoring: expected_digit` is Edit-R1's
"mllm_score_continue": the judge's first generated token, the probabilities of the digits score_min..score_max among
its top log-probabilities (requested with `logprobs` / `top_logprobs`) renormalised over those digits (= the softmax
over those digits' logits, as Edit-R1's logits processor takes), their expectation normalised as above (Edit-R1:
E[score] / 5). A reply without any of those digits among its top log-probabilities is NaN (counters["unparseable"]).

Sources come from metadata["source_images"] as in reward_models.edit_scores (uint8 / float [3,H,W] tensors or PIL
images, per edit a list); `source_index` None (the default) sends every source of the entry in order, an int only
that one. They are sent at their own size (max_side caps every image). An edit whose entry holds no source is NaN
without a request (counters["missing_source"]); a missing "source_images" key is a one-line ValueError.
Transport, retries, caps, content types and the handling of unusable replies (counters["bad_responses"],
on_bad_response) are vlm_judge's: reward_models.judge_client.JudgeClient with the HttpSettings and JudgeSettings
keys of the config entry.
"""

from __future__ import annotations

import json
import math
import threading
from typing import Any, Sequence

import torch
from PIL import Image

from .edit_scores import SOURCE_KEY, as_float_image, source_list
from .http_client import HttpSettings
from .images import ImageBatch
from .http_client import HTTPStatusError, RemoteRewardError
from .judge_client import JudgeClient, JudgeSettings
from .registry import register, with_settings
from .vlm_judge import SCORE_PATTERN, PairwiseVLMJudge, VLMJudge, parse_score

EDIT_TEMPLATE = (
    "You are an expert judge of image edits.\n"
    "The last image is the result of editing the image(s) before it, the source, with the instruction: "
    '"{prompt}"\n'
    "Judge how well the edit follows the instruction (every requested change is made, and nothing the instruction "
    "does not ask for is changed) and the quality of the result (plausible, free of artefacts, consistent with the "
    "untouched parts of the source).\n"
    "Think briefly, then end your reply with one line of the form\n"
    "Final Score: X\n"
    "where X is a number from 1 (very poor) to 10 (excellent)."
)

EDIT_PAIRWISE_TEMPLATE = (
    "You are an expert judge of image edits. The first image(s) are the source. The last two images, Image 1 and "
    "Image 2, are two edits of the source made with the instruction: "
    '"{prompt}"\n'
    "Compare the two edits on how well each follows the instruction (every requested change is made, nothing else "
    "is changed), how well it preserves the rest of the source, and its visual quality. Give each edit a score from "
    "1 to 10 for every criterion with a short reason, then add up each edit's total.\n"
    "Write all of this reasoning inside <think> and </think>. After the reasoning, give the final verdict inside "
    "<answer> and </answer>: exactly <answer>Image 1 is better</answer> or <answer>Image 2 is better</answer>."
)


# Edit-R1's judge prompt, kept word for word: a judge is sensitive to its prompt (placeholders {prompt}, {requirement})
EDIT_R1_TEMPLATE = (
    "Here are two images: the original and the edited version. Please evaluate the edited image based on the "
    "following editing instruction and requirement. \n"
    "Instruction: {prompt}\n"
    "Requirements: {requirement}\n"
    "You need to rate the editing result from 0 to 5 based on the accuracy and quality of the edit. \n"
    "0: The wrong object was edited, or the edit completely fails to meet the requirements. \n"
    "5: The correct object was edited, the requirements were met, and the visual result is high quality.\n"
    "Response Format (Directly response the score number): \n"
    "0-5"
)
TEMPLATES = {"default": EDIT_TEMPLATE, "edit_r1": EDIT_R1_TEMPLATE}
SCORINGS = ("parse", "expected_digit")
TOP_LOGPROBS = 20  # vLLM's default cap (--max-logprobs)


def resolve_template(template: str) -> str:
    """A named template (TEMPLATES) or the text itself (anything with a placeholder or a newline)."""
    if template in TEMPLATES:
        return TEMPLATES[template]
    if "{prompt}" in template or "\n" in template:
        return template
    raise ValueError(f"edit_judge: unknown template {template!r}; named ones: {sorted(TEMPLATES)} (or give the text)")


def first_token_logprobs(payload: Any) -> str:
    """{token: logprob} of the first generated token's top log-probabilities, as JSON; ValueError when absent."""
    try:
        top = payload["choices"][0]["logprobs"]["content"][0]["top_logprobs"]
        return json.dumps({str(t["token"]).strip(): float(t["logprob"]) for t in top})
    except (KeyError, IndexError, TypeError):
        raise ValueError(f"no first-token top_logprobs in the reply: {str(payload)[:200]}") from None


def expected_digit(reply: str, low: int, high: int) -> float | None:
    """E[digit] over low..high from a first_token_logprobs reply, the digits' probabilities renormalised."""
    logprobs = json.loads(reply)
    probs = {d: math.exp(logprobs[str(d)]) for d in range(low, high + 1) if str(d) in logprobs}
    total = sum(probs.values())
    return None if total <= 0 else sum(d * p for d, p in probs.items()) / total


class LogprobJudgeClient(JudgeClient):
    """A JudgeClient whose reply is the first token's top log-probabilities (JSON) rather than the text."""

    def __init__(self, url: str, **settings: Any):
        params = dict(settings.pop("request_params", None) or {})
        params.setdefault("logprobs", True)
        params.setdefault("top_logprobs", TOP_LOGPROBS)
        super().__init__(url, request_params=params, **settings)

    def _ask(self, images: Sequence[Image.Image], text: str, stop: threading.Event) -> str | None:
        try:
            body = json.dumps(self.request(images, text)).encode()
            reply = first_token_logprobs(json.loads(self.http.send("POST", "/chat/completions", body, stop=stop)))
        except (HTTPStatusError, ValueError) as e:  # json errors are ValueErrors
            self.http.count("bad_responses")
            if self.on_bad_response == "raise":
                raise RemoteRewardError(f"VLM judge {self.url}/chat/completions gave an unusable answer: {e}") from None
            return None
        self.http.count("replies")
        return reply


def source_pils(entry, index: int | None) -> list[Image.Image]:
    """The source images of one edit as RGB PIL images (uint8 round trip for tensors); [] when there are none."""
    items = source_list(entry)
    if index is not None:
        try:
            items = [items[index]]
        except IndexError:
            return []
    return [
        im.convert("RGB") if isinstance(im, Image.Image) else ImageBatch(as_float_image(im)[None]).pil()[0]
        for im in items
    ]


class EditJudge(VLMJudge):
    """Pointwise judge of an edit: a score parsed from the reply, normalised to [0, 1]."""

    name = "edit_judge"
    metadata_keys = (SOURCE_KEY,)

    def __init__(
        self,
        url: str,
        *,
        template: str = EDIT_TEMPLATE,
        source_index: int | None = None,
        scoring: str = "parse",
        **kwargs: Any,
    ):
        if scoring not in SCORINGS:
            raise ValueError(f"edit_judge: scoring must be one of {SCORINGS}, got {scoring!r}")
        super().__init__(url, template=resolve_template(template), **kwargs)
        self.source_index = None if source_index is None else int(source_index)
        self.scoring = scoring
        if scoring == "expected_digit":
            if not (
                self.score_min.is_integer()
                and self.score_max.is_integer()
                and 0 <= self.score_min
                and self.score_max <= 9
            ):
                raise ValueError(
                    f"edit_judge: scoring expected_digit needs single-digit integer scores, got "
                    f"{self.score_min}..{self.score_max}"
                )
            client = kwargs.copy()
            for k in ("score_pattern", "score_min", "score_max", "batch_size", "key"):
                client.pop(k, None)
            self.client.close()
            self.client = LogprobJudgeClient(url, counters=self.counters, **client)

    def _value(self, reply: str) -> float | None:
        if self.scoring == "expected_digit":
            return expected_digit(reply, int(self.score_min), int(self.score_max))
        return parse_score(reply, self.pattern)

    def _score(self, reply: str | None) -> float:
        value = None if reply is None else self._value(reply)
        if reply is not None and value is None:
            self.client.http.count("unparseable")
        elif value is not None and not self.score_min <= value <= self.score_max:
            self.client.http.count("out_of_range")
            value = None
        return float("nan") if value is None else value

    def score_batch(self, images, prompts, metadata):
        sources = [source_pils(entry, self.source_index) for entry in metadata[SOURCE_KEY]]
        edits = images.pil()
        asked = [i for i, s in enumerate(sources) if s]
        self.counters["missing_source"] += len(prompts) - len(asked)
        requirements = metadata.get("requirement") or [""] * len(prompts)
        texts = [
            self.template.replace("{prompt}", p).replace("{requirement}", str(r or ""))
            for p, r in zip(prompts, requirements)
        ]
        replies: list[str | None] = [None] * len(prompts)
        for i, reply in zip(asked, self.client.ask_many([(sources[i] + [edits[i]], texts[i]) for i in asked])):
            replies[i] = reply
        self.last_replies.extend(replies)
        raw = torch.tensor([self._score(reply) for reply in replies])  # None (not asked, unusable): NaN
        return {self.key: (raw - self.score_min) / (self.score_max - self.score_min), f"{self.key}/raw": raw}


class EditJudgePairwise(PairwiseVLMJudge):
    """P(edit a beats edit b) of two edits of one source; 0.5 when undecided."""

    name = "edit_judge_pairwise"
    metadata_keys = (SOURCE_KEY,)

    def __init__(
        self, url: str, *, template: str = EDIT_PAIRWISE_TEMPLATE, source_index: int | None = None, **kwargs: Any
    ):
        super().__init__(url, template=template, **kwargs)
        self.source_index = None if source_index is None else int(source_index)

    def compare_batch(self, a, b, prompts, metadata):
        sources = [source_pils(entry, self.source_index) for entry in metadata[SOURCE_KEY]]
        asked = [i for i, s in enumerate(sources) if s]
        self.counters["missing_source"] += len(prompts) - len(asked)
        texts = [self.template.replace("{prompt}", p) for p in prompts]
        pa, pb = a.pil(), b.pil()
        requests = [(sources[i] + [pa[i], pb[i]], texts[i]) for i in asked]
        if self.both_orders:
            requests += [(sources[i] + [pb[i], pa[i]], texts[i]) for i in asked]
        replies = self.client.ask_many(requests)
        self.last_replies.extend(replies)
        verdicts = self._verdicts(replies)
        n = len(asked)
        p = torch.full((len(prompts),), float("nan"))
        if not n:
            return p
        p[asked] = self._combine_orders(verdicts, n)
        return p


@register("edit_judge")
@with_settings(HttpSettings, JudgeSettings)
def build_edit_judge(
    *,
    template: str = EDIT_TEMPLATE,
    score_pattern: str = SCORE_PATTERN,
    score_min: float = 1.0,
    score_max: float = 10.0,
    source_index: int | None = None,
    scoring: str = "parse",
    batch_size: int = 64,
    key: str | None = None,
    **client,
) -> EditJudge:
    """Multimodal judge of an edit over an OpenAI-compatible endpoint: source(s) (metadata 'source_images') + edit +
    instruction, a parsed 1-10 score normalised to [0, 1] (`template: edit_r1, scoring: expected_digit,
    score_min: 0, score_max: 5`: Edit-R1's judge). `token` / `api_key`: the server's bearer token."""
    return EditJudge(
        template=template,
        score_pattern=score_pattern,
        score_min=score_min,
        score_max=score_max,
        source_index=source_index,
        scoring=scoring,
        batch_size=batch_size,
        key=key,
        **client,
    )


@register("edit_judge_pairwise", kind="pairwise")
@with_settings(HttpSettings, JudgeSettings, timeout_s=300.0, max_tokens=4096)
def build_edit_judge_pairwise(
    *,
    template: str = EDIT_PAIRWISE_TEMPLATE,
    both_orders: bool = False,
    source_index: int | None = None,
    batch_size: int = 64,
    **client,
) -> EditJudgePairwise:
    """Pairwise judge of two edits of one source (metadata 'source_images') over an OpenAI-compatible endpoint:
    P(a beats b), 0.5 when undecided. `token` / `api_key`: the server's bearer token."""
    return EditJudgePairwise(
        template=template, both_orders=both_orders, source_index=source_index, batch_size=batch_size, **client
    )
