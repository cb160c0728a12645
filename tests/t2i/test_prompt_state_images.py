"""The image trainer's per-prompt state (SPO's tracker, Prompt Replay's buffer), wired as in the text trainer: the
`prompt_sampling` key, the table handed to the estimator by credit assignment, checkpointed and resumed
bit-identically."""

from pathlib import Path

import pytest
import torch

from flowgrpo.checkpoint import latest_checkpoint
from flowgrpo.config import ConfigError
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
