"""Edit-R1's group mask (`edges.group_filter`) and prompt ban (prompt sampler `ban_saturated`):
flowgrpo/core/group_filter.py against the source's formulas (PKU-YuanGroup/Edit-R1@4217f25
scripts/train_nft_qwen_image_edit.py `valid_mask`, flow_grpo/stat_tracking.py `PerPromptStatTracker.update`),
and in tiny runs of methods nft and grpo: the saturated group leaves the loss, its prompt never comes back, and a
run stopped with a ban in its table resumes bit-identically."""

from pathlib import Path

import numpy as np
import pytest
import torch

from flowgrpo.checkpoint import latest_checkpoint
from flowgrpo.config import ConfigError
from flowgrpo.core import GroupBatch
from flowgrpo.core.group_filter import ban_saturated, banned_rows, group_keep, group_stats
from flowgrpo.core.prompt_state import LATER_COLUMNS, PromptTable
from flowgrpo.t2i import T2ITrainer
from reward_models.base import Scorer
from reward_models.registry import register
from reward_models.toy import brightness

SATURATED = "a red apple"


class _SaturatedApple(Scorer):
    name = "test_saturated_apple"

    def score_batch(self, images, prompts, metadata):
        value = brightness(images.tensor().float().clamp(0, 1)) * 0.5  # < 0.9, and varies within a group
        apple = torch.tensor([p == SATURATED for p in prompts])
        return {self.key: torch.where(apple, torch.full_like(value, 0.95), value)}


@register("test_saturated_apple")
def _build(*, batch_size: int = 64) -> _SaturatedApple:
    """Half the brightness; 0.95 for every image of 'a red apple' (a saturated group; tests)."""
    return _SaturatedApple(batch_size=batch_size)


def _source_mask_and_ban(groups: list[list[float]], weights: list[float]) -> tuple[list[bool], list[bool]]:
    """The source, per prompt: the weighted sum (`avg`), np.std / np.mean (float64), valid_mask and the ban."""
    keep, ban = [], []
    for heads in groups:
        avg = np.sum(np.array(heads, dtype=np.float32).astype(np.float64) * np.array(weights), axis=-1)  # as ours
        std, mean = np.std(avg), np.mean(avg)
        keep.append(bool(std > 0.05 and mean < 0.9))
        ban.append(bool(std < 0.05 and mean > 0.9))
    return keep, ban


def test_mask_and_ban_rule_rederived_in_float64_on_fixed_rewards():
    weights = [0.8, 0.2]
    groups = [  # [group][sample][head]
        [[1.0, 1.0], [1.0, 0.9], [0.95, 1.0], [1.0, 1.0]],  # saturated: masked and banned
        [[0.2, 0.1], [0.9, 0.3], [0.5, 0.8], [0.1, 0.0]],  # spread, low mean: trained
        [[0.85, 0.85], [0.85, 0.85], [0.85, 0.85], [0.85, 0.85]],  # std 0, mean < 0.9: masked, not banned
        [[1.0, 1.0], [1.0, 1.0], [1.0, 1.0], [0.8, 0.8]],  # std 0.087 but mean 0.95: masked, not banned
        [[0.5, 0.5], [0.51, 0.5], [0.52, 0.5], [0.5, 0.5]],  # low spread, low mean: masked, not banned
    ]
    keep_ref, ban_ref = _source_mask_and_ban(groups, weights)
    rewards = torch.tensor(groups, dtype=torch.float32)
    batch = GroupBatch(rewards=rewards, reward_weights=weights, reward_names=["a", "b"])
    mean, std = group_stats(batch, weights)
    ref = torch.tensor(groups, dtype=torch.float32).double() @ torch.tensor(weights, dtype=torch.float64)
    assert torch.allclose(std, ref.std(-1, correction=0), rtol=0, atol=1e-15)  # biased, as np.std
    assert group_keep(batch, 0.05, 0.9, weights).tolist() == keep_ref == [False, True, False, False, False]
    table = PromptTable(len(groups))
    table.observe(torch.arange(len(groups)), batch.scalar_rewards(), batch.usable(batch.scalar_rewards()), 1)
    assert banned_rows(table, 0.05, 0.9).tolist() == ban_ref == [True, False, False, False, False]
    # a NaN reward is left out of the statistics; a group without a usable one is masked and never banned
    rewards[1, 0, 0] = float("nan")
    rewards[4] = float("nan")
    nan_batch = GroupBatch(rewards=rewards, reward_weights=weights, reward_names=["a", "b"])
    _, std_nan = group_stats(nan_batch, weights)
    assert torch.allclose(std_nan[1], ref[1, 1:].std(correction=0), rtol=0, atol=1e-15)
    assert bool(torch.isnan(std_nan[4]))
    assert group_keep(nan_batch, 0.05, 0.9, weights).tolist() == [False, True, False, False, False]
    # both comparisons are strict: a group exactly at a threshold is masked (values exact in binary)
    exact = GroupBatch(rewards=torch.tensor([[0.25, 0.75], [0.5, 1.0]]))  # mean 0.5 / 0.75, std 0.25 each
    assert group_keep(exact, 0.25, 1.0).tolist() == [False, False]
    assert group_keep(exact, 0.125, 0.75).tolist() == [True, False]


