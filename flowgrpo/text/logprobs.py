"""Token log-probs of completions under a policy, recomputed in micro-batches.

The logits are divided by the sampling temperature, so log-probs are those of the distribution the
completions were sampled from (before top-k / top-p truncation, as in TRL). Each micro-batch is
trimmed to its own width (leading all-padding prompt columns, trailing all-padding completion
columns); position ids come from the attention mask, so padding never shifts a position.

Shared prompts: the G completions of a group share their prompt. With `shared_prompt=True` each
distinct prompt of a micro-batch runs through the model once, its key/value cache is repeated for the
rows that share it (an index, so gradients flow back into the one prompt pass), and only the
completion tokens run per row. Same maths, fewer FLOPs: the prompt tokens of a micro-batch are
computed once per prompt instead of once per completion. `shared_prompt_deviation` measures how far
the two paths are apart for a model, `sampler_deviation` how far the plain one is from the engine that
sampled (the trainer uses the shared path when it is no further from the plain one than that, or than a
tenth of the ratio-check tolerance).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from .generation import Rollout
from .inputs import trimmed_inputs


@dataclass(frozen=True)
class TokenLogprobs:
    """Per-token log-probs of completions and, when asked for, the policy's entropies there."""

    logp: Tensor  # [n, Tc] log-probs of the completion tokens; zero past each row's width
    entropy: Optional[Tensor] = None  # [n, Tc] entropies (same padding), None when not computed
    vocab_mean: Optional[Tensor] = None  # [n, Tc] mean over the vocabulary of the log-softmax (ROVER), no grad


def _shared_prompt_logits(
    model, rollout: Rollout, rows: Tensor, prompts: Tensor, where: Tensor, device
) -> tuple[Tensor, int]:
    """Logits [n, width, V] predicting each completion token of `rows`: one pass over the distinct
    prompts (`prompts`: one row of each; `where[i]`: the distinct prompt of rows[i]), then the
    completions on the repeated prompt cache."""
    pmask = rollout.prompt_mask[prompts]
    keep_from = int((pmask.sum(0) > 0).float().argmax())
    ids_p, mask_p = rollout.prompt_ids[prompts, keep_from:], pmask[:, keep_from:]
    out_p = model(
        input_ids=ids_p.to(device),
        attention_mask=mask_p.to(device),
        position_ids=(mask_p.cumsum(1) - 1).clamp_min(0).to(device),
        use_cache=True,
        logits_to_keep=1,
    )
    where_d = where.to(device)
    first = out_p.logits[:, -1:][where_d]  # left padding: the last column is a real token
    cmask = rollout.completion_mask[rows]
    width = max(int(cmask.sum(1).max()), 1)
    if width == 1:
        return first, width
    # the cache argument's name: `cache` (transformers >= 5.x), `past_key_values` before; the output says which
    cache_arg = "cache"
    cache = getattr(out_p, "cache", None)
    if cache is None:
        cache_arg, cache = "past_key_values", out_p.past_key_values
    cache.batch_select_indices(where_d)  # repeat each prompt's cache for its rows
    attn = torch.cat([mask_p[where], cmask[:, : width - 1].long()], 1)
    pos = mask_p.sum(1)[where].unsqueeze(1) + torch.arange(width - 1).unsqueeze(0)
    out_c = model(
        input_ids=rollout.completion_ids[rows, : width - 1].to(device),
        attention_mask=attn.to(device),
        position_ids=pos.to(device),
        use_cache=True,
        **{cache_arg: cache},
    )
    return torch.cat([first, out_c.logits], 1), width


