"""PromptEcho: the prompt's likelihood under a frozen vision-language model (arXiv 2604.12652).

A frozen VLM sees the generated image and a fixed guiding query (a "describe this image"
instruction) as the user turn; the original prompt p is teacher-forced as the assistant's answer.

    reduction="mean":  r(I, p) = (1/|p|) * sum_j log P(p_j | I, q, p_<j)  = -(token cross-entropy)
    reduction="sum":   r(I, p) =           sum_j log P(p_j | I, q, p_<j)

One forward pass per micro-batch, no generation, deterministic. Higher = the image "explains" the
prompt better. Only the prompt's own tokens are scored (not the end-of-turn token); the prompt is
tokenized on its own (no special tokens) and appended right after the chat template's generation
prompt. A prompt with no tokens gets NaN. Extra output '<key>/tokens': the number of scored tokens.

[unverified] The paper leaves the VLM, the query text and mean-vs-sum normalisation open (no code
found). Defaults here: reduction="mean" (the mean token log-probability of the prompt, the
reading of arXiv 2604.12652 taken here), query DEFAULT_QUERY, model Qwen/Qwen2.5-VL-7B-Instruct (the
authors' group works with Qwen models); all three are settings. The paper reports reward quality grows with VLM size.

Any transformers image-text-to-text model whose processor has a chat template works
(AutoModelForImageTextToText + AutoProcessor: Qwen2-VL / Qwen2.5-VL / Qwen3-VL, LLaVA, Idefics3,
Gemma 3, ...). The processor's images go through its own (PIL by default, `image_backend`)
preprocessing, so the score is not differentiable w.r.t. the pixels. Note: Qwen-VL processors
also build a video processor, which needs torchvision. Tests use a tiny LLaVA built from configs
(its processor needs no torchvision).
"""

from __future__ import annotations

import inspect
from pathlib import Path

import torch
import torch.nn.functional as F

from .base import Pretrained, Scorer
from .placement import ModelPlacement, resolve_dtype
from .registry import register

DEFAULT_VLM = "Qwen/Qwen2.5-VL-7B-Instruct"  # [unverified] which VLM the paper used
DEFAULT_QUERY = "Describe this image in detail."  # [unverified] the paper's guiding query
REDUCTIONS = ("mean", "sum")  # [unverified] which one the paper uses; its formula reads as the mean


