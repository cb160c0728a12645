"""metrics.jsonl: one JSON object per iteration, flushed as it is written so a crash loses nothing.

Both trainers write the same names for the same quantities (`SHARED_KEYS`, docs/architecture.md): the counter
`iteration` (1-based, the text trainer's steps too), `time_iteration_s`, the model-call counts `nfe_nograd`,
`nfe_grad` (rows through the model: images at one timestep, or sequences) and `backward_passes`, the reward
statistics `reward_mean`, `reward_std`, `rewards/<name>/...` and the loss's `ratio/mean`, `approx_kl`, ...

A crash or a full disk mid-write can leave a partial last line: readers skip it (with a warning) and a
resumed run drops it. Rewrites go to a temporary file renamed over the old one, so a kill during a
rewrite leaves the old file whole. A line that cannot be written (a full disk, a read-only folder) is
`WriteFailed`, one line naming the file and the OS error: the records written before it stay.
"""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path
from typing import Any

from .atomic_io import WriteFailed, os_error_text, replace_text_atomically

COUNTER_KEY = "iteration"  # the step counter of a record (1-based), in both trainers' metrics.jsonl
LEGACY_COUNTER_KEYS = ("step",)  # the text trainer's counter before it was `iteration`: read on resume
TIME_KEY = "time_iteration_s"  # wall seconds of one training step (rollout, scoring, update)

# one name per quantity in both trainers' records (tests/test_run_shared.py runs both and compares)
SHARED_KEYS = (
    COUNTER_KEY, TIME_KEY, "lr", "reward_mean", "reward_std", "rewards/nan_count", "adv/mean", "adv/std",
    "nfe_nograd", "nfe_grad", "backward_passes", "reward_calls", "optimizer_steps", "grad_norm", "loss/total", "ratio/mean",
    "approx_kl", "clip/frac", "time_rollout_s", "time_reward_s", "time_train_s", "check/first_pass_ratio_dev",
)  # fmt: skip


def _clean(value: Any) -> Any:
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else ("inf" if value > 0 else "-inf")
    return value


class MetricsWriter:
    """Appends one JSON line per record, flushed at once. A write that fails is `WriteFailed` (one line naming the
    file and the OS error); the lines written before it are whole (a torn last line is skipped by readers)."""

    def __init__(self, path: str | Path, append: bool = False):
        self.path = Path(path)
        self._failed = False
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = self.path.open("a" if append else "w")
        except OSError as err:
            raise WriteFailed(f"could not open {self.path} for writing: {os_error_text(err)}") from err

    def write(self, record: dict[str, Any]) -> None:
        line = json.dumps({k: _clean(v) for k, v in record.items()}) + "\n"
        try:
            self._file.write(line)
            self._file.flush()
        except OSError as err:
            self._failed = True
            raise WriteFailed(
                f"could not write {self.path}: {os_error_text(err)} (the records before it are kept)"
            ) from err

    def close(self) -> None:
        try:
            self._file.close()
        except OSError as err:
            if not self._failed:  # after a failed write, the buffered line fails again: already reported
                raise WriteFailed(f"could not write {self.path}: {os_error_text(err)}") from err

    def __enter__(self) -> "MetricsWriter":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class MetricsFileError(ValueError):
    """A metrics file damaged before its last line (a torn last line is skipped, not an error)."""


def _records(path: Path) -> list[tuple[str, dict[str, Any]]]:
    """(line, record) pairs; a torn last line is left out with a warning, damage before it is an error."""
    lines = [line for line in path.read_text(encoding="utf-8", errors="replace").splitlines() if line.strip()]
    out = []
    for i, line in enumerate(lines):
        try:
            record = json.loads(line)
        except ValueError:
            if i == len(lines) - 1:
                warnings.warn(
                    f"{path}: skipping a partial last line (a crash or a full disk mid-write): {line[:60]!r}",
                    stacklevel=3,
                )
                break
            raise MetricsFileError(f"{path}: line {i + 1} is not JSON: {line[:60]!r}") from None
        out.append((line, record))
    return out


def _counter(record: dict[str, Any]) -> Any:
    """The record's step counter: `iteration`, or a legacy name (a file written before the names were shared)."""
    for name in (COUNTER_KEY, *LEGACY_COUNTER_KEYS):
        if name in record:
            return record[name]
    return 0


def truncate_metrics(path: str | Path, last: int) -> None:
    """Drop records whose counter (`iteration`, or its legacy name `step`) is past `last` (written after the
    checkpoint a run resumes from) and a torn last line; the file is replaced atomically."""
    path = Path(path)
    if not path.is_file():
        return
    kept = [line for line, record in _records(path) if _counter(record) <= last]
    try:
        replace_text_atomically(path, "".join(line + "\n" for line in kept))
    except OSError as err:
        raise WriteFailed(f"could not rewrite {path}: {os_error_text(err)} (the file is unchanged)") from err


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    return [record for _, record in _records(Path(path))]


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
