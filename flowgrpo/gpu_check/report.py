"""The report: one Section per check, written as markdown (docs/gpu_validation.md) and JSON beside it."""

from __future__ import annotations

import json
import math
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

from .device import DeviceInfo


class Figures(dict):
    """A section's figures, each printed as it is measured: the log of a run cut short still holds them."""

    def __setitem__(self, key: str, value: Optional[float]) -> None:
        super().__setitem__(key, value)
        print(f"[gpu_check]   {key}: {_fmt(value)}", file=sys.stderr, flush=True)

    def update(self, *args: Any, **kwargs: Any) -> None:
        for key, value in dict(*args, **kwargs).items():
            self[key] = value


@dataclass
class Section:
    title: str
    figures: dict[str, Optional[float]] = field(default_factory=Figures)  # None: not measurable here (said why)
    settings: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    skipped: Optional[str] = None  # the reason the check did not run
    error: Optional[str] = None  # the check ran and failed: the one-line error
    seconds: float = 0.0


@dataclass
class Report:
    command: str
    mode: str  # "full" or "tiny"
    info: DeviceInfo
    sections: list[Section]
    total_seconds: float

    def as_json(self) -> dict[str, Any]:
        return asdict(self)


METHOD = (
    "Method: random weights at the published configs (no hub); our rollout is pipelines.sampler.Sampler "
    "(full_sde plan, CFG batched, torch.inference_mode) + adapter.decode, the baseline is the diffusers "
    "pipeline's own __call__ on the same components, prompts, steps, resolution, batch and CFG; both are "
    "timed after one warm-up (median, device synchronised). FLOPs are counted by "
    "torch.utils.flop_counter.FlopCounterMode over one untimed run of the same code: 2 m n k per "
    "(m x k)(k x n) matmul (convolutions alike), 4 b h s_q s_kv d per attention forward, backward twice "
    "the forward; element-wise work is not counted. MFU = counted FLOPs / (median seconds x dense bf16 "
    "peak). The on-policy ratio re-scores the fresh rollout's trained edges with the weights that sampled "
    "it: |exp(logp_new - logp_old) - 1| must be <= 1e-4 (the trainers' ratio_check tolerance)."
)


def _fmt(value: Optional[float]) -> str:
    if value is None:
        return "n/a"
    if not math.isfinite(value):
        return str(value)
    if value != 0 and (abs(value) < 1e-3 or abs(value) >= 1e5):
        return f"{value:.3e}"
    return f"{value:.4g}"


def markdown(report: Report) -> str:
    info = report.info
    lines = [
        "# GPU validation",
        "",
        f"Command: `{report.command}` ({report.mode} mode). Written by flowgrpo/gpu_check; every figure below "
        "was measured in this one run, side by side.",
        "",
        f"- date: {info.date}",
        f"- device: {info.name} ({info.device}); dense bf16 peak: "
        + (f"{info.peak_tflops:g} TFLOP/s ({info.peak_source})" if info.peak_tflops else "unknown (MFU not computed)"),
        "- versions: " + ", ".join(f"{k} {v}" for k, v in info.versions.items() if v),
        f"- total wall time: {report.total_seconds:.1f} s",
        "",
        METHOD,
        "",
    ]
    if report.mode == "tiny":
        lines += [
            "**Tiny mode**: tiny random models on a shared CPU. This run checks that the code path works; "
            "its timings and ratios of timings measure nothing about a GPU.",
            "",
        ]
    for sec in report.sections:
        lines += [f"## {sec.title}", ""]
        if sec.skipped:
            lines += [f"Skipped: {sec.skipped}", ""]
            continue
        if sec.error:
            lines += [f"**FAILED**: {sec.error}", ""]
        if sec.settings:
            lines += [
                "Settings: "
                + "; ".join(f"{k} {_fmt(v) if isinstance(v, float) else v}" for k, v in sec.settings.items()),
                "",
            ]
        if sec.figures:
            lines += ["| figure | value |", "|---|---|"]
            lines += [f"| {k.replace('|', chr(92) + '|')} | {_fmt(v)} |" for k, v in sec.figures.items()]
            lines.append("")
        lines += [f"- {n}" for n in sec.notes] + [f"- check time: {sec.seconds:.1f} s", ""]
    return "\n".join(lines)


def write(report: Report, path: Path) -> Path:
    """`path` (markdown) and `path` with suffix .json; returns the JSON path."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(markdown(report))
    json_path = path.with_suffix(".json")
    json_path.write_text(json.dumps(report.as_json(), indent=1, default=str) + "\n")
    return json_path
