"""Token log-probs of completions under a policy, recomputed in micro-batches.

The logits are divided by the sampling temperature, so log-probs are those of the distribution the
completions were sampled from (before top-k / top-p truncation, as in TRL). Each micro-batch is
trimmed to its own width (leading all-padding prompt columns, trailing all-padding completion
columns); position ids come from the attention mask, so padding never shifts a position.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .generation import Rollout


def _trimmed_inputs(rollout: Rollout, rows: Tensor) -> tuple[Tensor, Tensor, Tensor, int]:
    pmask = rollout.prompt_mask[rows]
    cmask = rollout.completion_mask[rows]
    keep_from = int((pmask.sum(0) > 0).float().argmax()) if bool(pmask.any()) else pmask.shape[1] - 1
    width = max(int(cmask.sum(1).max()), 1)
    ids = torch.cat([rollout.prompt_ids[rows, keep_from:], rollout.completion_ids[rows, :width]], 1)
    attn = torch.cat([pmask[:, keep_from:], cmask[:, :width].long()], 1)
    return ids, attn, (attn.cumsum(1) - 1).clamp_min(0), width


def micro_logprobs(model, rollout: Rollout, rows: Tensor, temperature: float,
                   with_entropy: bool = False) -> tuple[Tensor, Optional[Tensor]]:
    """Log-probs [n, Tc] (and entropies) of the completion tokens of `rows`; zero beyond each micro-batch's width.

    Runs with or without grad as the caller's context says.
    """
    device = next(model.parameters()).device
    ids, attn, pos, width = _trimmed_inputs(rollout, rows)
    out = model(input_ids=ids.to(device), attention_mask=attn.to(device), position_ids=pos.to(device),
                logits_to_keep=width + 1, use_cache=False)
    logits = out.logits[:, :-1].float()
    if temperature != 1.0:
        logits = logits / temperature
    targets = rollout.completion_ids[rows, :width].to(device)
    lse = torch.logsumexp(logits, -1)
    logp = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse
    entropy = None
    if with_entropy:
        probs = torch.softmax(logits, -1)
        entropy = lse - (probs * logits).sum(-1)
    Tc = rollout.completion_ids.shape[1]
    pad = (0, Tc - width)
    logp = torch.nn.functional.pad(logp, pad)
    if entropy is not None:
        entropy = torch.nn.functional.pad(entropy, pad)
    return logp, entropy


@torch.no_grad()
def batch_logprobs(model, rollout: Rollout, temperature: float, batch_size: int,
                   with_entropy: bool = False) -> tuple[Tensor, Optional[Tensor]]:
    """No-grad log-probs [N, Tc] of a whole rollout (old policy, reference), `batch_size` rows at a time."""
    N = rollout.num_sequences
    logps, ents = [], []
    for start in range(0, N, batch_size):
        rows = torch.arange(start, min(start + batch_size, N))
        lp, ent = micro_logprobs(model, rollout, rows, temperature, with_entropy)
        logps.append(lp)
        ents.append(ent)
    logp = torch.cat(logps)
    return logp, (torch.cat(ents) if with_entropy else None)
