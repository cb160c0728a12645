"""One tiny recipe: build its trainer, drive train_iteration() under the probes, summarise the counts and times."""

from __future__ import annotations

import math
import statistics
import time
import warnings
from pathlib import Path
from typing import Any

from .closed_form import closed_form
from .probes import ModelCallProbe

ROOT = Path(__file__).resolve().parents[2]
RECIPES_DIR = ROOT / "configs" / "t2i" / "tiny"
RECIPES = (
    "flow_grpo",
    "flow_grpo_fast",
    "dance_grpo",
    "mixgrpo",
    "mixgrpo_flash",
    "branchgrpo",
    "branchgrpo_mix",
    "tempflow_grpo",
    "tp_grpo",
    "grpo_guard",
    "pref_grpo",
    "diffusion_nft",
    "vgpo",
    "adv_grpo",
    "awm",
    "sft_best_of_n",
    "diffusion_dpo_online",
    "diffusion_dpo_offline",
    "flow_dppo",
    "gardo",
    "gardo_nft",
    "draft_k",
    "draft_lv",
    "refl",
    "alignprop",
)


def quiet_overrides(out_dir: Path, threads: int, iterations: int) -> list[str]:
    return [
        f"output_dir={out_dir}",
        "progress=false",
        "artifacts.tensorboard=false",
        "artifacts.plot=false",
        "checkpoint.save_final_model=false",
        "eval.every=0",
        "monitor.enabled=false",  # held-out sampling, like eval: not part of a training iteration's cost
        f"num_threads={threads}",
        f"iterations={iterations}",
    ]


def quiet_warnings() -> None:
    import logging

    warnings.filterwarnings("ignore", message=".*Already found a `peft_config` attribute.*")
    warnings.filterwarnings("ignore", message=".*lr_scheduler.step\\(\\)` before `optimizer.step\\(\\)`.*")
    logging.getLogger("flowgrpo").setLevel(logging.WARNING)
    try:
        import diffusers
        import transformers

        diffusers.utils.logging.set_verbosity_error()
        transformers.logging.set_verbosity_error()
    except ImportError:
        pass


def _peak_rss_mb() -> float:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


RECORD_KEYS = (
    "nfe_nograd",
    "nfe_grad",
    "rollout_nfe_nograd",
    "backward_passes",
    "reward_calls",
    "images",
    "time_rollout_s",
    "time_reward_s",
    "time_reward_wait_s",
    "time_train_s",
    "time_iteration_s",
    "peak_memory_mb",
)


def drive(cfg, warmup: int, iterations: int, before_iteration=None) -> dict[str, Any]:
    """Build a T2ITrainer for `cfg`, hook it, run warmup + iterations train_iteration() calls."""
    import torch

    from flowgrpo.t2i import T2ITrainer

    threads = torch.get_num_threads()
    t_build = time.perf_counter()
    trainer = T2ITrainer(cfg)
    build_s = time.perf_counter() - t_build
    probe = ModelCallProbe(trainer.adapter, trainer.rewards.scorers).install()
    rows = []
    try:
        for k in range(warmup + iterations):
            it = trainer.iteration
            if before_iteration is not None:
                before_iteration()
            mark = len(probe.calls)
            cpu0, t0 = time.process_time(), time.perf_counter()
            record = trainer.train_iteration()
            t1, cpu1 = time.perf_counter(), time.process_time()
            expected = closed_form(cfg, it, record)  # the record: only for data-dependent counts (GARDO's gate)
            row = {
                "iteration": it + 1,
                "warmup": k < warmup,
                "wall_s": t1 - t0,
                "cpu_s": cpu1 - cpu0,
                **{key: record.get(key) for key in RECORD_KEYS},
                "edges_trained": record.get("edges/trained"),
                "plan_trained_steps": record.get("plan/trained_steps"),
                "model": probe.summary(mark, t0, t1),
                "closed_form": expected,
            }
            rows.append(row)
    finally:
        probe.remove()
        trainer.rewards.close()
        torch.set_num_threads(threads)
    return {"build_s": build_s, "iterations": rows, "trainer": trainer}


def _per_image(rows: list[dict], key: str, source=lambda r, k: r[k]) -> float:
    images = sum(r["images"] for r in rows)
    return sum(source(r, key) for r in rows) / images if images else math.nan


