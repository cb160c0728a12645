"""method tppo in two processes (gloo): the same samples, advantages, policy and critic updates as one process, and a
two-process run resumed in one process matches one process uninterrupted (the critic's AdamW moves with it)."""

from pathlib import Path

import pytest
import torch

from flowgrpo.checkpoint import latest_checkpoint
from flowgrpo.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[2]
# 4 prompts x 4 completions in chunks of one prompt (2 per rank); the critic: 2 epochs x 2 mini-batches of
# micro-batches of 3 rows split over the ranks, its values in blocks of 5 rows split too. The policy's AdamW eps at
# 1e-3 (tests/text/test_two_process.py says why); the critic's gradients summed over ranks in another order agree
# to 1e-6 at its default eps
ARGS = [
    "iterations=3",
    "progress=false",
    "num_threads=1",
    "optim.eps=1e-3",
    "prompts_per_iteration=4",
    "group_size=4",
    "generation.batch_size=4",
    "generation.max_new_tokens=12",
    "train.inner_epochs=1",
    "train.micro_batch_size=3",
    "train.logprob_batch_size=5",
    "critic.epochs=2",
    "critic.mini_batches=2",
    "critic.micro_batch_size=3",
]
PARTS = ("model", "critic")


def _run(launch_ranks, out: Path, world: int, *extra: str) -> None:
    launch_ranks(
        "train_text.py", [str(ROOT / "configs/text/tiny_tppo.yaml"), f"output_dir={out}", *ARGS, *extra], world
    )


def _tensors(out: Path, part: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(latest_checkpoint(out / "checkpoints") / f"tensors.{part}.safetensors")


@pytest.mark.heavy
def test_tppo_in_two_processes_matches_one_and_resumes_in_one(tmp_path, launch_ranks):
    one, two = tmp_path / "one", tmp_path / "two"
    _run(launch_ranks, one, 1, "checkpoint.every=3")
    _run(launch_ranks, two, 2, "checkpoint.every=2", "stop_after=2")  # steps 1-2 in two processes
    _run(launch_ranks, two, 1, "checkpoint.every=3", "resume=true")  # step 3 in one
    m1, m2 = read_metrics(one / "metrics.jsonl"), read_metrics(two / "metrics.jsonl")
    assert [r["iteration"] for r in m2] == [1, 2, 3]
    for a, b in zip(m1, m2, strict=True):
        # the same samples (each chunk its own seed), rewards, finished rows and critic targets, bit for bit
        for key in ("reward_mean", "completions/clipped_ratio", "critic/target_tokens", "critic/nfe_grad",
                    "critic/optimizer_steps", "nfe_grad"):  # fmt: skip
            assert a[key] == b[key], key
        # values, losses and gradient norms of the same rows in other groupings, gradients summed over ranks
        for key in ("loss/total", "critic/value_mean", "critic/return_mean", "critic/loss", "critic/grad_norm"):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), key
    assert m1[-1]["critic/optimizer_steps"] == 4 and m1[-1]["critic/target_tokens"] > 0
    assert m1[-1]["critic/value_mean"] != 0  # the critic moved (its first values are all 0)
    for part in PARTS:
        t1, t2 = _tensors(one, part), _tensors(two, part)
        assert t1.keys() == t2.keys()
        for k in t1:
            torch.testing.assert_close(t2[k], t1[k], rtol=1e-4, atol=1e-6, msg=k)
