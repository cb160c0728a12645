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

Sources come from metadata["source_images"] as in reward_models.edit_scores (uint8 / float [3,H,W] tensors or PIL
images, per edit a list); `source_index` None (the default) sends every source of the entry in order, an int only
that one. They are sent at their own size (max_side caps every image). An edit whose entry holds no source is NaN
without a request (counters["missing_source"]); a missing "source_images" key is a one-line ValueError.
Transport, retries, caps, content types and the handling of unusable replies (counters["bad_responses"],
on_bad_response) are vlm_judge's: reward_models.judge_client.JudgeClient with the HttpSettings and JudgeSettings
keys of the config entry.
"""

from __future__ import annotations

from typing import Any

import torch
from PIL import Image

from .edit_scores import SOURCE_KEY, as_float_image, source_list
from .http_client import HttpSettings
from .images import ImageBatch
from .judge_client import JudgeSettings
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

    def __init__(self, url: str, *, template: str = EDIT_TEMPLATE, source_index: int | None = None, **kwargs: Any):
        super().__init__(url, template=template, **kwargs)
        self.source_index = None if source_index is None else int(source_index)

    def _score(self, reply: str | None) -> float:
        value = None if reply is None else parse_score(reply, self.pattern)
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
        texts = [self.template.replace("{prompt}", p) for p in prompts]
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
    batch_size: int = 64,
    key: str | None = None,
    **client,
) -> EditJudge:
    """Multimodal judge of an edit over an OpenAI-compatible endpoint: source(s) (metadata 'source_images') + edit +
    instruction, a parsed 1-10 score normalised to [0, 1]. `token` / `api_key`: the server's bearer token."""
    return EditJudge(
        template=template,
        score_pattern=score_pattern,
        score_min=score_min,
        score_max=score_max,
        source_index=source_index,
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
