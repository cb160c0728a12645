"""The optimizer step of a ZeRO-2 / ZeRO-3 run (a DeepSpeed engine on CPU with gloo, one process) against AdamW:
the same weights and moments to float32 rounding, a NaN gradient skipped and counted, and a plain run's AdamW
state resumed into the engine. Runs tests/scaling/zero_step_script.py in its own process: DeepSpeed's engine
sets up process-wide state."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run(stage: int) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(
        [sys.executable, str(ROOT / "tests/scaling/zero_step_script.py"), str(stage)],
        env=env, capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _max_diff(a, b) -> float:
    if isinstance(a, list):
        return max((_max_diff(x, y) for x, y in zip(a, b, strict=True)), default=0.0)
    return abs(a - b)


@pytest.mark.parametrize("stage", [2, 3])
def test_zero_step_is_adamw_skips_nan_and_resumes_a_plain_state(stage):
    out = _run(stage)
    plain, zero = out["plain"], out["zero"]
    # the NaN micro-batch of step 1: skipped by both, counted by the guard; two steps taken
    assert plain["skipped"] == zero["skipped"] == 1 and plain["total"] == zero["total"] == 2
    assert plain["steps"] == zero["steps"] == [2.0, 2.0, 2.0]  # AdamW's own count: the skipped step left no trace
    assert abs(zero["norms"][0] - plain["norms"][0]) < 1e-5 and abs(zero["norms"][2] - plain["norms"][2]) < 1e-5
    assert not math.isfinite(zero["norms"][1])  # the skipped step's norm is reported as it was
    assert zero["lr"] == plain["lr"] == 0.05
    # one process: the same sums, in DeepSpeed's flat buffers; weights move by ~0.1 in these steps
    assert _max_diff(zero["weights"], plain["weights"]) < 1e-6
    assert _max_diff(zero["moments"], plain["moments"]) < 1e-6
    moved = _max_diff(plain["weights"], out["initial"])
    assert moved > 0.05, moved
    # a plain run's weights and AdamW state loaded into a fresh engine: the next step is the plain run's
    resumed = out["resumed"]
    assert _max_diff(resumed["zero"], resumed["plain"]) < 1e-6
    assert _max_diff(resumed["plain"], resumed["before"]) > 1e-3  # the step did move the weights
