"""The files of an evaluation run, written and read back (`--compare` reads an earlier run).

<run>/scores.csv     file, prompt, index, one column per score key ('nan' = could not score)
<run>/scores.jsonl   {"file", "prompt", "index", "metadata", "scores": {key: value or null}} per image
<run>/summary.json   per-key statistics, the comparison (if any), how the intervals were computed
`file` is relative to the run folder for generated images (images/...), absolute otherwise.
JSON files hold null where a number is NaN (JSON has no NaN).
"""

from __future__ import annotations

import csv
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .sources import EvaluationError, Sample

SCORES_CSV = "scores.csv"
SCORES_JSONL = "scores.jsonl"
SUMMARY_JSON = "summary.json"
REPORT_HTML = "report.html"
CONFIG_YAML = "config.yaml"


@dataclass
class Run:
    """One set of scored images."""

    root: Path
    label: str
    samples: list[Sample]
    scores: dict[str, np.ndarray] = field(default_factory=dict)

    @property
    def main_keys(self) -> list[str]:
        """Each scorer's main output (extras are named '<key>/<what>')."""
        return [k for k in self.scores if "/" not in k]

    def path(self, i: int) -> Path:
        f = Path(self.samples[i].file)
        return f if f.is_absolute() else self.root / f


def json_safe(value: Any) -> Any:
    """NaN / inf -> None, numpy scalars -> Python, recursively."""
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(json_safe(obj), indent=2, ensure_ascii=False, allow_nan=False) + "\n", encoding="utf-8")


def _csv_value(v: float) -> str:
    return repr(float(v)) if math.isfinite(v) else "nan"


def write_scores(run: Run) -> None:
    run.root.mkdir(parents=True, exist_ok=True)
    keys = list(run.scores)
    with open(run.root / SCORES_CSV, "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(["file", "prompt", "index", *keys])
        for i, s in enumerate(run.samples):
            writer.writerow([s.file, s.prompt, s.index, *(_csv_value(run.scores[k][i]) for k in keys)])
    with open(run.root / SCORES_JSONL, "w", encoding="utf-8") as f:
        for i, s in enumerate(run.samples):
            row = {
                "file": s.file,
                "prompt": s.prompt,
                "index": s.index,
                "metadata": s.metadata,
                "scores": {k: float(run.scores[k][i]) for k in keys},
            }
            f.write(json.dumps(json_safe(row), ensure_ascii=False, allow_nan=False) + "\n")


def read_run(root: str | Path) -> Run:
    """A finished run from its scores.jsonl (label from summary.json, else the folder name)."""
    root = Path(root)
    path = root / SCORES_JSONL
    if not path.is_file():
        raise EvaluationError(f"{root} is not an evaluation run: {SCORES_JSONL} not found")
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    samples = [Sample(r["file"], r["prompt"], int(r["index"]), r.get("metadata") or {}) for r in rows]
    keys = list(dict.fromkeys(k for r in rows for k in r["scores"]))
    scores = {k: np.array([_float(r["scores"].get(k)) for r in rows], dtype=np.float64) for k in keys}
    label = root.resolve().name
    if (root / SUMMARY_JSON).is_file():
        label = json.loads((root / SUMMARY_JSON).read_text(encoding="utf-8")).get("label") or label
    return Run(root, label, samples, scores)


def _float(v: Any) -> float:
    return float("nan") if v is None else float(v)
