"""Per-sentence BLEU on token-id tensors, for a whole batch at once, on the training device.

The idea of TensorBLEU (count n-grams with a dictionary built from the batch itself, not from the
vocabulary): each distinct (sentence, n-gram) of the batch gets a compact id, and `bincount` counts
them, so memory is linear in the number of n-grams in the batch, whatever the vocabulary size. The ids
are built order by order from one int64 key per position, (id of the (n-1)-gram, next token), so
every step is a 1-D `torch.unique` (a sort), not a row-wise one.

The statistics and the score follow sacrebleu's sentence BLEU exactly (checked against
`sacrebleu.sentence_bleu(..., tokenize='none')` on the same token sequences in the tests):

* clipped counts: a hypothesis n-gram counts at most as often as in the reference that has it most
  (max over references);
* reference length: the reference closest in length to the hypothesis (ties: the shorter one);
* brevity penalty exp(1 - r / c) when c < r (0 for an empty hypothesis);
* no matching unigram -> 0;
* smoothing (Chen & Cherry 2014) `none`, `floor` (zero-match precisions become value / total,
  default 0.1), `add-k` (add value to matches and totals of orders >= 2, default 1) and `exp`
  (the k-th order without a match gets precision 1 / (2^k total); sacrebleu's sentence default);
* effective order (sacrebleu's sentence default): orders the hypothesis is too short for are left
  out of the geometric mean instead of making it 0.

Scores are in [0, 1] (sacrebleu reports 0-100). Maths runs in float64 (float32 on devices without it).
"""

from __future__ import annotations

import itertools
from typing import Optional, Sequence, Union

import torch
from torch import Tensor

SMOOTHING = ("none", "floor", "add-k", "exp")
SMOOTH_DEFAULTS = {"none": None, "floor": 0.1, "add-k": 1.0, "exp": None}
_LOG_ZERO = -9999999999.0  # what sacrebleu uses for log(0): the score underflows to exactly 0


def pad_ids(seqs: Sequence[Sequence[int]], device=None, pad: int = 0) -> tuple[Tensor, Tensor]:
    """(ids [B, L] right-padded, lengths [B]) from token-id lists (one flat copy, no per-row tensors)."""
    lengths = torch.tensor([len(s) for s in seqs], dtype=torch.long)
    width = int(lengths.max()) if len(seqs) else 0
    ids = torch.full((len(seqs), width), pad, dtype=torch.long)
    flat = torch.tensor(list(itertools.chain.from_iterable(seqs)), dtype=torch.long)
    if flat.numel():
        rows = torch.repeat_interleave(torch.arange(len(seqs)), lengths)
        cols = torch.arange(flat.numel()) - torch.repeat_interleave(lengths.cumsum(0) - lengths, lengths)
        ids[rows, cols] = flat
    return ids.to(device), lengths.to(device)


