"""Knapsack RL in the text trainer (prompt_sampling knapsack, flowgrpo/text/collect.py): ragged groups from the
prompt table's budgets, padding rows that never count, a stop / resume that is bit-identical (also into two
processes: every rank computes the budgets from the same table), and the combinations it refuses."""

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from flowgrpo.checkpoint import latest_checkpoint
from flowgrpo.config import ConfigError
from flowgrpo.metrics import read_metrics
from flowgrpo.text import TextGRPOTrainer, train_text

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "text" / "tiny_pattern.yaml"
# 3 prompts, 2 per step: from step 2 on, a prompt comes back with a history and its own budget
COMMON = ["recipe=knapsack", "data.task.rows=3", "iterations=3", "checkpoint.every=2", "generation.max_new_tokens=16",
          "train.inner_epochs=1", "prompt_sampling={name: knapsack, low: 2, high: 14}"]  # fmt: skip


def _tensors(run_dir: Path, part: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(latest_checkpoint(run_dir / "checkpoints") / f"tensors.{part}.safetensors")


def test_ragged_groups_train_and_resume_bit_identically(tiny_config):
    ref_cfg = tiny_config(*COMMON, name="uninterrupted")
    full = train_text(ref_cfg)
    assert [(r["knapsack/budget_min"], r["knapsack/budget_max"]) for r in full][:2] == [(8, 8), (2, 14)]
    for r in full:  # padding rows: no tokens, no advantage, not an unscored sample, not a completion
        assert r["adv/num_live"] == 16 and r["tokens/generated"] <= 16 * 16 and r["rewards/nan_count"] == 0
        assert r["completions/mean_length"] == pytest.approx(r["tokens/generated"] / 16)
        assert r["completions/min_length"] >= 1
    first = train_text(tiny_config(*COMMON, "stop_after=2", name="interrupted"))
    torch.manual_seed(4321)
    resumed = TextGRPOTrainer(tiny_config(*COMMON, "resume=true", name="interrupted"))
    rest = resumed.train()
    assert [r["reward_mean"] for r in first + rest] == [r["reward_mean"] for r in full]
    assert [r["knapsack/budget_max"] for r in first + rest] == [r["knapsack/budget_max"] for r in full]
    for part in ("model", "prompt_state"):
        ref, out = _tensors(Path(ref_cfg.output_dir), part), _tensors(resumed.out, part)
        for k in ref:
            torch.testing.assert_close(out[k], ref[k], rtol=0, atol=0, equal_nan=True, msg=k)


def test_padding_rows_go_through_no_forward(tiny_config):
    """The no-grad passes (old, reference, drift) run only the real rows; a padding row reads 0."""
    from flowgrpo.text.generation import Rollout

    trainer = TextGRPOTrainer(tiny_config(*COMMON))
    prompt, pmask = torch.tensor([[5, 6, 7]]).repeat(4, 1), torch.ones(4, 3, dtype=torch.long)
    completion = torch.tensor([[10, 11, 12], [13, 14, 0], [0, 0, 0], [0, 0, 0]])
    cmask = completion > 0
    valid = torch.tensor([True, True, False, False])
    rollout = Rollout(
        prompt,
        pmask,
        completion,
        cmask,
        torch.zeros(4, dtype=torch.bool),
        torch.zeros(4, dtype=torch.long),
        4,
        valid=valid,
    )
    counts = {"nfe_nograd": 0}
    got = trainer.method._all_logprobs(trainer.model, rollout, False, counts, with_entropy=True)
    assert counts["nfe_nograd"] == 2 and got.logp[2:].abs().sum() == 0 and got.entropy[2:].abs().sum() == 0
    whole = trainer.method._all_logprobs(trainer.model, replace(rollout, valid=None), False, counts)
    assert counts["nfe_nograd"] == 2 + 4 and torch.equal(whole.logp[:2], got.logp[:2])


def test_knapsack_refuses_what_ragged_groups_cannot_do(tiny_config):
    with pytest.raises(ConfigError, match="without dynamic_sampling and rollout_split"):
        TextGRPOTrainer(tiny_config("recipe=knapsack", "dynamic_sampling.enabled=true"))
    with pytest.raises(ConfigError, match=r"1 <= low <= group_size \(8\) <= high"):
        TextGRPOTrainer(tiny_config("prompt_sampling={name: knapsack, low: 2, high: 4}"))


@pytest.mark.slow
def test_one_process_stopped_and_resumed_in_two_matches_one_uninterrupted(tmp_path, launch_ranks):
    args = [str(TINY), "recipe=knapsack", "data.task.rows=6", "iterations=4", "progress=false", "num_threads=1",
            "train.inner_epochs=1", "prompts_per_iteration=4", "group_size=4", "generation.batch_size=4",
            "optim.eps=1e-3"]  # fmt: skip
    one, mixed = tmp_path / "one", tmp_path / "mixed"
    launch_ranks("train_text.py", [*args, f"output_dir={one}", "checkpoint.every=1"], 1)
    launch_ranks("train_text.py", [*args, f"output_dir={mixed}", "checkpoint.every=1", "stop_after=2"], 1)
    launch_ranks("train_text.py", [*args, f"output_dir={mixed}", "checkpoint.every=1", "resume=true"], 2)
    a, b = _tensors(one, "prompt_state"), _tensors(mixed, "prompt_state")
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=0, atol=0, equal_nan=True, msg=k)
    keys = ("reward_mean", "knapsack/budget_max")
    assert [[r[k] for k in keys] for r in read_metrics(mixed / "metrics.jsonl")] == [
        [r[k] for k in keys] for r in read_metrics(one / "metrics.jsonl")
    ]
