"""The model inputs of a rollout's rows, trimmed to what the rows use (the policy's and the critic's forwards)."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor


def trimmed_inputs(rollout: Any, rows: Tensor) -> tuple[Tensor, Tensor, Tensor, int]:
    """ids, attention mask, position ids of `rows` (prompt columns that are padding in every row dropped,
    completions cut to the longest), and that completion width."""
    pmask = rollout.prompt_mask[rows]
    cmask = rollout.completion_mask[rows]
    keep_from = int((pmask.sum(0) > 0).float().argmax()) if bool(pmask.any()) else pmask.shape[1] - 1
    width = max(int(cmask.sum(1).max()), 1)
    ids = torch.cat([rollout.prompt_ids[rows, keep_from:], rollout.completion_ids[rows, :width]], 1)
    attn = torch.cat([pmask[:, keep_from:], cmask[:, :width].long()], 1)
    return ids, attn, (attn.cumsum(1) - 1).clamp_min(0), width
