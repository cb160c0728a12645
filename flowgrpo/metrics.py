"""metrics.jsonl: one JSON object per iteration, flushed as it is written so a crash loses nothing."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any


def _clean(value: Any) -> Any:
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else ("inf" if value > 0 else "-inf")
    return value


class MetricsWriter:
    def __init__(self, path: str | Path, append: bool = False):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a" if append else "w")

    def write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps({k: _clean(v) for k, v in record.items()}) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> "MetricsWriter":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def truncate_metrics(path: str | Path, last: int, key: str) -> None:
    """Drop records whose `key` (step / iteration) is past `last`: written after the checkpoint a run resumes from."""
    path = Path(path)
    if not path.is_file():
        return
    kept = [line for line in path.read_text().splitlines() if line.strip() and json.loads(line).get(key, 0) <= last]
    path.write_text("".join(line + "\n" for line in kept))


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


class LossMetrics:
    """Loss-part metrics over micro-batches: action-weighted means, min / max of extremes, summed losses."""

    def __init__(self) -> None:
        self.sums: dict[str, float] = {}
        self.weights: dict[str, float] = {}
        self.mins: dict[str, float] = {}
        self.maxs: dict[str, float] = {}

    def add(self, metrics: dict[str, float], actions: int) -> None:
        for k, v in metrics.items():
            if k.endswith("/min"):
                self.mins[k] = min(self.mins.get(k, math.inf), v)
            elif k.endswith("/max"):
                self.maxs[k] = max(self.maxs.get(k, -math.inf), v)
            elif k.startswith("loss/"):
                self.sums[k] = self.sums.get(k, 0.0) + v  # each micro-batch's loss is already globally normalised
            else:
                self.sums[k] = self.sums.get(k, 0.0) + v * actions
                self.weights[k] = self.weights.get(k, 0.0) + actions

    def absorb(self, other: "LossMetrics") -> None:
        """Add another accumulator's micro-batches (another rank's)."""
        for k, v in other.mins.items():
            self.mins[k] = min(self.mins.get(k, math.inf), v)
        for k, v in other.maxs.items():
            self.maxs[k] = max(self.maxs.get(k, -math.inf), v)
        for k, v in other.sums.items():
            self.sums[k] = self.sums.get(k, 0.0) + v
        for k, v in other.weights.items():
            self.weights[k] = self.weights.get(k, 0.0) + v

    @classmethod
    def merged(cls, parts: list["LossMetrics"]) -> "LossMetrics":
        """One accumulator over every rank's share (from Distributed.gather_objects)."""
        out = cls()
        for part in parts:
            out.absorb(part)
        return out

    def result(self, optimizer_steps: int) -> dict[str, float]:
        out: dict[str, float] = {**self.mins, **self.maxs}
        for k, v in self.sums.items():
            if k.startswith("loss/"):
                out[k] = v / max(optimizer_steps, 1)
            else:
                out[k] = v / self.weights[k] if self.weights[k] else math.nan
        return out
