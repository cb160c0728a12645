"""scripts/bench.py for the methods that train on clean samples (AWM, SFT, Diffusion-DPO, NFT, DRaFT-LV) and GARDO: one
iteration's counted denoiser rows, backward passes and reward calls equal the closed form
(scripts/bench_t2i/closed_form.py update_counts), and the closed form equals the numbers worked out by hand here;
the compute-to-reward mode (--to-reward) sums the counters up to the iteration that reached the target."""

from __future__ import annotations

import importlib.util
import json
import logging
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]

# (recipe, overrides, by hand: no-grad rows, grad rows, backward passes, reward calls) of one iteration with
# P = 2 prompts x G = 8 samples of T = 6 ODE steps (unless the recipe says otherwise): the rollout is 2 x 8 x 6 = 96
# no-grad rows.
CASES = {
    # 16 samples x 3 times = 48 grad rows in 2 mini-batches x 3 times = 6 backward passes; the reference and EMA
    # penalties re-run every grad row (96); old log-probs for every term after the first mini-batch: 3 x 8 = 24
    "awm": (("train.mini_batches=2",), 96 + 96 + 24, 48, 6, 2),
    # the best of each group of 16 (a 2 x 16 x 6 = 192-row rollout): 2 samples x 3 times
    "sft_best_of_n": ((), 192, 6, 3, 2),
    # margin 0: every ordered pair of distinct rewards, 2 x 28 = 56 pairs x 1 time, 2 rows each with grad and
    # 2 without (the reference); 56 pairs in micro-batches of 48: 2 backward passes
    "diffusion_dpo_online": (("group_size=8", "dpo.pairs=margin", "dpo.timesteps=1"), 96 + 112, 112, 2, 2),
    # 8 dataset pairs in 4 mini-batches (2 pairs each) x 2 times = 8 backward passes, 2 + 2 rows each; the rollout
    # is 2 prompts x 2 samples x 6 steps
    "diffusion_dpo_offline": ((), 24 + 32, 32, 8, 2),
}


