"""Scorer contracts.

Pointwise: images [B] + prompts (+ metadata: a dict of lists of length B) -> {key: float32 [B]}.
Pairwise:  images_a [B], images_b [B] + prompts -> P(a beats b), float32 [B].

NaN means "could not score" and is never replaced by 0. The base classes own what every scorer
must do the same way: input checks, micro-batching, NaN rows for images with non-finite pixels,
output checks, and counters for logging. Subclasses implement one micro-batch.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Mapping, Sequence

import torch

from .images import ImageBatch

Metadata = Mapping[str, Sequence[Any]]


class Scorer:
    """Pointwise scorer. Subclasses set `name` and implement `score_batch`."""

    name: str = ""
    requires_prompts: bool = False
    metadata_keys: tuple[str, ...] = ()  # metadata every call must carry
    differentiable: bool = False  # True: gradients reach tensor pixels

    def __init__(self, *, batch_size: int = 32, key: str | None = None):
        if int(batch_size) < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.batch_size = int(batch_size)
        self._key = key
        self.counters: Counter = Counter()

    @property
    def key(self) -> str:
        """Output key of the main score; extra outputs are named '<key>/<what>'."""
        return self._key or self.name

    def score_batch(self, images: ImageBatch, prompts: list[str], metadata: dict[str, list]) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def __call__(
        self, images, prompts: Sequence[str] | None = None, metadata: Metadata | None = None
    ) -> dict[str, torch.Tensor]:
        batch = ImageBatch.of(images)
        n = len(batch)
        prompts = check_prompts(prompts, n, self.requires_prompts, self.name)
        metadata = check_metadata(metadata, n, self.metadata_keys, self.name)
        ok = batch.finite()
        clean = batch.sanitized()
        parts = []
        for start in range(0, n, self.batch_size):
            sl = slice(start, start + self.batch_size)
            out = self.score_batch(clean[sl], prompts[sl], {k: v[sl] for k, v in metadata.items()})
            parts.append(self._check_output(out, len(prompts[sl])))
        if not parts:
            return {self.key: torch.empty(0)}
        device = batch.device
        result = {k: torch.cat([p[k].to(device=device, dtype=torch.float32) for p in parts]) for k in parts[0]}
        if not bool(ok.all()):
            mask = ok.to(device)
            result = {k: torch.where(mask, v, torch.full_like(v, float("nan"))) for k, v in result.items()}
        self.counters["calls"] += 1
        self.counters["images"] += n
        self.counters["nan"] += int(torch.isnan(result[self.key].detach()).sum())
        return result

    def _check_output(self, out: Mapping[str, torch.Tensor], n: int) -> dict[str, torch.Tensor]:
        if self.key not in out:
            raise RuntimeError(f"scorer '{self.name}' returned keys {sorted(out)} without its key '{self.key}'")
        for k, v in out.items():
            if k != self.key and not k.startswith(self.key + "/"):
                raise RuntimeError(f"scorer '{self.name}' output '{k}' must be named '{self.key}/...'")
            if not isinstance(v, torch.Tensor) or v.shape != (n,):
                got = tuple(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__
                raise RuntimeError(f"scorer '{self.name}' output '{k}' must be a tensor of shape ({n},), got {got}")
        return dict(out)

    def to(self, device=None, dtype=None) -> "Scorer":
        """Move model weights; a no-op for scorers without weights."""
        return self

    def close(self) -> None:
        """Release resources (connections, GPU memory)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(key={self.key!r}, batch_size={self.batch_size})"


class Pretrained:
    """from_pretrained / tiny for scorers with weights. Both go through the registry factory, so
    Python code and a config build the same object with the same settings and checks."""

    @classmethod
    def from_pretrained(cls, model: str | None = None, **settings: Any):
        """model: a local directory or a hub id (default: the published checkpoint)."""
        from .registry import build_scorer

        if model is not None:
            settings["model"] = model
        return build_scorer(cls.name, **settings)

    @classmethod
    def tiny(cls, **settings: Any):
        """Tiny random weights built from configs, on CPU unless told otherwise (tests, demos)."""
        from .registry import build_scorer

        settings.setdefault("device", "cpu")
        return build_scorer(cls.name, tiny=True, **settings)


class PairwiseScorer:
    """Pairwise scorer: P(a beats b) per row. Subclasses set `name` and implement `compare_batch`."""

    name: str = ""
    requires_prompts: bool = False
    metadata_keys: tuple[str, ...] = ()

    def __init__(self, *, batch_size: int = 32):
        if int(batch_size) < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.batch_size = int(batch_size)
        self.counters: Counter = Counter()

    def compare_batch(
        self, a: ImageBatch, b: ImageBatch, prompts: list[str], metadata: dict[str, list]
    ) -> torch.Tensor:
        raise NotImplementedError

    def __call__(
        self, images_a, images_b, prompts: Sequence[str] | None = None, metadata: Metadata | None = None
    ) -> torch.Tensor:
        a, b = ImageBatch.of(images_a), ImageBatch.of(images_b)
        n = len(a)
        if len(b) != n:
            raise ValueError(f"pairwise scorer '{self.name}': {n} images in a but {len(b)} in b")
        prompts = check_prompts(prompts, n, self.requires_prompts, self.name)
        metadata = check_metadata(metadata, n, self.metadata_keys, self.name)
        ok = a.finite() & b.finite()
        a, b = a.sanitized(), b.sanitized()
        parts = []
        for start in range(0, n, self.batch_size):
            sl = slice(start, start + self.batch_size)
            p = self.compare_batch(a[sl], b[sl], prompts[sl], {k: v[sl] for k, v in metadata.items()})
            if not isinstance(p, torch.Tensor) or p.shape != (len(prompts[sl]),):
                raise RuntimeError(f"pairwise scorer '{self.name}' must return a tensor of shape ({len(prompts[sl])},)")
            parts.append(p.to(device=a.device, dtype=torch.float32))
        p = torch.cat(parts) if parts else torch.empty(0)
        p = torch.where(ok.to(p.device), p, torch.full_like(p, float("nan")))
        self.counters["calls"] += 1
        self.counters["pairs"] += n
        self.counters["nan"] += int(torch.isnan(p.detach()).sum())
        return p

    def close(self) -> None:
        """Release resources."""


def check_prompts(prompts: Sequence[str] | None, n: int, required: bool, name: str) -> list[str]:
    if prompts is None:
        if required:
            raise ValueError(f"scorer '{name}' needs one prompt per image")
        return [""] * n
    if isinstance(prompts, str):
        raise TypeError(f"scorer '{name}': prompts must be a list of strings, not one string")
    prompts = list(prompts)
    if len(prompts) != n:
        raise ValueError(f"scorer '{name}': {n} images but {len(prompts)} prompts")
    bad = [type(p).__name__ for p in prompts if not isinstance(p, str)]
    if bad:
        raise TypeError(f"scorer '{name}': prompts must be strings, got {bad[0]}")
    return prompts


def check_metadata(metadata: Metadata | None, n: int, required: Sequence[str], name: str) -> dict[str, list]:
    metadata = dict(metadata or {})
    missing = [k for k in required if k not in metadata]
    if missing:
        raise ValueError(f"scorer '{name}' needs metadata {missing}; got keys {sorted(metadata)}")
    out = {}
    for k, v in metadata.items():
        if isinstance(v, (str, bytes)) or not hasattr(v, "__len__"):
            raise TypeError(f"scorer '{name}': metadata '{k}' must be a list of length {n}")
        if len(v) != n:
            raise ValueError(f"scorer '{name}': metadata '{k}' has {len(v)} entries for {n} images")
        out[k] = list(v)
    return out
