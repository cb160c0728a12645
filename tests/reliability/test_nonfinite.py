"""Non-finite rewards never reach the weights or a checkpoint; all-NaN rewards warn and stop.
Through `flowgrpo train-text` with a user's reward file, and train_t2i with a scorer."""

import math
from pathlib import Path

import pytest
import torch

from flowgrpo.checkpoint import latest_checkpoint, list_checkpoints, load_checkpoint
from flowgrpo.guards import GuardConfig, NonFiniteError, NonFiniteGuard, NonFiniteWarning
from flowgrpo.metrics import read_metrics
from reward_models import register
from reward_models.base import Scorer

from .cli_helpers import ROOT, run_cli

REWARDS = """
def huge_on_half(prompts, completions, **kw):
    return [1e38 if i % 2 else 0.5 for i in range(len(completions))]

def nothing(prompts, completions, **kw):
    return [None] * len(completions)

def inf_on_some(prompts, completions, **kw):
    return [float("inf") if i % 4 == 0 else float(c.count("a")) / 32 for i, c in enumerate(completions)]
"""


def _text(tmp_path: Path, reward: str, *extra: str):
    (tmp_path / "my_rewards.py").write_text(REWARDS)
    return run_cli(
        "train-text",
        str(ROOT / "configs/text/tiny_pattern.yaml"),
        "progress=false",
        f"output_dir={tmp_path / 'run'}",
        f"rewards=[{{name: '{tmp_path / 'my_rewards.py'}:{reward}'}}]",
        *extra,
        cwd=tmp_path,
    )


def _all_finite(ckpt) -> bool:
    return all(
        bool(torch.isfinite(t).all())
        for group in ckpt.tensors.values()
        for t in group.values()
        if t.is_floating_point()
    )


def test_text_huge_rewards_never_step_or_save_and_stop(tmp_path):
    done = _text(tmp_path, "huge_on_half", "iterations=8", "checkpoint.every=1", "guards.max_bad_updates=3")
    assert done.returncode == 2, done.stderr[-2000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("flowgrpo: stopped at step 3") and "3 steps in a row" in last
    assert "Traceback" not in done.stderr
    ckpts = list_checkpoints(tmp_path / "run" / "checkpoints")
    assert ckpts, "the good (unchanged) checkpoints of steps 1-2 are kept"
    for path in ckpts:
        assert _all_finite(load_checkpoint(path, restore_rng=False))
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["guard/bad_streak"] for r in records] == [1, 2]
    assert all(r["guard/skipped_steps"] >= 1 for r in records)


def test_text_all_none_rewards_warn_and_stop(tmp_path):
    done = _text(tmp_path, "nothing", "iterations=6", "guards.max_bad_updates=2")
    assert done.returncode == 2, done.stderr[-2000:]
    assert "no finite reward" in done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith("flowgrpo: stopped at step 2")


def test_text_inf_rewards_are_left_out_with_counts(tmp_path):
    done = _text(tmp_path, "inf_on_some", "iterations=2")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "4 of 16 rewards inf (left out)" in done.stderr
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["guard/nonfinite_rewards"] for r in records] == [4, 4]  # 16 completions, every 4th is inf
    assert all(math.isfinite(r["reward_mean"]) for r in records)
    assert _all_finite(load_checkpoint(latest_checkpoint(tmp_path / "run" / "checkpoints"), restore_rng=False))


class _InfOnHalf(Scorer):
    name = "test_inf_on_half"

    def score_batch(self, images, prompts, metadata):
        value = images.tensor().float().mean(dim=(1, 2, 3))
        value[1::2] = math.inf
        return {self.key: value}


@register("test_inf_on_half")
def _build_inf(*, batch_size: int = 64) -> _InfOnHalf:
    """Brightness, +inf for every second image (tests)."""
    return _InfOnHalf(batch_size=batch_size)


class _AllNaN(Scorer):
    name = "test_all_nan"

    def score_batch(self, images, prompts, metadata):
        return {self.key: torch.full((len(images),), math.nan)}


@register("test_all_nan")
def _build_all_nan(*, batch_size: int = 64) -> _AllNaN:
    """NaN for every image (tests)."""
    return _AllNaN(batch_size=batch_size)


def test_t2i_inf_rewards_are_left_out_with_a_warning(recipe_config):
    from flowgrpo.t2i import train_t2i

    cfg = recipe_config("flow_grpo", "iterations=2", "rewards=[{name: test_inf_on_half}]")
    with pytest.warns(NonFiniteWarning, match="8 of 16 rewards NaN / inf"):
        history = train_t2i(cfg)
    assert [r["guard/nonfinite_rewards"] for r in history] == [8, 8]
    assert all(math.isfinite(r["reward_mean"]) for r in history)
    assert _all_finite(load_checkpoint(latest_checkpoint(Path(cfg.output_dir) / "checkpoints"), restore_rng=False))


def test_t2i_all_nan_rewards_warn_and_stop(recipe_config):
    from flowgrpo.t2i import train_t2i

    cfg = recipe_config(
        "flow_grpo", "iterations=5", "checkpoint.every=1", "guards.max_bad_updates=2", "rewards=[{name: test_all_nan}]"
    )
    with (
        pytest.warns(NonFiniteWarning, match="no finite reward"),
        pytest.raises(NonFiniteError, match="2 iterations in a row"),
    ):
        train_t2i(cfg)
    for path in list_checkpoints(Path(cfg.output_dir) / "checkpoints"):
        assert _all_finite(load_checkpoint(path, restore_rng=False))


def test_guard_unit():
    guard = NonFiniteGuard(GuardConfig(max_bad_updates=2), "step")
    record: dict = {}
    values = guard.rewards(record, torch.tensor([1.0, math.inf, -math.inf, math.nan]))
    assert torch.isnan(values[1:]).all() and values[0] == 1
    assert record["guard/nonfinite_rewards"] == 3
    assert guard.step_ok(1.0) and not guard.step_ok(math.nan)
    guard.end_update(record, 1)
    assert record["guard/bad_streak"] == 1 and record["guard/skipped_steps"] == 1
    guard.rewards(record, torch.tensor([1.0]))
    guard.end_update(record, 2)  # a clean update resets the streak
    assert record["guard/bad_streak"] == 0
    with pytest.raises(NonFiniteError):
        guard.end_update(record, 3, [torch.tensor([math.nan])])
