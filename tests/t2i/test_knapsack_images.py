"""Knapsack RL in the image trainer (prompt_sampling knapsack, flowgrpo/t2i/ragged.py): ragged budgets really happen,
the sampler denoises exactly sum N_i images (no padding row), each group is normalised over its real rows, the
prompt table's budget state stops and resumes bit-identically (from one process into two, whose ranks roll out
batches of other sizes: test_prompt_state_images.py), and what ragged groups cannot take is refused when the config
loads."""

from pathlib import Path

import pytest
import torch

from flowgrpo.checkpoint import latest_checkpoint
from flowgrpo.config import ConfigError
from flowgrpo.core import GroupBatch, compute_advantages
from flowgrpo.t2i import T2ITrainer, train_t2i
from flowgrpo.t2i.credit import assign_credit
from flowgrpo.t2i.ragged import spread

# small: 3 sampler steps; the recipe's 2 of 3 prompts per step in file order, so step 2 pairs the prompt not yet seen
# (success rate `unknown` 0.2) with one seen (its mean brightness, ~0.42): budgets 10 and 6 of the 16 images
FAST = ["sampler.num_steps=3", "eval.every=0", "num_threads=1", "checkpoint.keep_last=5", "train.inner_epochs=1"]


def _tensors(run_dir: Path, part: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(latest_checkpoint(run_dir / "checkpoints") / f"tensors.{part}.safetensors")


def test_ragged_budgets_denoise_only_real_rows_and_resume_bit_identically(recipe_config):
    common = [*FAST, "iterations=3", "checkpoint.every=1"]
    ref_cfg = recipe_config("knapsack", *common, name="uninterrupted")
    full = train_t2i(ref_cfg)
    budgets = [(r["knapsack/budget_min"], r["knapsack/budget_max"]) for r in full]
    assert budgets[0] == (8, 8) and budgets[1][0] < budgets[1][1], budgets  # ragged from step 2 on
    steps, P = ref_cfg.sampler.num_steps, ref_cfg.prompts_per_iteration
    for r, (lo, hi) in zip(full, budgets):
        total = P * ref_cfg.group_size  # sum N_i: the step's compute stays P x group_size
        assert r["images"] == total and r["adv/num_live"] == total and r["rewards/nan_count"] == 0
        assert r["guard/nonfinite_rewards"] == 0  # a padding slot is no missing reward
        # denoiser rows (cfg_mode none: one per image and step): sum N_i x steps, never P x max N_i x steps
        assert r["rollout_nfe_nograd"] == total * steps
        if lo < hi:
            assert r["rollout_nfe_nograd"] < P * hi * steps
        assert r["edges/trained"] == total * r["plan/trained_steps"] and r["nfe_grad"] == r["edges/trained"]
        assert r["check/first_pass_ratio_dev"] < 1e-4  # the real rows re-scored by their own weights: ratio 1
    first = train_t2i(recipe_config("knapsack", *common, "stop_after=2", name="interrupted"))
    torch.manual_seed(4321)  # the resumed process starts from an unrelated RNG state
    resumed = T2ITrainer(recipe_config("knapsack", *common, "resume=true", name="interrupted"))
    rest = resumed.train()
    assert [r["knapsack/budget_max"] for r in first + rest] == [hi for _, hi in budgets]
    assert [r["reward_mean"] for r in first + rest] == [r["reward_mean"] for r in full]
    for group in ("policy", "ema", "prompt_state"):
        ref, out = _tensors(Path(ref_cfg.output_dir), group), _tensors(resumed.out, group)
        assert ref.keys() == out.keys()
        for k in ref:
            assert torch.equal(ref[k], out[k]), (group, k)


def test_each_group_is_normalised_over_its_real_rows(recipe_config):
    """Sizes [2, 5]: 7 chains sampled (leaves padded with -1), each group's advantages those of its rows alone."""
    from pipelines.plans import build_plan

    cfg = recipe_config("knapsack", *FAST, "iterations=0", name="unit")
    trainer = T2ITrainer(cfg)
    plan = build_plan(cfg.plan.name, cfg.sampler.num_steps, 0, cfg.seed, **cfg.plan.settings)
    nfe0 = trainer.sampler.counters.nfe_nograd
    tree = trainer.sampler.run(trainer.adapter, ["a cat", "a dog"], plan, [2, 5], torch.Generator().manual_seed(0))
    assert trainer.sampler.counters.nfe_nograd - nfe0 == 7 * cfg.sampler.num_steps  # no padding row denoised
    real = tree.leaves >= 0
    assert real.tolist() == [[True] * 2 + [False] * 3, [True] * 5]
    assert int((tree.depth == cfg.sampler.num_steps).sum()) == 7
    values = torch.tensor([[0.1], [0.9], [0.2], [0.4], [0.3], [0.8], [0.6]])
    credit = assign_credit(tree, spread(values, real), None, None, cfg, 0)
    assert credit.metrics["adv/num_live"] == 7 and credit.metrics["rewards/nan_count"] == 0
    leaf_adv = credit.node_advantage[tree.leaves[real]]
    for rows, group in ((slice(0, 2), values[:2]), (slice(2, 7), values[2:])):  # each group on its own
        alone = compute_advantages(GroupBatch(rewards=group.T.unsqueeze(-1)), cfg.advantage).advantages[0]
        torch.testing.assert_close(leaf_adv[rows], alone.float())
    assert credit.edges.numel() == 7 * len(plan.trained_steps)  # only real chains' edges are trained


@pytest.mark.parametrize(
    ("recipe", "overrides", "message"),
    [
        ("diffusion_nft", [], "with method 'nft': ragged groups .* cannot take method 'nft'"),
        ("branchgrpo", [], "cannot take advantage estimator 'tree_depth'"),
        ("flow_grpo_fast", [], "cannot take sampler.share_noise"),
        ("flow_grpo", ["rollout_split=2"], "cannot take rollout_split 2"),
        ("flow_grpo", ["edges.group_filter={min_std: 0.05}"], "cannot take edges.group_filter"),
        ("flow_grpo", ["prompt_sampling={name: knapsack, low: 9}"], r"1 <= low <= group_size \(8\) <= high"),
    ],
)
def test_what_ragged_groups_cannot_take_is_a_one_line_config_error(recipe_config, recipe, overrides, message):
    sampling = [] if any(o.startswith("prompt_sampling") for o in overrides) else ["prompt_sampling=knapsack"]
    with pytest.raises(ConfigError, match=message) as err:
        recipe_config(recipe, *sampling, *overrides)
    problem = str(err.value).splitlines()
    assert len(problem) == 2 and problem[0].startswith("invalid T2IConfig")  # the header, then one line
