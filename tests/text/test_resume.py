"""Exact resume: an interrupted run, resumed, ends bit-identical to an uninterrupted one (CPU, fixed seeds)."""

from pathlib import Path

import pytest
import torch

from flowgrpo.checkpoint import latest_checkpoint
from flowgrpo.metrics import read_metrics
from flowgrpo.text import TextGRPOTrainer, train_text

ROOT = Path(__file__).resolve().parents[2]


def _final_tensors(run_dir: Path) -> dict[str, torch.Tensor]:
    """Model and optimizer tensors of the newest checkpoint."""
    from safetensors.torch import load_file

    path = latest_checkpoint(run_dir / "checkpoints")
    return {
        **{f"model/{k}": v for k, v in load_file(path / "tensors.model.safetensors").items()},
        **{f"optim/{k}": v for k, v in load_file(path / "optim.policy.safetensors").items()},
    }


def _assert_identical(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


COMMON = [
    "iterations=6",
    "checkpoint.every=2",
    "checkpoint.keep_last=5",
    "train.inner_epochs=2",
    "train.mini_batches=2",
    "train.micro_batch_size=5",
]


@pytest.mark.parametrize(
    "extra",
    [
        [],
        [
            "model.lora.enabled=true",
            "loss.kl.coef=0.02",
            "optim.lr=5e-2",
            "optim.schedule=cosine",
            "optim.warmup_steps=2",
        ],
    ],
    ids=["full", "lora_kl_cosine"],
)
def test_stop_and_resume_in_new_trainer_is_bit_identical(tiny_config, extra):
    ref = tiny_config(*COMMON, *extra, name="uninterrupted")
    full = train_text(ref)

    part = tiny_config(*COMMON, *extra, "stop_after=3", name="interrupted")
    first = train_text(part)
    assert [r["iteration"] for r in first] == [1, 2, 3]
    assert latest_checkpoint(Path(part.output_dir) / "checkpoints").name == "step_00000003"
    torch.manual_seed(12345)  # a resumed process starts from an unrelated RNG state
    resumed = TextGRPOTrainer(tiny_config(*COMMON, *extra, "resume=true", name="interrupted"))
    assert resumed.iteration == 3
    rest = resumed.train()
    assert [r["iteration"] for r in rest] == [4, 5, 6]

    _assert_identical(_final_tensors(Path(ref.output_dir)), _final_tensors(Path(part.output_dir)))
    rewards = [r["reward_mean"] for r in full]
    assert [r["reward_mean"] for r in first + rest] == rewards
    assert [r["iteration"] for r in read_metrics(Path(part.output_dir) / "metrics.jsonl")] == [1, 2, 3, 4, 5, 6]


def test_resume_without_checkpoint_starts_fresh(tiny_config):
    trainer = TextGRPOTrainer(tiny_config("resume=true", "iterations=1"))
    assert trainer.iteration == 0 and trainer.resumed_from is None


def test_sigkill_after_checkpoint_then_resume_is_bit_identical(tiny_config, tmp_path, kill_after_first_checkpoint):
    """A real training process killed with SIGKILL once it has written a checkpoint, resumed by another one."""
    overrides = ["iterations=8", "checkpoint.every=2", "checkpoint.keep_last=3", "num_threads=1", "progress=false"]
    run_dir = tmp_path / "killed"
    killed_at = kill_after_first_checkpoint(
        "train_text.py", [str(ROOT / "configs/text/tiny_pattern.yaml"), *overrides], run_dir, timeout=120
    )
    assert killed_at < 8

    # resume in another process (this one: its RNG state has nothing to do with the killed run's)
    torch.manual_seed(987)
    trainer = TextGRPOTrainer(tiny_config(*overrides, "resume=true", name="killed"))
    assert trainer.iteration == killed_at
    trainer.train()
    assert latest_checkpoint(run_dir / "checkpoints").name == "step_00000008"

    reference = tiny_config(*overrides, name="reference")
    train_text(reference)
    _assert_identical(_final_tensors(Path(reference.output_dir)), _final_tensors(run_dir))
    steps = [r["iteration"] for r in read_metrics(run_dir / "metrics.jsonl")]
    assert steps == list(range(1, 9))