def bleu_statistics(
    hyp_ids: Tensor, hyp_lengths: Tensor, ref_ids: Tensor, ref_lengths: Tensor, max_n: int = 4
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Sufficient statistics of sentence BLEU, batched.

    hyp_ids [B, Lh], hyp_lengths [B]; ref_ids [B, R, Lr], ref_lengths [B, R] with -1 for a missing
    reference (a sentence may have fewer than R); token ids must be >= 0.
    Returns (correct [B, max_n] clipped matches, total [B, max_n] hypothesis n-grams,
    hyp_len [B], ref_len [B] closest reference length).

    N-grams get compact ids order by order: a unigram's key is (sentence, token); an n-gram's key is
    (id of its first n-1 tokens, last token). Each key is one int64, so one 1-D `torch.unique` per
    order gives the batch's own dictionary, and `bincount` counts in it.
    """
    B, R = ref_lengths.shape
    device = hyp_ids.device
    ref_present = ref_lengths >= 0
    if not bool(ref_present.any(1).all()):
        raise ValueError("every hypothesis needs at least one reference")
    # every sequence as one row: B hypotheses, then B * R references (row b * R + r)
    width = max(hyp_ids.shape[1], ref_ids.shape[2], 1)
    rows = torch.cat(
        [
            torch.nn.functional.pad(hyp_ids, (0, width - hyp_ids.shape[1])),
            torch.nn.functional.pad(ref_ids.reshape(B * R, -1), (0, width - ref_ids.shape[2])),
        ]
    )
    lengths = torch.cat([hyp_lengths, ref_lengths.reshape(-1).clamp_min(0)])
    owner = torch.cat([torch.arange(B, device=device), torch.arange(B, device=device).repeat_interleave(R)])
    which_ref = torch.arange(B * R, device=device) % R
    if rows.numel() and int(rows.min()) < 0:
        raise ValueError("token ids must be >= 0")
    V = int(rows.max()) + 1 if rows.numel() else 1
    pos = torch.arange(width, device=device)
    correct = torch.zeros((B, max_n), dtype=torch.long, device=device)
    prev = None
    for n in range(1, max_n + 1):
        span = width - n + 1
        if span <= 0:
            break
        valid = pos[:span].unsqueeze(0) + n <= lengths.unsqueeze(1)  # [S, span]
        if n == 1:
            key = owner.unsqueeze(1) * V + rows
        else:
            key = prev[:, :span] * V + rows[:, n - 1 :]
        key = torch.where(valid, key, torch.full_like(key, -1))
        uniq, prev = torch.unique(key, return_inverse=True)  # prev: compact id per position
        K = uniq.numel()
        hv, rv = valid[:B], valid[B:]
        hyp_count = torch.bincount(prev[:B][hv], minlength=K)
        ref_count = torch.bincount((prev[B:] * R + which_ref.unsqueeze(1))[rv], minlength=K * R).view(K, R).amax(1)
        clipped = torch.minimum(hyp_count, ref_count)
        key_owner = torch.zeros(K, dtype=torch.long, device=device)
        key_owner[prev[valid]] = owner.unsqueeze(1).expand_as(prev)[valid]
        correct[:, n - 1] = torch.zeros(B, dtype=torch.long, device=device).index_add_(0, key_owner, clipped)
    order = torch.arange(1, max_n + 1, device=device)
    total = (hyp_lengths.unsqueeze(1) - order + 1).clamp_min(0)
    # closest reference length, ties to the shorter one
    big = torch.iinfo(torch.long).max // 4
    diff = torch.where(ref_present, (ref_lengths - hyp_lengths.unsqueeze(1)).abs(), big)
    best = diff.amin(1, keepdim=True)
    ref_len = torch.where(ref_present & (diff == best), ref_lengths, big).amin(1)
    return correct, total, hyp_lengths.clone(), ref_len


def bleu_from_statistics(
    correct: Tensor,
    total: Tensor,
    hyp_len: Tensor,
    ref_len: Tensor,
    *,
    smooth_method: str = "exp",
    smooth_value: Optional[float] = None,
    effective_order: bool = True,
) -> Tensor:
    """Sentence BLEU in [0, 1] from the statistics of `bleu_statistics` (sacrebleu's rules, see the module doc)."""
    if smooth_method not in SMOOTHING:
        raise ValueError(f"smooth_method: expected one of {SMOOTHING}, got {smooth_method!r}")
    if smooth_value is None:
        smooth_value = SMOOTH_DEFAULTS[smooth_method]
    dtype = torch.float64 if correct.device.type not in ("mps",) else torch.float32
    c, t = correct.to(dtype), total.to(dtype)
    hl, rl = hyp_len.to(dtype), ref_len.to(dtype)
    B, N = c.shape
    if smooth_method == "add-k" and N > 1:
        c = torch.cat([c[:, :1], c[:, 1:] + smooth_value], 1)
        t = torch.cat([t[:, :1], t[:, 1:] + smooth_value], 1)
    # orders are used up to (not including) the first one without any hypothesis n-gram
    active = torch.cumprod((t > 0).to(torch.long), 1).bool()
    zero = (c == 0) & active
    t_safe = torch.where(active, t, torch.ones_like(t))
    prec = torch.where(active, c / t_safe, torch.zeros_like(t))
    if smooth_method == "exp":
        k = torch.cumsum(zero.to(dtype), 1)
        prec = torch.where(zero, 1.0 / (torch.pow(2.0, k) * t_safe), prec)
    elif smooth_method == "floor":
        prec = torch.where(zero, smooth_value / t_safe, prec)
    prec = prec * 100.0  # sacrebleu's scale, so that log(0) stands in the same proportion as there
    logp = torch.where(
        prec > 0, torch.log(torch.where(prec > 0, prec, torch.ones_like(prec))), torch.full_like(prec, _LOG_ZERO)
    )
    if effective_order:
        eff = active.sum(1).clamp_min(1)
        logp = torch.where(active, logp, torch.zeros_like(logp))
    else:
        eff = torch.full((B,), N, device=c.device)
    score = torch.exp(logp.sum(1) / eff.to(dtype)) / 100.0
    bp = torch.where(
        hl < rl, torch.where(hl > 0, torch.exp(1 - rl / hl.clamp_min(1)), torch.zeros_like(hl)), torch.ones_like(hl)
    )
    any_match = (correct > 0).any(1)
    return torch.where(any_match, bp * score, torch.zeros_like(score))


def _is_sequence(x) -> bool:
    try:
        len(x)
    except TypeError:
        return False
    return not isinstance(x, (str, bytes))


def sentence_bleu_ids(
    hypotheses: Sequence[Sequence[int]],
    references: Sequence[Union[Sequence[int], Sequence[Sequence[int]]]],
    *,
    max_n: int = 4,
    smooth_method: str = "exp",
    smooth_value: Optional[float] = None,
    effective_order: bool = True,
    device=None,
) -> Tensor:
    """Sentence BLEU in [0, 1] of each hypothesis (token-id list) against its reference(s), batched.

    references[i] is one token-id list, or a list of them (multiple references). sacrebleu's
    `sentence_bleu` defaults: exp smoothing, effective order.
    """
    if len(hypotheses) != len(references):
        raise ValueError(f"{len(hypotheses)} hypotheses but {len(references)} reference entries")
    refs: list[list[list[int]]] = []
    for r in references:
        r = list(r)
        refs.append([[int(t) for t in x] for x in r] if r and _is_sequence(r[0]) else [[int(t) for t in r]])
    B = len(refs)
    if B == 0:
        return torch.zeros(0, dtype=torch.float64)
    hyp_ids, hyp_len = pad_ids([[int(t) for t in h] for h in hypotheses], device)
    R = max(len(r) for r in refs)
    flat = [r[j] if j < len(r) else [] for r in refs for j in range(R)]
    ref_ids, ref_len = pad_ids(flat, device)
    missing = torch.tensor([j >= len(r) for r in refs for j in range(R)], device=ref_len.device)
    ref_ids, ref_len = ref_ids.view(B, R, -1), torch.where(missing, -1, ref_len).view(B, R)
    stats = bleu_statistics(hyp_ids, hyp_len, ref_ids, ref_len, max_n)
    return bleu_from_statistics(
        *stats, smooth_method=smooth_method, smooth_value=smooth_value, effective_order=effective_order
    )
