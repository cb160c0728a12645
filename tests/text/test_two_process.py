"""Two processes (gloo) give the same samples, rewards, advantages, loss and update as one process."""

from pathlib import Path

import pytest
import torch

from flowgrpo.checkpoint import latest_checkpoint
from flowgrpo.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[2]
# 4 prompts in chunks of one prompt (generation.batch_size = group_size): 2 chunks per rank; 2 passes x
# 2 mini-batches of micro-batches of 3 rows split over the ranks; LoRA with a KL reference, dynamic
# sampling (extra rounds are seeded too) and the rollout-vs-training correction. Adam's eps at 1e-3: with
# the default 1e-8 a weight whose gradient is ~0 moves by +-lr on the sign of rounding noise (gradients
# summed over ranks in another order), which hides the comparison
ARGS = [
    "iterations=3",
    "checkpoint.every=0",
    "progress=false",
    "num_threads=1",
    "optim.lr=5e-2",
    "optim.eps=1e-3",
    "prompts_per_iteration=4",
    "group_size=4",
    "generation.batch_size=4",
    "generation.rollout_logprobs=true",
    "train.inner_epochs=2",
    "train.mini_batches=2",
    "train.micro_batch_size=3",
    "train.logprob_batch_size=5",
    "model.lora.enabled=true",
    "loss.kl.coef=0.02",
    "dynamic_sampling.enabled=true",
    "dynamic_sampling.max_extra_rounds=1",
]


def _run(launch_ranks, out: Path, world: int, *extra: str) -> None:
    launch_ranks(
        "train_text.py", [str(ROOT / "configs/text/tiny_pattern.yaml"), f"output_dir={out}", *ARGS, *extra], world
    )


def test_two_processes_match_one(tmp_path, launch_ranks):
    one, two = tmp_path / "one", tmp_path / "two"
    _run(launch_ranks, one, 1)
    _run(launch_ranks, two, 2)
    m1, m2 = read_metrics(one / "metrics.jsonl"), read_metrics(two / "metrics.jsonl")
    assert [r["iteration"] for r in m2] == [1, 2, 3]
    assert not (two / "metrics.jsonl.1").exists()
    for a, b in zip(m1, m2):
        # the same samples (each chunk has its own seed) and so the same rewards and advantages, bit for bit
        for key in (
            "reward_mean",
            "reward_std",
            "completions/mean_length",
            "count/generated_groups",
            "backward_passes",
            "nfe_grad",
            "check/rows",
        ):
            assert a[key] == b[key], key
        # log-probs of the same rows computed in other micro-batch groupings, losses summed over ranks
        for key in ("loss/total", "kl/ref_mean", "mismatch/logp_diff_max", "check/first_pass_ratio_dev"):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), key
    assert sum(r["backward_passes"] for r in m1) > 0
    assert sum(r["nfe_grad"] for r in m2) == sum(r["nfe_grad"] for r in m1)
    t1, t2 = _lora(one), _lora(two)
    assert t1.keys() == t2.keys()
    assert max(float(t1[k].abs().max()) for k in t1 if "lora_B" in k) > 0  # the update moved LoRA B off 0
    for k in t1:
        torch.testing.assert_close(t1[k], t2[k], rtol=1e-4, atol=1e-6)
    # 2 processes stopped after step 2 (checkpoint written by rank 0) and resumed: bit-identical to `two`
    resumed = tmp_path / "resumed"
    _run(launch_ranks, resumed, 2, "stop_after=2", "checkpoint.every=1")
    _run(launch_ranks, resumed, 2, "resume=true", "checkpoint.every=1")
    t3 = _lora(resumed)
    assert all(torch.equal(t2[k], t3[k]) for k in t2)
    assert [r["reward_mean"] for r in read_metrics(resumed / "metrics.jsonl")] == [r["reward_mean"] for r in m2]


def _lora(out: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(latest_checkpoint(out / "checkpoints") / "tensors.model.safetensors")


def test_a_reward_error_on_one_rank_stops_every_rank(tmp_path, launch_ranks):
    """stop_on_reward_error with a reward that raises on rank 1 only: both ranks exit with the reason
    (no rank is left waiting for the others)."""
    reward = tmp_path / "flaky.py"
    reward.write_text(
        "import os\n\n"
        "def flaky(prompts, completions, **kw):\n"
        "    if os.environ['RANK'] == '1':\n"
        "        raise ValueError('judge unreachable')\n"
        "    return [0.0] * len(completions)\n"
    )
    results = launch_ranks(
        "train_text.py",
        [
            str(ROOT / "configs/text/tiny_pattern.yaml"),
            f"output_dir={tmp_path / 'out'}",
            "iterations=2",
            "progress=false",
            "num_threads=1",
            "prompts_per_iteration=2",
            "group_size=2",
            "generation.batch_size=2",
            f"rewards=[{{name: '{reward}:flaky'}}]",
            "stop_on_reward_error=true",
        ],
        2,
        timeout=300,
        check=False,
    )
    (rc0, err0), (rc1, err1) = results
    assert rc0 != 0 and rc1 != 0
    assert "reward function 'flaky' failed: ValueError: judge unreachable" in err1
    assert "failed on another rank" in err0 and "judge unreachable" in err0


def test_groups_straddling_two_processes_match_one(tmp_path, launch_ranks):
    """One prompt a step, its 8 completions sampled in 2 parts (rollout_split): one part on each
    rank, where without the split rank 1 would sit idle. The same samples and rewards as one process drawing
    both parts, and the same update to float rounding."""
    split = ["prompts_per_iteration=1", "group_size=8", "rollout_split=2",
             "dynamic_sampling.enabled=false", "iterations=2"]  # fmt: skip
    one, two = tmp_path / "one", tmp_path / "two"
    _run(launch_ranks, one, 1, *split)
    _run(launch_ranks, two, 2, *split)
    m1, m2 = read_metrics(one / "metrics.jsonl"), read_metrics(two / "metrics.jsonl")
    for a, b in zip(m1, m2, strict=True):
        for key in ("reward_mean", "reward_std", "completions/mean_length", "tokens/generated"):
            assert a[key] == b[key], key
    t1, t2 = _lora(one), _lora(two)
    assert max(float(t1[k].abs().max()) for k in t1 if "lora_B" in k) > 0
    for k in t1:
        torch.testing.assert_close(t1[k], t2[k], rtol=1e-4, atol=1e-6)
