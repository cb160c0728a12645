"""The text conditioning an adapter hands its denoiser: `PromptEmbeds` (cond / uncond rows, pooled vectors, token
masks, an optional second token stream) and how cached per-prompt rows are stacked into a batch."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import Tensor

# The keys of one encoded row (`Adapter._encode`) and of the dicts `_forward` gets: each token stream is
# (embeds key, mask key); a stream's tokens are padded with zeros (mask 0), to its own length.
STREAMS = (("embeds", "mask"), ("embeds2", "mask2"))


@dataclasses.dataclass
class PromptEmbeds:
    """Text conditioning for a batch: row b of every tensor belongs to sample b.

    `cond` / `uncond` are token embeddings of the prompt / negative prompt; `pooled` / `uncond_pooled`
    the pooled vectors (SD3, FLUX); `mask` / `uncond_mask` token masks (families that need them).
    `cond2` / `uncond2` with `mask2` / `uncond_mask2`: a second masked token stream (HunyuanVideo 1.5's byT5
    glyph tokens), cached, batched, padded and paired for CFG as the first; `_forward` gets it as
    text["embeds2"] / text["mask2"].
    """

    cond: Tensor
    uncond: Tensor | None = None
    pooled: Tensor | None = None
    uncond_pooled: Tensor | None = None
    mask: Tensor | None = None
    uncond_mask: Tensor | None = None
    cond2: Tensor | None = None
    uncond2: Tensor | None = None
    mask2: Tensor | None = None
    uncond_mask2: Tensor | None = None

    @classmethod
    def from_rows(cls, cond: dict[str, Tensor], uncond: dict[str, Tensor], **extra: Any) -> "PromptEmbeds":
        """From the stacked rows (`stack_rows`) of the prompts and of the negative prompt (+ a subclass's `extra`
        fields)."""
        return cls(
            cond=cond["embeds"],
            uncond=uncond["embeds"],
            pooled=cond.get("pooled"),
            uncond_pooled=uncond.get("pooled"),
            mask=cond.get("mask"),
            uncond_mask=uncond.get("mask"),
            cond2=cond.get("embeds2"),
            uncond2=uncond.get("embeds2"),
            mask2=cond.get("mask2"),
            uncond_mask2=uncond.get("mask2"),
            **extra,
        )

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
        return {"embeds": self.cond, "pooled": self.pooled, "mask": self.mask, **self._second(self.cond2, self.mask2)}

    def unconditional(self) -> dict[str, Tensor | None]:
        if self.uncond is None:
            raise ValueError("these PromptEmbeds have no uncond branch; encode them with a negative prompt")
        return {
            "embeds": self.uncond,
            "pooled": self.uncond_pooled,
            "mask": self.uncond_mask,
            **self._second(self.uncond2, self.uncond_mask2),
        }

    def cfg_pair(self) -> dict[str, Tensor | None]:
        """[uncond; cond] stacked on the batch dim, the order diffusers' pipelines use."""
        if self.uncond is None:
            raise ValueError("these PromptEmbeds have no uncond branch; encode them with a negative prompt")
        pair = {
            "pooled": None if self.pooled is None else torch.cat([self.uncond_pooled, self.pooled]),
            **_pair(self.uncond, self.cond, self.uncond_mask, self.mask, STREAMS[0]),
        }
        if self.cond2 is not None:
            pair.update(_pair(self.uncond2, self.cond2, self.uncond_mask2, self.mask2, STREAMS[1]))
        return pair

    @staticmethod
    def _second(embeds: Tensor | None, mask: Tensor | None) -> dict[str, Tensor | None]:
        # only families with a second stream see its keys
        return {} if embeds is None else {"embeds2": embeds, "mask2": mask}


_EMBED_FIELDS = tuple(f.name for f in dataclasses.fields(PromptEmbeds))


def _pair(uncond: Any, cond: Tensor, uncond_mask: Any, mask: Tensor | None, keys: tuple[str, str]) -> dict[str, Any]:
    """One token stream's [uncond; cond]. With a token mask, cond and uncond may differ in length: padded to the
    longer (padded tokens have mask 0)."""
    n = max(cond.shape[1], uncond.shape[1])
    pad = (lambda t: _pad(t, n)) if mask is not None else (lambda t: t)
    return {
        keys[0]: torch.cat([pad(uncond), pad(cond)]),
        keys[1]: None if mask is None else torch.cat([pad(uncond_mask), pad(mask)]),
    }


def _pad(t: Tensor, n: int) -> Tensor:
    """Zero-pad dim 1 (tokens) to length n: padded tokens have mask 0."""
    return t if t.shape[1] == n else torch.nn.functional.pad(t, (0, 0) * (t.dim() - 2) + (0, n - t.shape[1]))


def real_tokens(rows: dict[str, Tensor], i: int) -> dict[str, Tensor]:
    """Row i of one encoder pass as a cached row: each masked stream keeps its real tokens only (`stack_rows` pads
    per batch); unmasked streams and pooled vectors as they are."""
    row = {k: v[i : i + 1] for k, v in rows.items()}
    for embeds, mask in STREAMS:
        if mask in row:
            n = int(row[mask].sum())
            row[embeds], row[mask] = row[embeds][:, :n], row[mask][:, :n]
    return row


def stack_rows(rows: list[dict[str, Tensor]]) -> dict[str, Tensor]:
    """Rows of one prompt each -> one batch, each token stream zero-padded to its longest (pooled vectors as they
    are)."""
    out = {k: torch.cat([r[k] for r in rows]) for k in rows[0] if k == "pooled"}
    for embeds, mask in STREAMS:
        if embeds in rows[0]:
            n = max(r[embeds].shape[1] for r in rows)
            out.update({k: torch.cat([_pad(r[k], n) for r in rows]) for k in (embeds, mask) if k in rows[0]})
    return out
