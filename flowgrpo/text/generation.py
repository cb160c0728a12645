"""Generation backend on transformers `generate`: G samples per prompt, batched, left padding, KV cache.

The result is a `Rollout`: prompt and completion token ids as padded tensors, the completion mask
(every token up to and including the first end-of-sequence token), which completions were cut by
`max_new_tokens` (truncated: no end-of-sequence token) and, when asked for, the log-prob the sampler
gave each token (`rollout_logp`: what the rollout-vs-training mismatch check compares against).

A `seed` makes a call's samples depend on that seed only (not on what ran before): the trainer seeds
each chunk of prompts by (run seed, step, round, chunk), so a chunk samples the same completions on
any rank of any number of processes, and after a resume.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
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
    rollout_logp: Optional[Tensor] = None  # [N, Tc] the sampler's log-prob of each token (0 on padding)
    valid: Optional[Tensor] = None  # [N] bool, False: a padding row of a ragged group (Knapsack RL); None: all real

    @property
    def num_sequences(self) -> int:
        return self.completion_ids.shape[0]

    @property
    def lengths(self) -> Tensor:
        return self.completion_mask.sum(1)

    def select_groups(self, groups: Sequence[int]) -> "Rollout":
        """The rollout restricted to whole groups (by group index), in the given order."""
        G = self.group_size
        return self.select_rows(torch.tensor([g * G + j for g in groups for j in range(G)], dtype=torch.long), G)

    def select_rows(self, idx: Tensor, group_size: int) -> "Rollout":
        """Rows `idx`, in that order, read as groups of `group_size`."""
        return Rollout(
            self.prompt_ids[idx],
            self.prompt_mask[idx],
            self.completion_ids[idx],
            self.completion_mask[idx],
            self.truncated[idx],
            self.prompt_index[idx],
            group_size,
            None if self.rollout_logp is None else self.rollout_logp[idx],
            None if self.valid is None else self.valid[idx],
        )

    def padded(self, rows: int, pad_id: int) -> "Rollout":
        """One prompt's group (every row the same prompt) grown to `rows` rows by padding rows: the prompt, no
        completion token, `valid` False."""
        extra = rows - self.num_sequences
        if extra <= 0:
            return self
        first = torch.zeros(extra, dtype=torch.long)
        Tc = self.completion_ids.shape[1]
        pad = Rollout(
            self.prompt_ids[first],
            self.prompt_mask[first],
            torch.full((extra, Tc), pad_id, dtype=self.completion_ids.dtype),
            torch.zeros(extra, Tc, dtype=torch.bool),
            torch.zeros(extra, dtype=torch.bool),
            self.prompt_index[first],
            rows,
            None if self.rollout_logp is None else torch.zeros(extra, Tc, dtype=self.rollout_logp.dtype),
            torch.zeros(extra, dtype=torch.bool),
        )
        return Rollout.concat([replace(self, group_size=rows), pad], pad_id)

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
            None
            if any(r.rollout_logp is None for r in parts)
            else torch.cat([right(r.rollout_logp, Tc, 0.0) for r in parts]),
            None
            if all(r.valid is None for r in parts)
            else torch.cat(
                [torch.ones(r.num_sequences, dtype=torch.bool) if r.valid is None else r.valid for r in parts]
            ),
        )


def left_pad(seqs: Sequence[Sequence[int]], pad_id: int) -> tuple[Tensor, Tensor]:
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        if s:
            ids[i, width - len(s) :] = torch.as_tensor(list(s), dtype=torch.long)
            mask[i, width - len(s) :] = 1
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


class SampledLogprobRecorder:
    """A logits processor that records the log-prob of each sampled token, one step late.

    transformers runs user processors before its temperature / top-k / top-p warpers, so the scores seen
    here are the model's logits; divided by the temperature they give the distribution the trainer
    re-scores (the full temperature-scaled one). Only the previous step's [B, V] log-probs are kept: at
    step t the token sampled at t - 1 is the last input id. `finish` reads the last token.
    """

    def __init__(self, temperature: float):
        self.temperature = temperature
        self.prev: Optional[Tensor] = None
        self.columns: list[Tensor] = []

    def __call__(self, input_ids: Tensor, scores: Tensor) -> Tensor:
        self._take(input_ids[:, -1])
        self.prev = torch.log_softmax(scores.float() / self.temperature, -1)
        return scores

    def _take(self, tokens: Tensor) -> None:
        if self.prev is not None:
            self.columns.append(self.prev.gather(1, tokens.unsqueeze(1)).squeeze(1).cpu())

    def finish(self, completion_tokens: Tensor) -> Tensor:
        """[B, T] log-probs of `completion_tokens` (the tokens generate returned after the prompt)."""
        if self.prev is not None:
            self._take(completion_tokens[:, -1].to(self.prev.device))
        self.prev = None
        out = torch.stack(self.columns, 1) if self.columns else torch.zeros(completion_tokens.shape[0], 0)
        self.columns = []
        return out[:, : completion_tokens.shape[1]]


def prompts_per_call(cfg: GenerationConfig, group_size: int) -> int:
    """Prompts per generate call: `batch_size` sequences at most, at least one prompt."""
    return max(1, cfg.batch_size // group_size)


def seeded(seed: Optional[int], device: torch.device):
    """A scope whose global RNG streams start from `seed` (CPU and the model's CUDA device) and are
    restored afterwards; no-op without a seed."""
    import contextlib

    if seed is None:
        return contextlib.nullcontext()
    devices = [device] if device.type == "cuda" else []

    @contextlib.contextmanager
    def scope():
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(seed)
            yield

    return scope()


class TransformersGenerator:
    """Samples with `model.generate` under the configured sampling settings (recorded in `settings`);
    `group_size` completions per prompt unless a call asks for another number."""

    def __init__(self, model, tokenizer, cfg: GenerationConfig, group_size: int, synced: bool = False):
        from transformers import GenerationConfig as HFGenerationConfig

        self.model, self.tokenizer, self.cfg, self.group_size = model, tokenizer, cfg, group_size
        # a sharded model: every rank runs a forward per token until the last rank's sequences end
        self.synced = synced
        self.pad_id = tokenizer.pad_token_id
        self.eos_ids = eos_token_ids(model, tokenizer)
        # A fresh generation config: the model's own defaults (top_k=50, repetition penalties...) do not leak in.
        self.hf_config = HFGenerationConfig(
            do_sample=True,
            temperature=cfg.temperature,
            top_p=cfg.top_p,
            top_k=cfg.top_k,
            min_p=cfg.min_p,
            repetition_penalty=cfg.repetition_penalty,
            max_new_tokens=cfg.max_new_tokens,
            eos_token_id=self.eos_ids,
            pad_token_id=self.pad_id,
            use_cache=True,
        )

    @property
    def settings(self) -> dict[str, float]:
        return sampling_settings(self.cfg, self.group_size)

    def sync_weights(self) -> None:
        """Nothing to do: generate runs on the policy itself."""

    @torch.no_grad()
    def generate(
        self,
        prompt_ids: Sequence[Sequence[int]],
        prompt_index: Sequence[int],
        group_size: Optional[int] = None,
        seed: Optional[int] = None,
        max_new_tokens: Optional[int] = None,
    ) -> Rollout:
        """G completions of each prompt; `max_new_tokens`: this call's limit instead of the configured one (T-PPO's
        windows, flowgrpo/text/windows.py)."""
        from transformers import LogitsProcessorList

        G = group_size or self.group_size
        self.hf_config.max_new_tokens = max_new_tokens or self.cfg.max_new_tokens
        per_call = prompts_per_call(self.cfg, G)
        device = next(self.model.parameters()).device
        parts = []
        with seeded(seed, device):
            for start in range(0, len(prompt_ids), per_call):
                chunk = prompt_ids[start : start + per_call]
                ids, mask = left_pad(chunk, self.pad_id)
                self.hf_config.num_return_sequences = G
                recorder = SampledLogprobRecorder(self.cfg.temperature) if self.cfg.rollout_logprobs else None
                out = self.model.generate(
                    input_ids=ids.to(device),
                    attention_mask=mask.to(device),
                    generation_config=self.hf_config,
                    logits_processor=LogitsProcessorList([recorder]) if recorder else None,
                    synced_gpus=self.synced,
                )
                tokens = out[:, ids.shape[1] :].cpu()
                cmask, truncated = completion_mask(tokens, self.eos_ids)
                index = torch.as_tensor(list(prompt_index[start : start + per_call]), dtype=torch.long)
                parts.append(
                    Rollout(
                        ids.repeat_interleave(G, 0),
                        mask.repeat_interleave(G, 0),
                        tokens,
                        cmask,
                        truncated,
                        index.repeat_interleave(G),
                        G,
                        recorder.finish(tokens) if recorder else None,
                    )
                )
        return finalize(Rollout.concat(parts, self.pad_id), self.pad_id)


def finalize(rollout: Rollout, pad_id: int) -> Rollout:
    """Tokens after the end of a completion become padding (whatever the engine filled in), their
    rollout log-probs 0."""
    m = rollout.completion_mask
    rollout.completion_ids = torch.where(m, rollout.completion_ids, torch.full_like(rollout.completion_ids, pad_id))
    if rollout.rollout_logp is not None:
        rollout.rollout_logp = torch.where(m, rollout.rollout_logp, torch.zeros_like(rollout.rollout_logp))
    return rollout


def sampling_settings(cfg: GenerationConfig, group_size: int) -> dict[str, float]:
    """The sampling settings, as metrics of every step."""
    out = {
        "sampling/temperature": cfg.temperature,
        "sampling/top_p": cfg.top_p,
        "sampling/top_k": cfg.top_k,
        "sampling/max_new_tokens": cfg.max_new_tokens,
        "sampling/group_size": group_size,
    }
    if cfg.min_p is not None:
        out["sampling/min_p"] = cfg.min_p
    if cfg.repetition_penalty is not None:
        out["sampling/repetition_penalty"] = cfg.repetition_penalty
    return out