class PromptEcho(ModelPlacement, Pretrained, Scorer):
    """Mean (or summed) log-probability of the prompt as the VLM's answer to `query` about the image."""

    name = "prompt_echo"
    requires_prompts = True

    def __init__(
        self,
        model,
        processor,
        *,
        query: str = DEFAULT_QUERY,
        reduction: str = "mean",
        max_prompt_tokens: int | None = None,
        device="auto",
        dtype="bfloat16",
        batch_size: int = 8,
        key: str | None = None,
    ):
        if reduction not in REDUCTIONS:
            raise ValueError(f"prompt_echo reduction must be one of {REDUCTIONS}, got {reduction!r}")
        if max_prompt_tokens is not None and int(max_prompt_tokens) < 1:
            raise ValueError(f"max_prompt_tokens must be >= 1 or None, got {max_prompt_tokens}")
        if getattr(processor, "chat_template", None) is None:
            raise ValueError("prompt_echo needs a processor with a chat template (to place the image and the query)")
        super().__init__(batch_size=batch_size, key=key)
        self.model = model.eval().requires_grad_(False)
        self.processor, self.tokenizer = processor, processor.tokenizer
        self.query, self.reduction = query, reduction
        self.max_prompt_tokens = None if max_prompt_tokens is None else int(max_prompt_tokens)
        messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": query}]}]
        self.prefix = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self._crop_logits = "logits_to_keep" in inspect.signature(model.forward).parameters
        self.device, self.dtype = torch.device("cpu"), torch.bfloat16
        self.to(device, dtype)

    def save_pretrained(self, path: str | Path) -> None:
        self.model.save_pretrained(path)
        self.processor.save_pretrained(path)

    def answer_ids(self, prompts: list[str]) -> list[list[int]]:
        """Token ids of each prompt as the answer text (no special tokens; cut at max_prompt_tokens)."""
        ids = self.tokenizer(prompts, add_special_tokens=False)["input_ids"]
        return [list(x)[: self.max_prompt_tokens] if self.max_prompt_tokens else list(x) for x in ids]

    def inputs(self, images, prompts: list[str]) -> tuple[dict, torch.Tensor, torch.Tensor]:
        """Model inputs with each row = [chat prefix with the image][prompt tokens][right padding],
        plus the prefix lengths and answer lengths per row."""
        enc = self.processor(
            text=[self.prefix] * len(prompts), images=[[im] for im in images.pil()], return_tensors="pt", padding=True
        )
        ids, mask = enc["input_ids"], enc["attention_mask"].bool()
        # Per-token tensors (input_ids, attention_mask, token type ids, ...) are rebuilt row by row;
        # image tensors (pixel_values, grid sizes, ...) pass through unchanged.
        per_token = [
            k
            for k, v in enc.items()
            if torch.is_tensor(v) and not v.is_floating_point() and tuple(v.shape) == tuple(ids.shape)
        ]
        answers = self.answer_ids(prompts)
        prefix_len = mask.sum(1)
        answer_len = torch.tensor([len(a) for a in answers])
        width = int((prefix_len + answer_len).max())
        rows = {k: torch.zeros(len(prompts), width, dtype=enc[k].dtype) for k in per_token}
        rows["input_ids"].fill_(self.pad_id)
        for i, answer in enumerate(answers):
            p, a = int(prefix_len[i]), len(answer)
            for k in per_token:
                rows[k][i, :p] = enc[k][i][mask[i]]  # the prefix without the processor's padding
            rows["input_ids"][i, p : p + a] = torch.tensor(answer, dtype=rows["input_ids"].dtype)
            rows["attention_mask"][i, p : p + a] = 1  # other per-token ids stay 0 (text)
        model_inputs = {k: v for k, v in enc.items() if k not in per_token}
        model_inputs.update(rows)
        model_inputs = {
            k: (
                v.to(self.device, self.dtype)
                if torch.is_tensor(v) and v.is_floating_point()
                else v.to(self.device)
                if torch.is_tensor(v)
                else v
            )
            for k, v in model_inputs.items()
        }
        return model_inputs, prefix_len, answer_len

    @torch.no_grad()
    def score_batch(self, images, prompts, metadata):
        inputs, prefix_len, answer_len = self.inputs(images, prompts)
        n, longest = len(prompts), int(answer_len.max())
        # Logits at position t predict token t+1: the answer of row i is read at p_i - 1 .. p_i + a_i - 2.
        start = max(int(prefix_len.min()) - 1, 0)
        stop = int((prefix_len + answer_len).max()) - 1
        offset = 0
        if self._crop_logits and longest > 0:
            inputs["logits_to_keep"] = torch.arange(start, stop, device=self.device)
            offset = start
        logits = self.model(**inputs).logits
        j = torch.arange(max(longest, 1))
        valid = j[None, :] < answer_len[:, None]  # [n, longest]
        target_pos = (prefix_len[:, None] + j[None, :]).clamp(max=inputs["input_ids"].shape[1] - 1)
        logit_pos = (target_pos - 1 - offset).clamp(min=0, max=logits.shape[1] - 1)
        rows = torch.arange(n)[:, None].expand_as(target_pos)
        picked = logits[rows.to(logits.device), logit_pos.to(logits.device)].float()  # [n, longest, V]
        targets = inputs["input_ids"][rows.to(self.device), target_pos.to(self.device)]
        logp = -F.cross_entropy(picked.flatten(0, 1), targets.flatten(), reduction="none").view(n, -1)
        total = (logp * valid.to(logp.device)).sum(1).cpu()
        count = answer_len.to(total.dtype)
        score = total / count if self.reduction == "mean" else total
        score = torch.where(answer_len > 0, score, torch.full_like(score, float("nan")))
        return {self.key: score, f"{self.key}/tokens": count}