def counts_close(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or abs(a - b) <= 1e-9 * max(1.0, abs(a), abs(b))


def summarize(rows: list[dict]) -> dict[str, Any]:
    """Totals and means over the measured iterations."""
    n = len(rows)
    cf = lambda r, k: r["closed_form"][k]
    hook = lambda r, k: r["model"][k]
    mean = lambda xs: statistics.fmean(xs) if xs else math.nan
    per_image = {
        "fwd_nograd": _per_image(rows, "nfe_nograd"),
        "fwd_grad": _per_image(rows, "nfe_grad"),
        "rollout_fwd_nograd": _per_image(rows, "rollout_nfe_nograd"),
        "backward": _per_image(rows, "backward_passes"),
    }
    closed = {
        "fwd_nograd": _per_image(rows, "nfe_nograd", cf),
        "fwd_grad": _per_image(rows, "nfe_grad", cf),
        "rollout_fwd_nograd": _per_image(rows, "rollout_nfe_nograd", cf),
        "backward": _per_image(rows, "backward_passes", cf),
    }
    hooked = {
        "fwd_nograd": _per_image(rows, "fwd_nograd_rows", hook),
        "fwd_grad": _per_image(rows, "fwd_grad_rows", hook),
    }
    reward_calls = mean([r["reward_calls"] for r in rows])
    reward_calls_cf = mean([r["closed_form"]["reward_calls"] for r in rows])
    simple = all(r["closed_form"]["simple"] for r in rows)
    counts_match = (
        simple
        and all(counts_close(per_image[k], closed[k]) for k in closed)
        and counts_close(reward_calls, reward_calls_cf)
    )
    wall = [r["time_iteration_s"] for r in rows]
    phases = {k: mean([r[f"time_{k}_s"] for r in rows]) for k in ("rollout", "reward", "reward_wait", "train")}
    phases["other"] = mean(
        [r["time_iteration_s"] - r["time_rollout_s"] - r["time_reward_wait_s"] - r["time_train_s"] for r in rows]
    )
    model = {k: mean([r["model"][f"{k}_s"] for r in rows]) for k in ("fwd_nograd", "fwd_grad", "backward", "decode")}
    return {
        "measured_iterations": n,
        "images_per_iteration": mean([r["images"] for r in rows]),
        "per_image": per_image,
        "closed_form_per_image": closed,
        "hook_rows_per_image": hooked,
        "reward_calls_per_iteration": reward_calls,
        "closed_form_reward_calls_per_iteration": reward_calls_cf,
        "decoded_images_per_iteration": mean([r["model"]["decode_rows"] for r in rows]),
        "edges_trained_per_iteration": mean([r["edges_trained"] or 0 for r in rows]),
        "counts_match_closed_form": counts_match,
        "closed_form_simple": simple,
        "hook_rows_match_counters": all(counts_close(per_image[k], hooked[k]) for k in hooked),
        "seconds_per_iteration_median": statistics.median(wall) if wall else math.nan,
        "seconds_per_iteration_mean": mean(wall),
        "seconds_per_iteration_min": min(wall) if wall else math.nan,
        "seconds_per_iteration_max": max(wall) if wall else math.nan,
        "phases_mean_s": phases,
        "model_calls_mean_s": model,
        "share_outside_fwd_decode": mean([1 - r["model"]["union_fwd_decode_s"] / r["wall_s"] for r in rows]),
        "share_outside_model_calls": mean([1 - r["model"]["union_all_s"] / r["wall_s"] for r in rows]),
        "cpu_seconds_per_iteration": mean([r["cpu_s"] for r in rows]),
        "peak_memory_mb": max([r["peak_memory_mb"] for r in rows], default=math.nan),
    }


def bench_recipe(recipe: str, args) -> dict[str, Any]:
    from flowgrpo.t2i import load_t2i_config

    quiet_warnings()
    out = Path(args.out_dir) / recipe
    cfg = load_t2i_config(
        RECIPES_DIR / f"{recipe}.yaml", quiet_overrides(out, args.num_threads, args.warmup + args.iterations)
    )
    run = drive(cfg, args.warmup, args.iterations)
    rows = run["iterations"]
    measured = [r for r in rows if not r["warmup"]]
    return {
        "recipe": recipe,
        "method": cfg.method,
        "plan": cfg.plan.name,
        "plan_settings": cfg.plan.settings,
        "family": cfg.model.family,
        "num_steps": cfg.sampler.num_steps,
        "group_size": cfg.group_size,
        "prompts_per_iteration": cfg.prompts_per_iteration,
        "cfg_mode": cfg.sampler.cfg_mode,
        "formula_first_iteration": rows[0]["closed_form"]["formula"],
        "build_s": run["build_s"],
        "peak_rss_mb": _peak_rss_mb(),
        "iterations": rows,
        "summary": summarize(measured),
    }
