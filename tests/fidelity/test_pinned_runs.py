"""Behaviour unchanged: every tiny recipe's short run gives the pinned metrics and final weights.

tests/fidelity/pinned_runs.json was written by `scripts/pin_runs.py --write` from the code before a refactor
(the runs, their overrides and the comparison live in that script). On the platform it records (torch,
python, CPU model, avx512) the comparison is bit-exact: equal float reprs, equal sha256 of every weight file;
elsewhere metrics within rtol 1e-4 and each weight group's norm / sums within rtol 1e-4. A deliberate change
of behaviour regenerates the file: `python scripts/pin_runs.py --write`.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("pin_runs", ROOT / "scripts" / "pin_runs.py")
pin_runs = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("pin_runs", pin_runs)  # dataclasses look their module up there
_spec.loader.exec_module(pin_runs)

PINNED = pin_runs.load_pinned()


def test_every_run_is_pinned_with_its_overrides():
    assert sorted(PINNED["runs"]) == sorted(pin_runs.RUNS)
    for name, spec in pin_runs.RUNS.items():
        assert PINNED["runs"][name]["overrides"] == list(spec.overrides), name
        assert PINNED["runs"][name]["config"] == spec.config, name


@pytest.mark.parametrize(
    "name",
    [pytest.param(n, marks=[pytest.mark.heavy] if s.kind == "t2i" else []) for n, s in sorted(pin_runs.RUNS.items())],
)
def test_pinned_run(name, tmp_path):
    exact = PINNED["platform"] == pin_runs.platform_fingerprint()
    now = pin_runs.run_one(name, ROOT, tmp_path)
    problems, _ = pin_runs.compare(PINNED["runs"][name], now, exact)
    mode = "exact" if exact else "rtol 1e-4 (another platform)"
    assert not problems, f"{name} ({mode}): {len(problems)} differences\n" + "\n".join(problems[:20])
