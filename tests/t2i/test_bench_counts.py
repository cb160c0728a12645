"""The counts of scripts/bench.py are pinned: for four cheap tiny recipes, the count part of the benchmark
(scripts/bench_t2i/recipes.py: bench_recipe, with the warm-up and measured iterations recorded in
docs/bench_t2i.json) must give exactly the counts docs/bench_t2i.json holds, iteration by iteration:
denoiser rows without / with grad, rollout rows, backward passes, reward calls, images, trained edges and
plan steps, the hooks' call and row counts, the closed form, and the summary's count fields.

Which fields are counts is read from the recorded JSON itself (everything but seconds, `*_s` / `seconds_*` /
`share_*`, and megabytes, `*_mb`), so a refactor that changes what a recipe computes (one forward more, one reward call
fewer, another plan) fails here; one that only renames the trainer's metric keys fails only if the bench
stops reading them (a count that comes back None)."""

from __future__ import annotations

import json
import logging
import math
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
RECORDED = json.loads((ROOT / "docs" / "bench_t2i.json").read_text())
# full_sde (the reference), the tree plan, a progressive window (counts change between iterations), the NFT
# objective; four cheap ones keep this test short (the clean-sample methods' closed forms: test_bench_methods.py).
PINNED = ("flow_grpo", "branchgrpo", "mixgrpo_flash", "diffusion_nft")


def _is_timing(key: str) -> bool:
    return key.endswith(("_s", "_mb")) or key.startswith(("seconds_", "share_", "cpu_seconds_"))


def _counts(value):
    """`value` with every timing / memory field left out (recursively)."""
    if isinstance(value, dict):
        return {k: _counts(v) for k, v in value.items() if not _is_timing(k)}
    if isinstance(value, list):
        return [_counts(v) for v in value]
    return value


def _diff(recorded, fresh, where: str) -> list[str]:
    if isinstance(recorded, dict):
        if not isinstance(fresh, dict):
            return [f"{where}: recorded a dict, got {fresh!r}"]
        out = []
        for k, v in recorded.items():
            if k not in fresh:
                out.append(f"{where}.{k}: missing (recorded {v!r})")
            else:
                out.extend(_diff(v, fresh[k], f"{where}.{k}"))
        return out
    if isinstance(recorded, list):
        if not isinstance(fresh, list) or len(fresh) != len(recorded):
            return [f"{where}: recorded {len(recorded)} entries, got {fresh!r}"]
        return [p for i, (a, b) in enumerate(zip(recorded, fresh)) for p in _diff(a, b, f"{where}[{i}]")]
    if isinstance(recorded, float) and isinstance(fresh, (int, float)) and not isinstance(fresh, bool):
        same = (math.isnan(recorded) and math.isnan(fresh)) or abs(recorded - fresh) <= 1e-9 * max(1.0, abs(recorded))
        return [] if same else [f"{where}: recorded {recorded!r}, got {fresh!r}"]
    return [] if recorded == fresh else [f"{where}: recorded {recorded!r}, got {fresh!r}"]


@pytest.fixture(scope="module")
def bench_recipe():
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from scripts.bench_t2i.recipes import bench_recipe

    return bench_recipe


@pytest.mark.parametrize("recipe", PINNED)
def test_counts_equal_the_recorded_bench(recipe, bench_recipe, tmp_path):
    settings = RECORDED["settings"]
    recorded = RECORDED["recipes"][recipe]
    assert "error" not in recorded, recorded.get("error")
    args = SimpleNamespace(
        out_dir=str(tmp_path),
        num_threads=settings["num_threads"],
        warmup=settings["warmup"],
        iterations=settings["iterations"],
    )
    logger = logging.getLogger("flowgrpo")
    level, threads = logger.level, torch.get_num_threads()
    try:
        fresh = bench_recipe(recipe, args)  # quiet_warnings() lowers the flowgrpo logger: restored below
    finally:
        logger.setLevel(level)
        torch.set_num_threads(threads)
    fresh.pop("trainer", None)
    assert len(fresh["iterations"]) == len(recorded["iterations"]) == settings["warmup"] + settings["iterations"]
    # the recipe's settings (method, plan, steps, group size, ...) and every count, iteration by iteration
    problems = _diff(_counts({k: v for k, v in recorded.items() if k != "summary"}), fresh, recipe)
    problems += _diff(_counts(recorded["summary"]), fresh["summary"], f"{recipe}.summary")
    assert not problems, "bench counts drifted from docs/bench_t2i.json:\n" + "\n".join(problems)
    assert fresh["summary"]["counts_match_closed_form"] or not fresh["summary"]["closed_form_simple"]
    assert fresh["summary"]["hook_rows_match_counters"]
