"""Compute to reach a reward: one tiny recipe trained until its reward first reaches a target, with its counts.

Every recipe runs from its own configs/t2i/tiny/<recipe>.yaml with the same quiet overrides as the count part
(recipes.quiet_overrides) and the recipes' shared seed, so the untrained policies see the same prompts. The target
is a rise over the recipe's own first-iteration reward (`--to-reward-rise`; the tiny families start from different
brightness, so one absolute value would mean different work for each) or an absolute value (`--to-reward`). The
watched value is the running mean of the last `--to-reward-window` iterations' reward of the rollout (one
iteration's mean is too noisy to stop on); it is "reached" at the first iteration where that mean is >= the target.
Counts are the trainer's own per-iteration counters (the ones the count part checks against the closed forms),
summed up to that iteration; wall and CPU seconds are the train_iteration() calls' (the build is left out).
"""

from __future__ import annotations

import math
import statistics
import time
from pathlib import Path
from typing import Any

from .recipes import RECIPES_DIR, quiet_overrides, quiet_warnings
from .report import remeasured_lines, remeasured_reading

SECTION = "## Compute to reach a reward (tiny models, CPU)"
WATCH = "rewards/brightness/mean"  # every tiny recipe logs brightness (weight 0 where it is not the reward)
COUNTED = ("nfe_nograd", "nfe_grad", "backward_passes", "reward_calls", "images")


def target_of(first: float, args) -> float:
    return args.to_reward if args.to_reward is not None else first + args.to_reward_rise


def bench_to_reward(recipe: str, args) -> dict[str, Any]:
    """Train `recipe` until the running reward reaches the target or `args.to_reward_max_iterations` run out."""
    import torch

    from flowgrpo.t2i import T2ITrainer, load_t2i_config

    quiet_warnings()
    cap, window = args.to_reward_max_iterations, args.to_reward_window
    cfg = load_t2i_config(
        RECIPES_DIR / f"{recipe}.yaml", quiet_overrides(Path(args.out_dir) / recipe, args.num_threads, cap)
    )
    threads = torch.get_num_threads()
    trainer = T2ITrainer(cfg)
    totals = dict.fromkeys(COUNTED, 0.0)
    wall = cpu = 0.0
    rewards: list[float] = []
    target, reached = math.nan, None
    try:
        for it in range(1, cap + 1):
            cpu0, t0 = time.process_time(), time.perf_counter()
            record = trainer.train_iteration()
            wall += time.perf_counter() - t0
            cpu += time.process_time() - cpu0
            for k in COUNTED:
                totals[k] += float(record.get(k) or 0)
            rewards.append(float(record[WATCH]))
            if it == 1:
                target = target_of(rewards[0], args)
            if len(rewards) >= window and statistics.fmean(rewards[-window:]) >= target:
                reached = it
                break
    finally:
        trainer.rewards.close()
        torch.set_num_threads(threads)
    return {
        "recipe": recipe,
        "method": cfg.method,
        "family": cfg.model.family,
        "group_size": cfg.group_size,
        "prompts_per_iteration": cfg.prompts_per_iteration,
        "seed": cfg.seed,
        "first_reward": rewards[0],
        "target": target,
        "reached_at": reached,
        "iterations_run": len(rewards),
        "rewards": rewards,
        "totals": totals,
        "wall_s": wall,
        "cpu_s": cpu,
    }


def _seeds(rows: dict) -> str:
    seeds = sorted({r["seed"] for r in rows.values() if "seed" in r})
    return ", ".join(map(str, seeds)) or "?"


def _n(x: float) -> str:
    return f"{x:,.0f}"


def to_reward_markdown(result: dict) -> str:
    a, mach = result["settings"], result["machine"]
    target = (
        f"an absolute brightness of {a['to_reward']}"
        if a["to_reward"] is not None
        else f"the recipe's first-iteration brightness + {a['to_reward_rise']}"
    )
    rows = result["to_reward"]
    lines = [
        SECTION,
        "",
        f"`{result['command']}`",
        "",
        f"- date (UTC): {result['date']}; git {result['git']['commit']}"
        f"{' (uncommitted changes)' if result['git']['dirty'] else ''}",
        f"- machine: {mach['cpu']}, {mach['logical_cpus']} logical CPUs shared with other jobs, torch threads "
        f"{a['num_threads']}; load average before / after: {result['load_before']} / {result['load_after']} "
        "(other jobs ran on the same cores: the CPU seconds are the steadier column, wall seconds are indicative)",
        *remeasured_lines(result),
        f"- task: every recipe's configs/t2i/tiny/<recipe>.yaml as is (tiny random models, 32 px, brightness as the "
        f"reward, seed {_seeds(rows)}), trained until the running mean of the last {a['to_reward_window']} iterations' "
        f"rollout brightness first reaches {target}, at most {a['to_reward_max_iterations']} iterations; each "
        "recipe in its own process, one after the other.",
        "- counts are the trainer's counters (the ones checked against the closed forms above), summed over the "
        "iterations run up to the one that reached the target: denoiser rows without / with grad, backward passes, "
        "reward calls (scorer invocations), images sampled. Wall / CPU seconds: the train_iteration() calls only.",
        "",
        "| recipe | method | family | first | reached at it. | no-grad rows | grad rows | backward | reward calls | "
        "images | wall s | CPU s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    order = sorted(
        rows,
        key=lambda k: (
            "error" in rows[k],
            rows[k].get("reached_at") is None,
            rows[k].get("cpu_s", math.inf),
        ),
    )
    for name in order:
        r = rows[name]
        if "error" in r:
            lines.append(f"| {name} | failed: {r['error'][:80]} |  |  |  |  |  |  |  |  |  |  |")
            continue
        t = r["totals"]
        at = str(r["reached_at"]) if r["reached_at"] else f"not reached ({r['iterations_run']})"
        lines.append(
            f"| {name} | {r['method']} | {r['family']} | {r['first_reward']:.4f} | {at} | {_n(t['nfe_nograd'])} | "
            f"{_n(t['nfe_grad'])} | {_n(t['backward_passes'])} | {_n(t['reward_calls'])} | {_n(t['images'])} | "
            f"{r['wall_s']:.1f} | {r['cpu_s']:.1f} |"
        )
    reached = [k for k in order if rows[k].get("reached_at")]
    missed = [k for k in order if "error" not in rows[k] and not rows[k].get("reached_at")]
    lines += ["", "Reading:", ""]
    if reached:
        best = min(reached, key=lambda k: rows[k]["totals"]["nfe_nograd"] + rows[k]["totals"]["nfe_grad"])
        lines.append(
            f"- {len(reached)} of {len(rows)} recipes reached the target; fewest denoiser rows in all: {best} "
            f"({_n(rows[best]['totals']['nfe_nograd'] + rows[best]['totals']['nfe_grad'])}). A grad row also pays "
            "its backward pass (by the usual rule of thumb about two forwards more; not measured here), and rows "
            "of different families are different networks (SD3 / FLUX / DDIM-UNet tiny models): compare rows "
            "within a family, seconds across them."
        )
    if missed:
        lines.append(f"- Not reached within the cap: {', '.join(missed)}.")
    lines.append(
        "- One run per recipe, one seed: the iteration at which a noisy running mean crosses the target moves by "
        "a few iterations from seed to seed, so small differences in this table are not significant."
    )
    lines += remeasured_reading(result)
    return "\n".join(lines) + "\n"
