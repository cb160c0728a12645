"""The image trainer's per-prompt state (SPO's tracker, Prompt Replay's buffer), wired as in the text trainer: the
`prompt_sampling` key, the table handed to the estimator by credit assignment, checkpointed and resumed
bit-identically: in a new trainer, and from one process into two (SPO, Prompt Replay and Knapsack RL's budgets)."""

from pathlib import Path

import pytest
import torch

from flowgrpo.checkpoint import latest_checkpoint, list_checkpoints, load_checkpoint
from flowgrpo.config import ConfigError
from flowgrpo.metrics import read_metrics
from flowgrpo.t2i import T2ITrainer, train_t2i

# small and fast: 3 sampler steps, groups of 4, 2 of the 4 prompts per step, no evaluation, no grids
FAST = ["sampler.num_steps=3", "group_size=4", "train.micro_batch_size=12", "eval.every=0", "num_threads=1",
        "checkpoint.keep_last=5", "train.inner_epochs=1"]  # fmt: skip


def _tensors(run_dir: Path, part: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(latest_checkpoint(run_dir / "checkpoints") / f"tensors.{part}.safetensors")


def _assert_identical(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_spo_stop_and_resume_keeps_weights_and_prompt_state_bit_identical(recipe_config):
    common = [*FAST, "iterations=3", "checkpoint.every=1"]
    ref_cfg = recipe_config("spo", *common, name="uninterrupted")
    full = train_t2i(ref_cfg)
    for r in full:  # the rollout re-scored by its own weights: ratio 1
        assert r["check/first_pass_ratio_dev"] < 1e-4 and "spo/baseline_mean" in r
    first = train_t2i(recipe_config("spo", *common, "stop_after=1", name="interrupted"))
    torch.manual_seed(4321)  # the resumed process starts from an unrelated RNG state
    resumed = T2ITrainer(recipe_config("spo", *common, "resume=true", name="interrupted"))
    assert resumed.iteration == 1 and resumed.prompt_sampler.draws == 1
    rest = resumed.train()
    ref, out = Path(ref_cfg.output_dir), Path(resumed.cfg.output_dir)
    for group in ("policy", "ema", "prompt_state"):
        _assert_identical(_tensors(ref, group), _tensors(out, group))
    state = _tensors(out, "prompt_state")
    assert state["seen"].sum() == 3 * 2  # every group of every step observed
    assert ((state["alpha"] + state["beta"]) > 0).sum() == (state["seen"] > 0).sum()  # the tracker of each seen
    assert [r["reward_mean"] for r in first + rest] == [r["reward_mean"] for r in full]


def test_replay_sampler_reserves_prompts_with_reward_spread(recipe_config):
    cfg = recipe_config(
        "flow_grpo", *FAST, "iterations=2", "checkpoint.every=2",
        "prompt_sampling={name: replay, fraction: 0.5, cooldown: 0}", name="replay",
    )  # fmt: skip
    trainer = T2ITrainer(cfg)
    history = trainer.train()
    assert all(r["check/first_pass_ratio_dev"] < 1e-4 for r in history)
    state = trainer.prompt_state
    assert state is not None and state["seen"].sum() == 2 * 2
    assert state["replays"].sum() == 1  # step 2 re-served one prompt (of 2) observed with spread at step 1
    assert _tensors(Path(cfg.output_dir), "prompt_state").keys() == set(state.columns)


def test_a_run_without_a_stateful_part_keeps_no_prompt_state(recipe_config):
    trainer = T2ITrainer(recipe_config("flow_grpo", *FAST, "iterations=0", name="plain"))
    assert trainer.prompt_state is None and trainer.prompt_sampler.policy is None


@pytest.mark.parametrize(
    ("recipe", "overrides", "message"),
    [
        ("spo", ["method=awm"], "advantage estimator 'spo' reads the per-prompt state, which method grpo or nft feeds"),
        ("flow_grpo", ["prompt_sampling=replay", "method=awm"], "prompt_sampling 'replay' reads the per-prompt"),
        ("flow_grpo", ["prompt_sampling=spoo"], "unknown prompt sampler 'spoo'"),
        ("flow_grpo", ["prompt_sampling={name: replay, fraction: 2}"], "prompt_sampling.fraction"),
    ],
)
def test_a_missing_or_wrong_piece_is_a_one_line_config_error(recipe_config, recipe, overrides, message):
    with pytest.raises(ConfigError, match=message) as err:
        recipe_config(recipe, *overrides)
    problem = str(err.value).splitlines()
    assert len(problem) == 2 and problem[0].startswith("invalid T2IConfig")  # the header, then one line


ROOT = Path(__file__).resolve().parents[2]
# exact: every value computed from the same weights (lr 0) over the gathered global batch, as in test_two_process.py
EXACT = ("reward_mean", "reward_std", "adv/mean", "adv/std", "adv/abs_max", "adv/num_live", "edges/trained",
         "images", "nfe_nograd", "nfe_grad", "reward_calls")  # fmt: skip
REPLAY = "prompt_sampling={name: replay, fraction: 0.5, cooldown: 0}"


def _steps(run_dir: Path) -> tuple[list[dict[str, torch.Tensor]], list[dict[str, int]]]:
    """The prompt table and the prompt order's state after each step (every step checkpointed)."""
    saved = [load_checkpoint(c, restore_rng=False) for c in list_checkpoints(run_dir / "checkpoints")]
    return [c.tensors["prompt_state"] for c in saved], [c.state["prompts"] for c in saved]


def _drawn(tables: list[dict[str, torch.Tensor]]) -> list[list[float]]:
    """The rows each step drew: how much each row's group count grew (a row twice in a batch: 2)."""
    seen = [torch.zeros_like(tables[0]["seen"]), *(t["seen"] for t in tables)]
    return [(after - before).tolist() for before, after in zip(seen, seen[1:])]


@pytest.mark.heavy
@pytest.mark.parametrize(
    ("recipe", "extra", "keys"),
    [
        # knapsack: 3 prompts in file order, groups of 8; from step 2 ragged budgets (10 / 6) put batches of other
        # sizes on the two ranks
        ("knapsack", [], ("knapsack/budget_min", "knapsack/budget_max")),
        ("spo", ["group_size=4", "train.micro_batch_size=12"], ("spo/baseline_mean", "spo/new_prompts", "spo/rho")),
        ("flow_grpo", ["group_size=4", "train.micro_batch_size=12", REPLAY], ()),
    ],
    ids=["knapsack", "spo", "replay"],
)
def test_one_process_resumed_in_two_matches_one_uninterrupted(tmp_path, launch_ranks, recipe, extra, keys):
    """Step 1 on one process, resumed on two for steps 2-3: every rank observes the gathered batch into its prompt
    table, so both ranks draw what one process draws (SPO's priorities, Prompt Replay's buffer, Knapsack's budgets)
    and the rewards, advantages and table after every step are the uninterrupted one-process run's to the last bit;
    the update (lr 0: the gradient of the same edges with the same advantages) as close as float32 sums in another
    order."""
    import shutil

    args = [str(ROOT / f"configs/t2i/tiny/{recipe}.yaml"), "sampler.num_steps=3", "eval.every=0", "num_threads=1",
            "checkpoint.keep_last=5", "train.inner_epochs=1", "progress=false", "artifacts.tensorboard=false",
            "artifacts.plot=false", "checkpoint.save_final_model=false", "iterations=3", "checkpoint.every=1",
            "optim.lr=0", *extra]  # fmt: skip
    one, mixed = tmp_path / "one", tmp_path / "mixed"
    launch_ranks("train_t2i.py", [*args, f"output_dir={one}"], 1)
    shutil.copytree(one, mixed)  # the one-process run as it stood after step 1: its later checkpoints dropped
    for later in list_checkpoints(mixed / "checkpoints")[1:]:
        shutil.rmtree(later)
    launch_ranks("train_t2i.py", [*args, f"output_dir={mixed}", "resume=true"], 2)
    want, got = read_metrics(one / "metrics.jsonl"), read_metrics(mixed / "metrics.jsonl")
    assert [r["iteration"] for r in got] == [1, 2, 3]
    for a, b in zip(want, got):
        for key in (*EXACT, *keys):
            assert a[key] == b[key], (a["iteration"], key, a[key], b[key])
        assert b["check/first_pass_ratio_dev"] < 1e-4  # each rank re-scores its own real edges: ratio 1
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5), a["iteration"]  # float32 sums reordered
    (ref, order), (out, mixed_order) = _steps(one), _steps(mixed)
    assert len(ref) == len(out) == 3 and order == mixed_order  # the permutation's place and the policy's draws
    for step, (a, b) in enumerate(zip(ref, out), 1):  # the table after each step, NaN included
        assert a.keys() == b.keys()
        for k in a:
            torch.testing.assert_close(b[k], a[k], rtol=0, atol=0, equal_nan=True, msg=f"step {step}: {k}")
    assert _drawn(ref) == _drawn(out)  # the prompts each step drew
    assert all(sum(d) == 2 for d in _drawn(ref))  # 2 prompts per step
    final = ref[-1]  # the stateful part really chose: otherwise this compares two plain runs
    if recipe == "knapsack":
        assert want[1]["knapsack/budget_min"] < want[1]["knapsack/budget_max"]  # ragged on two ranks
    elif recipe == "spo":
        assert (final["alpha"] + final["beta"] > 0).all()  # the tracker moved, the priorities read it
        assert [o["position"] for o in order] == [0, 0, 0]  # every row chosen by the priorities, none by the order
    else:
        assert ref[0]["replays"].sum() == 0 and final["replays"].sum() >= 1  # re-served after the resume