def test_ban_sampler_draws_only_unbanned_rows_and_fails_clearly_when_too_few_remain():
    table = PromptTable(6)
    rewards = torch.tensor([[1.0, 1.0], [0.2, 0.8], [1.0, 1.0], [0.3, 0.4], [0.5, 0.5], [0.1, 0.9]])
    table.observe(torch.arange(6), rewards, torch.ones_like(rewards, dtype=torch.bool), 1)
    draws = [ban_saturated(table, 3, d, seed=7) for d in range(20)]
    assert all(len(set(rows)) == 3 and not {0, 2} & set(rows) for rows in draws)  # rows 0, 2: std 0, mean 1
    assert draws == [ban_saturated(table, 3, d, seed=7) for d in range(20)]  # a function of (table, draw, seed)
    assert ban_saturated(table, 4, 0, seed=7) and ban_saturated(PromptTable(2), 2, 0, seed=7)  # unseen: not banned
    with pytest.raises(ValueError, match=r"'ban_saturated': 2 of 6 prompts are banned .* 4 remain for a step of 5"):
        ban_saturated(table, 5, 0, seed=7)
    # a checkpoint written before the std column resumes with it unknown (-1): nothing banned by it
    old = {k: v for k, v in table.state_dict().items() if k != "std"}
    resumed = PromptTable(6)
    resumed.load_state_dict(old)
    assert resumed["std"].tolist() == [LATER_COLUMNS["std"]] * 6 and not banned_rows(resumed, 0.05, 0.9).any()


FAST = ["sampler.num_steps=3", "group_size=4", "train.micro_batch_size=8", "eval.every=0", "num_threads=1",
        "checkpoint.keep_last=5", "rewards=[{name: test_saturated_apple}]", "seed=3",
        "edges.group_filter={min_std: 1.0e-6, max_mean: 0.9}",
        "prompt_sampling={name: ban_saturated, std_below: 1.0e-6, mean_above: 0.9}"]  # fmt: skip


def _tensors(run_dir: Path, part: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(latest_checkpoint(run_dir / "checkpoints") / f"tensors.{part}.safetensors")


def _logging_draws(trainer: T2ITrainer) -> list[list[str]]:
    drawn: list[list[str]] = []
    sampler, draw = trainer.prompt_sampler, trainer.prompt_sampler.next

    def next_rows(n: int) -> list[int]:
        rows = draw(n)
        drawn.append([trainer.prompts.prompts[r] for r in rows])
        return rows

    sampler.next = next_rows  # type: ignore[method-assign]
    return drawn


def test_nft_masks_the_saturated_group_bans_its_prompt_and_resumes_bit_identically(recipe_config):
    common = [*FAST, "iterations=3", "checkpoint.every=1"]
    full = T2ITrainer(recipe_config("diffusion_nft", *common, name="uninterrupted"))
    drawn = _logging_draws(full)
    history = full.train()
    first = next(i for i, prompts in enumerate(drawn) if SATURATED in prompts)
    assert first < len(drawn) - 1  # the seed makes the apple come in a step before the last
    assert all(SATURATED not in prompts for prompts in drawn[first + 1 :])  # banned: never drawn again
    for prompts, record in zip(drawn, history):
        assert record["group_filter/masked_frac"] == prompts.count(SATURATED) / len(prompts)
        assert record["backward_passes"] > 0  # the other group trains
    state = full.prompt_state
    rows = full.prompts.prompts
    assert state is not None and banned_rows(state, 1e-6, 0.9).tolist() == [p == SATURATED for p in rows]

    stopped = recipe_config("diffusion_nft", *common, f"stop_after={first + 1}", name="interrupted")
    T2ITrainer(stopped).train()
    assert bool(_tensors(Path(stopped.output_dir), "prompt_state")["std"][full.prompts.prompts.index(SATURATED)] == 0)
    torch.manual_seed(4321)  # the resumed process starts from an unrelated RNG state
    resumed = T2ITrainer(recipe_config("diffusion_nft", *common, "resume=true", name="interrupted"))
    rest = _logging_draws(resumed)
    resumed.train()
    assert rest == drawn[first + 1 :]
    ref, out = Path(full.cfg.output_dir), Path(resumed.cfg.output_dir)
    for group in ("policy", "ema", "prompt_state", "nft_old"):
        a, b = _tensors(ref, group), _tensors(out, group)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), group


def test_grpo_leaves_the_saturated_group_s_edges_out(recipe_config):
    prompts = f'data.prompts=["{SATURATED}", "a cat"]'
    cfg = recipe_config("flow_grpo", *FAST, prompts, "iterations=1", "checkpoint.every=0")
    (record,) = T2ITrainer(cfg).train()
    assert record["group_filter/masked_frac"] == 0.5  # the apple's group of the 2
    assert record["edges/trained"] == 4 * record["plan/trained_steps"]  # the cat's 4 images


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["method=awm", "edges.group_filter={min_std: 0.05}"], "edges.group_filter masks groups in the loss of"),
        (["edges.group_filter={min_std: -1}"], "edges.group_filter.min_std"),
        (["prompt_sampling={name: ban_saturated, std_over: 1}"], "has no setting 'std_over'"),
    ],
)
def test_a_wrong_setting_is_a_one_line_config_error(recipe_config, overrides, message):
    with pytest.raises(ConfigError, match=message) as err:
        recipe_config("diffusion_nft", *overrides)
    assert len(str(err.value).splitlines()) == 2  # the header, then one line