def _bench():
    spec = importlib.util.spec_from_file_location("bench_t2i_script_methods", ROOT / "scripts" / "bench.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def quiet():
    """The bench lowers the flowgrpo logger and sets torch threads: restored after the test."""
    logger = logging.getLogger("flowgrpo")
    level, threads = logger.level, torch.get_num_threads()
    yield
    logger.setLevel(level)
    torch.set_num_threads(threads)


def _one_iteration(recipe: str, overrides: tuple, tmp_path: Path) -> dict:
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from flowgrpo.t2i import load_t2i_config
    from scripts.bench_t2i.recipes import RECIPES_DIR, drive, quiet_overrides, quiet_warnings

    quiet_warnings()
    cfg = load_t2i_config(RECIPES_DIR / f"{recipe}.yaml", [*quiet_overrides(tmp_path, 1, 1), *overrides])
    run = drive(cfg, 0, 1)
    run["trainer"].rewards.close()
    return run["iterations"][0]


@pytest.mark.parametrize("case", CASES)
def test_clean_sample_methods_count_their_closed_form(case, tmp_path, quiet):
    overrides, nograd, grad, backward, reward_calls = CASES[case]
    row = _one_iteration(case, overrides, tmp_path)
    cf = row["closed_form"]
    assert cf["simple"], cf["formula"]
    measured = (row["nfe_nograd"], row["nfe_grad"], row["backward_passes"], row["reward_calls"])
    assert measured == (nograd, grad, backward, reward_calls), cf["formula"]
    assert (cf["nfe_nograd"], cf["nfe_grad"], cf["backward_passes"], cf["reward_calls"]) == measured
    assert row["model"]["fwd_nograd_rows"] == nograd and row["model"]["fwd_grad_rows"] == grad  # the hooks agree


def test_draft_lv_counts_its_noise_draws(tmp_path, quiet):
    """DRaFT-LV: 16 samples, the last step once per noise draw (n = 2) with grad: 32 grad rows, one micro-batch (one
    backward), one scorer call per draw after the rollout's two; the hooks also see the 32 rows that checkpointing
    recomputes in backward."""
    row = _one_iteration("draft_lv", (), tmp_path)
    cf = row["closed_form"]
    assert cf["simple"] and "n = 2 noise draws" in cf["formula"], cf["formula"]
    measured = (row["nfe_nograd"], row["nfe_grad"], row["backward_passes"], row["reward_calls"])
    assert measured == (96, 32, 1, 2 + 2)
    assert (cf["nfe_nograd"], cf["nfe_grad"], cf["backward_passes"], cf["reward_calls"]) == measured
    assert row["model"]["fwd_grad_rows"] == 2 * 32 and row["model"]["fwd_nograd_rows"] == 96


@pytest.mark.parametrize("recipe", ["gardo", "gardo_nft"])
def test_gardo_reference_rows_are_the_gated_samples(recipe, tmp_path, quiet):
    """GARDO's reference forwards run on the gated samples (a data-dependent count the closed form reads from the
    record's gated fraction): K = 5 trained edges (grpo_gardo) / n_t = 5 times (nft_gardo) per gated sample."""
    row = _one_iteration(recipe, (), tmp_path)
    cf = row["closed_form"]
    assert cf["simple"], cf["formula"]
    gated = int(cf["formula"].split("GARDO reference: ")[1].split(" gated")[0])
    assert 1 <= gated < 16
    old = 0 if recipe == "gardo" else 80  # nft: the old policy re-runs every grad row
    assert row["nfe_grad"] == cf["nfe_grad"] == 80  # 16 chains x 5 trained edges / 16 samples x 5 times
    assert row["nfe_nograd"] == cf["nfe_nograd"] == 96 + old + 5 * gated
    assert row["reward_calls"] == cf["reward_calls"] == 2 * 3  # 2 rollout batches x 3 scorers


def test_to_reward_sums_the_counters_until_the_target(tmp_path, quiet):
    bench = _bench()
    common = ["--recipes", "sft_best_of_n", "--in-process", "--out-dir", str(tmp_path / "runs")]
    md = tmp_path / "benchmarks.md"
    # a target below any reward: reached by the first iteration's running mean (window 1)
    got = bench.main(
        [
            *common,
            "--to-reward",
            "-1",
            "--to-reward-window",
            "1",
            "--json",
            str(tmp_path / "a.json"),
            "--markdown",
            str(md),
        ]
    )
    r = got["to_reward"]["sft_best_of_n"]
    assert r["reached_at"] == 1 and r["iterations_run"] == 1 and r["target"] == -1
    assert r["totals"] == {"nfe_nograd": 192, "nfe_grad": 6, "backward_passes": 3, "reward_calls": 2, "images": 32}
    # out of reach: the cap ends it, the counters of both iterations summed
    got = bench.main(
        [*common, "--to-reward-rise", "1.0", "--to-reward-max-iterations", "2"]
        + ["--json", str(tmp_path / "b.json"), "--markdown", str(md)]
    )
    r = json.loads((tmp_path / "b.json").read_text())["to_reward"]["sft_best_of_n"]
    assert r["reached_at"] is None and r["iterations_run"] == 2 and len(r["rewards"]) == 2
    assert r["target"] == pytest.approx(r["first_reward"] + 1.0)
    assert r["totals"]["nfe_nograd"] == 384 and r["totals"]["backward_passes"] == 6
    text = md.read_text()
    assert text.count("## Compute to reach a reward (tiny models, CPU)") == 1  # the section was replaced
    assert "| sft_best_of_n | sft | sd3 |" in text and "not reached (2)" in text
    with pytest.raises(SystemExit):
        bench.main([*common, "--to-reward", "0.5", "--to-reward-rise", "0.1"])  # one target, not both
