"""The text conditioning an adapter hands its denoiser: `PromptEmbeds` (cond / uncond rows, pooled vectors, token
masks) and how cached per-prompt rows are stacked into a batch."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import Tensor


@dataclasses.dataclass
class PromptEmbeds:
    """Text conditioning for a batch: row b of every tensor belongs to sample b.

    `cond` / `uncond` are token embeddings of the prompt / negative prompt; `pooled` / `uncond_pooled`
    the pooled vectors (SD3, FLUX); `mask` / `uncond_mask` token masks (families that need them).
    """

    cond: Tensor
    uncond: Tensor | None = None
    pooled: Tensor | None = None
    uncond_pooled: Tensor | None = None
    mask: Tensor | None = None
    uncond_mask: Tensor | None = None

    def __len__(self) -> int:
        return self.cond.shape[0]

    def _map(self, fn) -> "PromptEmbeds":
        values = {name: getattr(self, name) for name in _EMBED_FIELDS}
        return PromptEmbeds(**{k: None if t is None else fn(t) for k, t in values.items()})

    def index(self, idx: Any) -> "PromptEmbeds":
        """Rows `idx` (int list, slice, bool or long tensor) of every tensor; an int keeps the batch dim."""
        if isinstance(idx, int):
            idx = [idx]
        if isinstance(idx, Tensor):
            idx = idx.to(self.cond.device)
        return self._map(lambda t: t[idx])

    def to(self, device: Any = None, dtype: torch.dtype | None = None) -> "PromptEmbeds":
        """Move every tensor; `dtype` applies to floating tensors only (masks keep theirs)."""
        return self._map(lambda t: t.to(device=device, dtype=dtype if t.is_floating_point() else None))

    def conditional(self) -> dict[str, Tensor | None]:
        return {"embeds": self.cond, "pooled": self.pooled, "mask": self.mask}

    def unconditional(self) -> dict[str, Tensor | None]:
        if self.uncond is None:
            raise ValueError("these PromptEmbeds have no uncond branch; encode them with a negative prompt")
        return {"embeds": self.uncond, "pooled": self.uncond_pooled, "mask": self.uncond_mask}

    def cfg_pair(self) -> dict[str, Tensor | None]:
        """[uncond; cond] stacked on the batch dim, the order diffusers' pipelines use."""
        if self.uncond is None:
            raise ValueError("these PromptEmbeds have no uncond branch; encode them with a negative prompt")

        # Families with token masks may have cond and uncond of different lengths: pad to the longer.
        n = max(self.cond.shape[1], self.uncond.shape[1])
        pad = (lambda t: _pad(t, n)) if self.mask is not None else (lambda t: t)
        return {
            "embeds": torch.cat([pad(self.uncond), pad(self.cond)]),
            "pooled": None if self.pooled is None else torch.cat([self.uncond_pooled, self.pooled]),
            "mask": None if self.mask is None else torch.cat([pad(self.uncond_mask), pad(self.mask)]),
        }


_EMBED_FIELDS = tuple(f.name for f in dataclasses.fields(PromptEmbeds))


def _pad(t: Tensor, n: int) -> Tensor:
    """Zero-pad dim 1 (tokens) to length n: padded tokens have mask 0."""
    return t if t.shape[1] == n else torch.nn.functional.pad(t, (0, 0) * (t.dim() - 2) + (0, n - t.shape[1]))


def stack_rows(rows: list[dict[str, Tensor]]) -> dict[str, Tensor]:
    """Rows of one prompt each -> one batch, token dims zero-padded to the longest (pooled vectors as they are)."""
    n = max(r["embeds"].shape[1] for r in rows)
    return {k: torch.cat([r[k] if k == "pooled" else _pad(r[k], n) for r in rows]) for k in rows[0]}
