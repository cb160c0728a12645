"""Generation backend on transformers `generate`: G samples per prompt, batched, left padding, KV cache.

The result is a `Rollout`: prompt and completion token ids as padded tensors, the completion mask
(every token up to and including the first end-of-sequence token), and which completions were cut
by `max_new_tokens` (truncated: no end-of-sequence token).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch
from torch import Tensor

from .config import GenerationConfig


@dataclass
class Rollout:
    """N = P x G sequences, the G samples of a prompt next to each other.

    prompt_ids [N, Lp] left-padded; prompt_mask [N, Lp]; completion_ids [N, Tc] right-padded;
    completion_mask [N, Tc] bool; truncated [N] bool; prompt_index [N] row of the dataset.
    """

    prompt_ids: Tensor
    prompt_mask: Tensor
    completion_ids: Tensor
    completion_mask: Tensor
    truncated: Tensor
    prompt_index: Tensor
    group_size: int

    @property
    def num_sequences(self) -> int:
        return self.completion_ids.shape[0]

    @property
    def lengths(self) -> Tensor:
        return self.completion_mask.sum(1)

    def select_groups(self, groups: Sequence[int]) -> "Rollout":
        """The rollout restricted to whole groups (by group index), in the given order."""
        G = self.group_size
        idx = torch.tensor([g * G + j for g in groups for j in range(G)], dtype=torch.long)
        return Rollout(self.prompt_ids[idx], self.prompt_mask[idx], self.completion_ids[idx],
                       self.completion_mask[idx], self.truncated[idx], self.prompt_index[idx], G)

    @staticmethod
    def concat(parts: Sequence["Rollout"], pad_id: int) -> "Rollout":
        """Join rollouts, re-padding prompts on the left and completions on the right."""
        Lp = max(r.prompt_ids.shape[1] for r in parts)
        Tc = max(r.completion_ids.shape[1] for r in parts)

        def left(t: Tensor, width: int, value) -> Tensor:
            return torch.nn.functional.pad(t, (width - t.shape[1], 0), value=value)

        def right(t: Tensor, width: int, value) -> Tensor:
            return torch.nn.functional.pad(t, (0, width - t.shape[1]), value=value)

        return Rollout(
            torch.cat([left(r.prompt_ids, Lp, pad_id) for r in parts]),
            torch.cat([left(r.prompt_mask, Lp, 0) for r in parts]),
            torch.cat([right(r.completion_ids, Tc, pad_id) for r in parts]),
            torch.cat([right(r.completion_mask, Tc, False) for r in parts]),
            torch.cat([r.truncated for r in parts]),
            torch.cat([r.prompt_index for r in parts]),
            parts[0].group_size,
        )


def left_pad(seqs: Sequence[Sequence[int]], pad_id: int) -> tuple[Tensor, Tensor]:
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        if s:
            ids[i, width - len(s):] = torch.as_tensor(list(s), dtype=torch.long)
            mask[i, width - len(s):] = 1
    return ids, mask


def completion_mask(tokens: Tensor, eos_ids: Sequence[int]) -> tuple[Tensor, Tensor]:
    """Mask of the tokens up to and including the first EOS, and whether a row has no EOS (truncated)."""
    is_eos = torch.isin(tokens, torch.as_tensor(list(eos_ids), dtype=tokens.dtype, device=tokens.device))
    has_eos = is_eos.any(1)
    T = tokens.shape[1]
    first = torch.where(has_eos, is_eos.float().argmax(1), torch.full_like(has_eos, T, dtype=torch.long))
    mask = torch.arange(T, device=tokens.device).unsqueeze(0) <= first.unsqueeze(1)
    return mask, ~has_eos


def eos_token_ids(model, tokenizer) -> list[int]:
    ids: set[int] = set()
    cfg_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    for value in (cfg_eos, tokenizer.eos_token_id):
        if value is None:
            continue
        ids.update(value if isinstance(value, (list, tuple)) else [value])
    if not ids:
        raise ValueError("the tokenizer and the model's generation config name no end-of-sequence token")
    return sorted(ids)


class TransformersGenerator:
    """Samples with `model.generate` under the configured sampling settings (recorded in `settings`)."""

    def __init__(self, model, tokenizer, cfg: GenerationConfig):
        from transformers import GenerationConfig as HFGenerationConfig

        self.model, self.tokenizer, self.cfg = model, tokenizer, cfg
        self.pad_id = tokenizer.pad_token_id
        self.eos_ids = eos_token_ids(model, tokenizer)
        # A fresh generation config: the model's own defaults (top_k=50, repetition penalties...) do not leak in.
        self.hf_config = HFGenerationConfig(
            do_sample=True, temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k, min_p=cfg.min_p,
            repetition_penalty=cfg.repetition_penalty, max_new_tokens=cfg.max_new_tokens,
            eos_token_id=self.eos_ids, pad_token_id=self.pad_id, use_cache=True,
        )

    @property
    def settings(self) -> dict[str, float]:
        c = self.cfg
        out = {"sampling/temperature": c.temperature, "sampling/top_p": c.top_p, "sampling/top_k": c.top_k,
               "sampling/max_new_tokens": c.max_new_tokens, "sampling/group_size": c.group_size}
        if c.min_p is not None:
            out["sampling/min_p"] = c.min_p
        if c.repetition_penalty is not None:
            out["sampling/repetition_penalty"] = c.repetition_penalty
        return out

    @torch.no_grad()
    def generate(self, prompt_ids: Sequence[Sequence[int]], prompt_index: Sequence[int],
                 group_size: Optional[int] = None) -> Rollout:
        G = group_size or self.cfg.group_size
        per_call = max(1, self.cfg.batch_size // G)
        device = next(self.model.parameters()).device
        parts = []
        for start in range(0, len(prompt_ids), per_call):
            chunk = prompt_ids[start:start + per_call]
            ids, mask = left_pad(chunk, self.pad_id)
            self.hf_config.num_return_sequences = G
            out = self.model.generate(input_ids=ids.to(device), attention_mask=mask.to(device),
                                      generation_config=self.hf_config)
            tokens = out[:, ids.shape[1]:].cpu()
            cmask, truncated = completion_mask(tokens, self.eos_ids)
            index = torch.as_tensor(list(prompt_index[start:start + per_call]), dtype=torch.long)
            parts.append(Rollout(ids.repeat_interleave(G, 0), mask.repeat_interleave(G, 0), tokens, cmask,
                                 truncated, index.repeat_interleave(G), G))
        rollout = Rollout.concat(parts, self.pad_id)
        # tokens after the end of a completion are padding, whatever generate filled in
        rollout.completion_ids = torch.where(rollout.completion_mask, rollout.completion_ids,
                                             torch.full_like(rollout.completion_ids, self.pad_id))
        return rollout