# --- a tiny LLaVA for tests and demos (no files, no hub) ----------------------------------------

TINY_IMAGE_SIZE = 32
TINY_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<image>")
# A ChatML-style template: the image placeholder, then the text, per message.
TINY_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<image>{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tiny_vlm_processor():
    """LlavaProcessor: a byte-level Qwen2 tokenizer (256 byte symbols + 4 specials, no merges) and
    the PIL CLIP image processor at 32 px; 16 patches + 1 = 17 image tokens per image."""
    from transformers import LlavaProcessor, Qwen2Tokenizer

    from .preprocess import clip_image_processor_class
    from .tiny import byte_symbols

    tokenizer = Qwen2Tokenizer(
        vocab={s: i for i, s in enumerate(byte_symbols())},
        merges=[],
        unk_token=None,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
    )
    tokenizer.add_special_tokens({"additional_special_tokens": list(TINY_SPECIALS)})
    image_processor = clip_image_processor_class()(
        size={"shortest_edge": TINY_IMAGE_SIZE}, crop_size={"height": TINY_IMAGE_SIZE, "width": TINY_IMAGE_SIZE}
    )
    return LlavaProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=8,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
        image_token="<image>",
        chat_template=TINY_CHAT_TEMPLATE,
    )


def tiny_vlm_model(processor, seed: int = 0):
    """LlavaForConditionalGeneration: CLIP vision tower (32 px, patch 8) + a 2-layer Qwen2 LM."""
    from transformers import LlavaConfig, LlavaForConditionalGeneration

    tok = processor.tokenizer
    pad, eos, image = tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_end|>", "<image>"])
    common = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
    config = LlavaConfig(
        vision_config=dict(common, model_type="clip_vision_model", image_size=TINY_IMAGE_SIZE, patch_size=8),
        text_config=dict(
            common,
            model_type="qwen2",
            vocab_size=len(tok),
            num_key_value_heads=2,
            max_position_embeddings=512,
            bos_token_id=None,
            eos_token_id=eos,
            pad_token_id=pad,
        ),
        image_token_id=image,
        vision_feature_select_strategy="default",
        vision_feature_layer=-1,
        projector_hidden_act="gelu",
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return LlavaForConditionalGeneration(config).eval()


@register("prompt_echo")
def build_prompt_echo(
    *,
    model: str = DEFAULT_VLM,
    processor: str | None = None,
    query: str = DEFAULT_QUERY,
    reduction: str = "mean",
    max_prompt_tokens: int | None = None,
    tiny: bool = False,
    device: str = "auto",
    dtype: str = "bfloat16",
    image_backend: str | None = "pil",
    attn_implementation: str | None = None,
    batch_size: int = 8,
    local_files_only: bool = False,
    revision: str | None = None,
    key: str | None = None,
) -> PromptEcho:
    """PromptEcho: mean log-prob of the prompt as a frozen VLM's answer to a describe-the-image query."""
    if reduction not in REDUCTIONS:  # checked before any download
        raise ValueError(f"prompt_echo reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if tiny:
        proc = tiny_vlm_processor()
        net = tiny_vlm_model(proc)
    else:
        from transformers import AutoModelForImageTextToText, AutoProcessor

        opts = dict(local_files_only=local_files_only, revision=revision)
        extra = {"attn_implementation": attn_implementation} if attn_implementation else {}
        net = AutoModelForImageTextToText.from_pretrained(model, dtype=resolve_dtype(dtype), **opts, **extra)
        backend = {"backend": image_backend} if image_backend else {}
        proc = AutoProcessor.from_pretrained(processor or model, **opts, **backend)
    return PromptEcho(
        net,
        proc,
        query=query,
        reduction=reduction,
        max_prompt_tokens=max_prompt_tokens,
        device=device,
        dtype=dtype,
        batch_size=batch_size,
        key=key,
    )