def micro_logprobs(
    model,
    rollout: Rollout,
    rows: Tensor,
    temperature: float,
    with_entropy: bool = False,
    entropy_grad: bool = True,
    shared_prompt: bool = False,
    with_vocab_mean: bool = False,
) -> TokenLogprobs:
    """Log-probs [n, Tc] (and entropies) of the completion tokens of `rows`; zero beyond each micro-batch's width.

    Runs with or without grad as the caller's context says; `entropy_grad=False` computes the entropy
    (a metric then) without building its graph. `shared_prompt`: run each distinct prompt once (used
    only when some rows share a prompt). `with_vocab_mean`: also the mean over the vocabulary of the
    log-softmax at each position, mean logit - logsumexp (ROVER's next-state term; never with grad).
    """
    device = next(model.parameters()).device
    prompts, where = None, None
    if shared_prompt:
        uniq, where = torch.unique(rollout.prompt_index[rows], return_inverse=True)
        if uniq.numel() < rows.numel():
            prompts = torch.zeros(uniq.numel(), dtype=torch.long)
            prompts[where] = rows  # one row of each distinct prompt
    if prompts is not None:
        logits, width = _shared_prompt_logits(model, rollout, rows, prompts, where, device)
        logits = logits.float()
    else:
        ids, attn, pos, width = trimmed_inputs(rollout, rows)
        out = model(
            input_ids=ids.to(device),
            attention_mask=attn.to(device),
            position_ids=pos.to(device),
            logits_to_keep=width + 1,
            use_cache=False,
        )
        logits = out.logits[:, :-1].float()
    if temperature != 1.0:
        logits = logits / temperature
    targets = rollout.completion_ids[rows, :width].to(device)
    lse = torch.logsumexp(logits, -1)
    logp = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse
    entropy = None
    if with_entropy:
        with torch.set_grad_enabled(torch.is_grad_enabled() and entropy_grad):
            lg = logits if entropy_grad else logits.detach()
            entropy = (lse if entropy_grad else lse.detach()) - (torch.softmax(lg, -1) * lg).sum(-1)
    vocab_mean = None
    if with_vocab_mean:
        with torch.no_grad():  # a reduction of the logits already there: no [n, width, V] tensor more
            vocab_mean = logits.mean(-1) - lse
    Tc = rollout.completion_ids.shape[1]
    pad = (0, Tc - width)
    logp = torch.nn.functional.pad(logp, pad)
    if entropy is not None:
        entropy = torch.nn.functional.pad(entropy, pad)
    if vocab_mean is not None:
        vocab_mean = torch.nn.functional.pad(vocab_mean, pad)
    return TokenLogprobs(logp, entropy, vocab_mean)


@torch.no_grad()
def batch_logprobs(
    model,
    rollout: Rollout,
    temperature: float,
    batch_size: int,
    with_entropy: bool = False,
    shared_prompt: bool = False,
) -> TokenLogprobs:
    """No-grad log-probs [N, Tc] of a whole rollout (old policy, reference), `batch_size` rows at a time."""
    N = rollout.num_sequences
    logps, ents = [], []
    for start in range(0, N, batch_size):
        rows = torch.arange(start, min(start + batch_size, N))
        part = micro_logprobs(model, rollout, rows, temperature, with_entropy, shared_prompt=shared_prompt)
        logps.append(part.logp)
        ents.append(part.entropy)
    logp = torch.cat(logps)
    return TokenLogprobs(logp, torch.cat(ents) if with_entropy else None)


@torch.no_grad()
def shared_prompt_deviation(
    model, rollout: Rollout, rows: Tensor, temperature: float, plain: Optional[Tensor] = None
) -> float:
    """max |log-prob difference| over the completion tokens of `rows` between the shared-prompt and the
    plain forward (inf when the shared path fails for this model); `plain`: that forward's log-probs, if
    the caller has them."""
    if plain is None:
        plain = micro_logprobs(model, rollout, rows, temperature).logp
    try:
        shared = micro_logprobs(model, rollout, rows, temperature, shared_prompt=True).logp
    except Exception:  # noqa: BLE001 - a model whose cache cannot be repeated: the plain path it is
        return float("inf")
    mask = rollout.completion_mask[rows].to(plain.device)
    if not bool(mask.any()):
        return 0.0
    return float((plain - shared)[mask].abs().max())


@torch.no_grad()
def sampler_deviation(
    model, rollout: Rollout, rows: Tensor, temperature: float, plain: Optional[Tensor] = None
) -> Optional[float]:
    """max |log-prob difference| over the completion tokens of `rows` between the plain forward and the
    sampler's own log-probs (`rollout.rollout_logp`); None when the rollout has none. `plain`: as above."""
    if rollout.rollout_logp is None:
        return None
    if plain is None:
        plain = micro_logprobs(model, rollout, rows, temperature).logp
    mask = rollout.completion_mask[rows].to(plain.device)
    if not bool(mask.any()):
        return 0.0
    return float((plain - rollout.rollout_logp[rows].to(plain.device))[mask].abs().max())
