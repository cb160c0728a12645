"""The text trainer's per-prompt state (SPO's tracker, Prompt Replay's buffer): wired from the config, checkpointed
and resumed bit-identically (in a new trainer, and from one process to two), and ACE's reference pass."""

from pathlib import Path

import pytest
import torch

from flowgrpo.checkpoint import latest_checkpoint, list_checkpoints, load_checkpoint
from flowgrpo.config import ConfigError
from flowgrpo.metrics import read_metrics
from flowgrpo.text import TextGRPOTrainer, load_text_config, train_text

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "text" / "tiny_pattern.yaml"


def _tensors(run_dir: Path, part: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(latest_checkpoint(run_dir / "checkpoints") / f"tensors.{part}.safetensors")


def _assert_identical(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    """Bit for bit (a NaN equals a NaN: the prompt prior's 'unknown')."""
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0, equal_nan=True, msg=k)


def test_a_recipe_sets_the_prompt_sampler_and_spo_allows_single_samples(tmp_path):
    cfg = load_text_config(TINY, ["recipe=spo", "group_size=1"])
    assert cfg.prompt_sampling.name == "spo" and cfg.advantage.estimator.name == "spo" and cfg.group_size == 1
    path = tmp_path / "replay.yaml"
    path.write_text(f"base: {TINY}\nprompt_sampling: {{name: replay, fraction: 0.25}}\n")
    assert load_text_config(path).prompt_sampling.settings == {"fraction": 0.25}
    assert load_text_config(path, ["recipe=canon"]).prompt_sampling.name == "uniform"  # a recipe replaces it
    with pytest.raises(ConfigError, match="unknown prompt sampler 'spoo'"):
        load_text_config(TINY, ["prompt_sampling=spoo"])
    with pytest.raises(ConfigError, match="prompt_sampling.fraction"):
        load_text_config(TINY, ["prompt_sampling={name: replay, fraction: 2}"])


COMMON = ["iterations=4", "checkpoint.every=2", "checkpoint.keep_last=5", "train.inner_epochs=1"]


@pytest.mark.parametrize(
    "extra",
    [["recipe=spo"], ["recipe=spo", "advantage.estimator.rho_type=kl"],
     pytest.param(["recipe=spo", "prompt_sampling={name: replay, fraction: 0.5, cooldown: 0}"],
                  marks=pytest.mark.slow)],
    ids=["spo", "spo_kl", "spo_replay"],
)  # fmt: skip
def test_stop_and_resume_keeps_the_prompt_state_bit_identical(tiny_config, extra):
    ref_cfg = tiny_config(*COMMON, *extra, name="uninterrupted")
    full = train_text(ref_cfg)
    part = tiny_config(*COMMON, *extra, "stop_after=2", name="interrupted")
    first = train_text(part)
    torch.manual_seed(4321)
    resumed = TextGRPOTrainer(tiny_config(*COMMON, *extra, "resume=true", name="interrupted"))
    assert resumed.iteration == 2 and resumed.sampler.draws == 2
    rest = resumed.train()
    ref, out = Path(ref_cfg.output_dir), Path(part.output_dir)
    kl = "advantage.estimator.rho_type=kl" in extra  # SPO's KL-adaptive rho: the stored completions too
    for group in ("model", "prompt_state", *(("spo_completions",) if kl else ())):
        _assert_identical(_tensors(ref, group), _tensors(out, group))
    state = _tensors(out, "prompt_state")
    assert state["seen"].sum() == 4 * 2 and (state["alpha"] + state["beta"] > 0).sum() == (state["seen"] > 0).sum()
    assert [r["reward_mean"] for r in first + rest] == [r["reward_mean"] for r in full]


def test_ace_scores_policy_and_reference_before_the_advantages(tiny_config):
    """ACE needs each completion's log-prob under the policy and the reference before the advantages: both passes
    run over every sequence (no grad), even without a KL term; the loss gets no reference log-probs."""
    history = train_text(tiny_config("recipe=ace", "iterations=2", "checkpoint.every=0", "train.inner_epochs=1"))
    for r in history:
        first = 2 * 8 * (r["iteration"] == 1)  # step 1: the shared-prompt vs plain comparison
        assert r["nfe_nograd"] == 16 + 16 + first and "kl/ref_mean" not in r
    # step 1 samples from the initial policy: confidence 0 (policy = reference), the penalty factor 1 + softplus(0)
    assert history[0]["ace/penalty_mean"] == pytest.approx(1 + torch.log(torch.tensor(2.0)).item())
    assert history[1]["ace/penalty_mean"] != pytest.approx(history[0]["ace/penalty_mean"])  # the policy moved


def _steps(run_dir: Path) -> tuple[list[dict[str, torch.Tensor]], list[dict[str, int]]]:
    """The prompt table and the prompt order's state after each step (every step checkpointed)."""
    saved = [load_checkpoint(c, restore_rng=False) for c in list_checkpoints(run_dir / "checkpoints")]
    return [c.tensors["prompt_state"] for c in saved], [c.state["sampler"] for c in saved]


@pytest.mark.heavy
@pytest.mark.parametrize("recipe", ["spo", "prompt_replay"])
def test_one_process_stopped_and_resumed_in_two_matches_one_uninterrupted(tmp_path, launch_ranks, recipe):
    """SPO's tracker and priorities, Prompt Replay's buffer: every rank computes the same state from the gathered
    batch, so a run stopped in one process and resumed in two draws the same prompts, gets the same rewards and
    ends every step with the same state, bit for bit."""
    args = [str(TINY), f"recipe={recipe}", "iterations=4", "progress=false", "num_threads=1", "train.inner_epochs=1",
            "prompts_per_iteration=4", "group_size=4", "generation.batch_size=4", "optim.eps=1e-3",
            "checkpoint.every=1", "checkpoint.keep_last=5"]  # fmt: skip
    one, mixed = tmp_path / "one", tmp_path / "mixed"
    launch_ranks("train_text.py", [*args, f"output_dir={one}"], 1)
    launch_ranks("train_text.py", [*args, f"output_dir={mixed}", "stop_after=2"], 1)
    launch_ranks("train_text.py", [*args, f"output_dir={mixed}", "resume=true"], 2)
    (ref, order), (out, mixed_order) = _steps(one), _steps(mixed)
    assert len(ref) == len(out) == 4 and order == mixed_order  # the permutation's place and the policy's draws
    for a, b in zip(ref, out):  # the table after each step
        _assert_identical(a, b)
    seen = [torch.zeros_like(ref[0]["seen"]), *(t["seen"] for t in ref)]
    assert all(int((after - before).sum()) == 4 for before, after in zip(seen, seen[1:]))  # 4 groups a step
    want, got = read_metrics(one / "metrics.jsonl"), read_metrics(mixed / "metrics.jsonl")
    assert [r["iteration"] for r in got] == [1, 2, 3, 4]
    for key in ("reward_mean", "reward_std"):
        assert [r[key] for r in got] == [r[key] for r in want], key
    if recipe == "prompt_replay":  # the buffer re-served prompts in the two-process steps
        assert ref[1]["replays"].sum() == 0 and ref[-1]["replays"].sum() >= 1


def test_an_offline_value_column_starts_spo_and_is_checked(tiny_config, tmp_path):
    import json

    data = tmp_path / "prompts.jsonl"
    rates = [0.25, None, 1.0, 0.0]
    with data.open("w") as f:
        for i, p in enumerate(rates):
            f.write(json.dumps({"prompt": f"Write a again and again ({i}): ", "target": "a", "pass_rate": p}) + "\n")
    common = [f"data.path={data}", "data.task=null", "data.chat_template=false", "iterations=1", "checkpoint.every=1"]
    cfg = tiny_config(*common, "recipe=spo", "data.value_column=pass_rate", "prompts_per_iteration=2", name="prior")
    train_text(cfg)
    prior = _tensors(Path(cfg.output_dir), "prompt_state")["prior"]
    assert prior.tolist() == [0.25, -1.0, 1.0, 0.0]  # -1: unknown
    with pytest.raises(ConfigError, match="data.value_column: read by the estimators"):
        tiny_config(*common, "data.value_column=pass_rate", name="grpo")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "Write a: ", "target": "a", "pass_rate": "x"}) + "\n")
    with pytest.raises(ConfigError, match="must hold numbers in"):
        TextGRPOTrainer(tiny_config(*common, f"data.path={bad}", "recipe=spo", "data.value_column=pass_rate",
                                    "prompts_per_iteration=1", name="bad"))  # fmt: skip
    with pytest.raises(ConfigError, match="no row has a value"):
        TextGRPOTrainer(tiny_config(*common, "recipe=spo", "data.value_column=nothing", name="none"))
