"""Two processes (gloo) give the same rollouts, advantages and update as one process with the same global batch.

Deterministic by construction, not by a guessed tolerance:
- Everything computed from the same weights is bit-identical: a rollout batch's noise is seeded by the batch,
  each batch is decoded and scored on its own, and advantages are computed over the gathered global batch.
  With lr = 0 the weights never move, so both iterations must match to the last bit.
- An update sums float32 gradients over micro-batches and ranks; two processes sum in another order than one.
  Its rounding is measured, not guessed: the same one-process run with other micro-batch sizes (the same sums
  in other orders) shows how far equivalent orders land, and the two-process weights must land within twice
  the farthest of them. The update itself must be far larger than that, so a real data-parallel bug fails.
"""

from pathlib import Path

import pytest
import torch

from flowgrpo.checkpoint import latest_checkpoint
from flowgrpo.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[2]
ARGS = [
    "prompts_per_iteration=4",
    "rollout_prompts=1",
    "num_threads=1",
    "progress=false",
    "artifacts.tensorboard=false",
    "artifacts.plot=false",
    "checkpoint.save_final_model=false",
    "loss.kl.coef=0.01",
    "train.mini_batches=2",
    "advantage.estimator.std_scope=batch",
]
MICRO = 7  # micro-batches straddle rollout batches in one process, never across ranks in two
# world-size invariant quantities (backward_passes is not: each rank splits its own edges into micro-batches)
ROLLOUT_KEYS = (
    "reward_mean",
    "reward_std",
    "adv/mean",
    "adv/std",
    "adv/abs_max",
    "edges/trained",
    "plan/trained_steps",
    "images",
    "nfe_nograd",
    "nfe_grad",
    "reward_calls",
)


# the published FLUX runs' per-sample trained steps and decoded x0 must agree across ranks too
PUBLISHED_FLUX = [
    "sampler.schedule={name: time_shift, shift: 3.0, integer_timesteps: true}",
    "sampler.decode=last_x0",
    "plan={name: full_sde, train_fraction: 1.0}",
    "edges.per_sample_fraction=0.6",
    "edges.exclude_last=true",
]


def _run(launch_ranks, out: Path, world: int, *extra: str, recipe: str = "flow_grpo") -> Path:
    launch_ranks(
        "train_t2i.py", [str(ROOT / f"configs/t2i/tiny/{recipe}.yaml"), f"output_dir={out}", *ARGS, *extra], world
    )
    return out


def _policy(out: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(latest_checkpoint(out / "checkpoints") / "tensors.policy.safetensors")


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.mark.parametrize(
    "recipe, extra",
    [("flow_grpo", ()), ("dance_grpo", tuple(PUBLISHED_FLUX)), ("flow_grpo", ("rollout_split=2",))],
    ids=["flow_grpo", "dance_grpo_published", "groups_straddling_ranks"],  # split: half of each group per rank
)
def test_rollouts_and_advantages_match_to_the_last_bit(tmp_path, launch_ranks, recipe, extra):
    frozen = ["iterations=2", "optim.lr=0", f"train.micro_batch_size={MICRO}", *extra]
    one = read_metrics(_run(launch_ranks, tmp_path / "one", 1, *frozen, recipe=recipe) / "metrics.jsonl")
    two = read_metrics(_run(launch_ranks, tmp_path / "two", 2, *frozen, recipe=recipe) / "metrics.jsonl")
    assert [r["iteration"] for r in two] == [1, 2]
    for a, b in zip(one, two):
        for key in ROLLOUT_KEYS:
            assert a[key] == b[key], (a["iteration"], key, a[key], b[key])
        assert a["reward_std"] > 0 and a["adv/abs_max"] > 0  # a batch that carries a signal


def _ulp32(value: float) -> float:
    return abs(value) * 2.0**-23


def test_update_matches_one_process_to_reduction_order(tmp_path, launch_ranks):
    step = ["iterations=1", "optim.lr=0.03"]
    runs = {
        "one": _run(launch_ranks, tmp_path / "one", 1, *step, f"train.micro_batch_size={MICRO}"),
        "two": _run(launch_ranks, tmp_path / "two", 2, *step, f"train.micro_batch_size={MICRO}"),
    }
    # the same sums in other orders (one process, other micro-batches): how far float32 rounding alone moves them
    refs = [_run(launch_ranks, tmp_path / f"mb{m}", 1, *step, f"train.micro_batch_size={m}") for m in (1, 3)]
    one, two = _policy(runs["one"]), _policy(runs["two"])
    spread = max(_max_diff(one, _policy(r)) for r in refs)
    assert spread > 0, "other micro-batch sizes gave identical weights: the rounding reference measured nothing"
    update = max(float(one[k].abs().max()) for k in one if "lora_B" in k)  # LoRA B starts at 0
    assert update > 1000 * spread, (update, spread)  # a missing or doubled rank's gradient would show
    assert _max_diff(one, two) <= 2 * spread, (_max_diff(one, two), spread)

    # the record describes the whole batch on both sides: counts exactly, loss metrics as close as the weights
    m1, m2 = (read_metrics(runs[n] / "metrics.jsonl")[0] for n in ("one", "two"))
    m_refs = [read_metrics(r / "metrics.jsonl")[0] for r in refs]
    for key in ROLLOUT_KEYS + ("optimizer_steps",):
        assert m1[key] == m2[key], key
    for key in ("loss/policy", "loss/total", "kl/ref_mean", "ratio/mean"):
        key_spread = max(max(abs(m[key] - m1[key]) for m in m_refs), _ulp32(m1[key]))
        assert abs(m2[key] - m1[key]) <= 2 * key_spread, (key, m1[key], m2[key], key_spread)
