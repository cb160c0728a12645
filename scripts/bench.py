#!/usr/bin/env python
"""What each tiny text-to-image recipe costs: denoiser rows, backward passes, reward calls, time per phase.

    HF_HUB_OFFLINE=1 python scripts/bench.py                       # all 14 tiny recipes, 3 iterations after 1 warm-up
    HF_HUB_OFFLINE=1 python scripts/bench.py --recipes flow_grpo,branchgrpo --iterations 1 --warmup 0
    HF_HUB_OFFLINE=1 python scripts/bench.py --gpu                 # NOT YET RUN: SD3.5-M-sized random transformer, 512 px

Every recipe runs in its own Python process (peak memory is then the recipe's own; one recipe's state
cannot leak into the next), one after the other. Each builds a T2ITrainer from configs/t2i/tiny/<recipe>.yaml
with quiet overrides (no progress bar, tensorboard, plot, LoRA file, evaluation; output under a temp
folder; `--num-threads` torch threads) and drives it with trainer.train_iteration(). The trainer is not
changed: timing comes from hooks installed on this instance only (a forward pre/post hook on
adapter.denoiser, a wrapper around adapter.vae.decode, and a wrapper around torch.Tensor.backward).

Per recipe (warm-up iterations left out):
  counts   denoiser rows without / with grad per final image (the sampler's counters: rows through the
           network, CFG doubles them), backward passes per image, reward calls and decoded images per
           iteration; the same from the hooks (an independent count) and from the closed form of the plan
  time     s/iteration and the trainer's phase timers (rollout, reward on worker threads, reward wait,
           train); seconds inside denoiser forwards, backward passes and VAE decodes, and the share of
           the iteration outside them (the union of call intervals over all threads); CPU seconds
  memory   peak resident memory of the recipe's process (CPU) / torch.cuda.max_memory_allocated (GPU)

A second part builds the plans at BranchGRPO's published FLUX settings (20 steps, 16 images per prompt,
splits {0, 3, 6, 9}, window 4) on a tiny FLUX and counts one iteration, next to the published NFE table.

Writes --json (docs/bench_t2i.json) and the section "## Text-to-image recipes (tiny models, CPU)" of
--markdown (docs/benchmarks.md, created with "# Benchmarks" if missing; other sections are kept).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import platform
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

RECIPES_DIR = ROOT / "configs" / "t2i" / "tiny"
RECIPES = ("flow_grpo", "flow_grpo_fast", "dance_grpo", "mixgrpo", "mixgrpo_flash", "branchgrpo", "branchgrpo_mix",
           "tempflow_grpo", "tp_grpo", "grpo_guard", "pref_grpo", "diffusion_nft", "vgpo", "adv_grpo")
SECTION = "## Text-to-image recipes (tiny models, CPU)"
GPU_SECTION = "## Text-to-image on GPU (SD3.5-M-sized transformer, random weights)"

# BranchGRPO's README table (FLUX.1-dev, 20 steps, 16 images per prompt, splits {0,3,6,9}): NFE per image
# of pi_old (no grad) and pi_theta (grad). Our runs: the same plans on a tiny FLUX (counts do not depend
# on model size), no CFG (FLUX-dev's guidance is an embedding), one prompt of 16 images.
PUBLISHED_COMMON = ["model.family=flux", "sampler.num_steps=20", "group_size=16", "prompts_per_iteration=1",
                    "rollout_prompts=1", "sampler.cfg_mode=none", "sampler.sde_kernel={name: dance_sde, eta: 0.3}"]
TREE_20 = "{name: tree, split_steps: [0, 3, 6, 9], branch: 2%s}"
PUBLISHED = {
    "dance_grpo": dict(label="DanceGRPO", recipe="dance_grpo", published=(20, 20),
                       settings="full_sde, all 20 steps trained",
                       overrides=["plan={name: full_sde, train_fraction: 1.0}"]),
    "mixgrpo": dict(label="MixGRPO (20, 5)", recipe="dance_grpo", published=(20, 5),
                    settings="window of 4 SDE steps (progressive), ODE elsewhere",
                    overrides=["plan={name: window, size: 4, schedule: progressive, share_prefix: false}"]),
    "branchgrpo": dict(label="BranchGRPO", recipe="branchgrpo", published=(13.68, 13.68),
                       settings="tree, splits {0,3,6,9}, branch 2, every step SDE and trained",
                       overrides=["plan=" + TREE_20 % "", "edges.width_pruning=null"]),
    "branchgrpo_width": dict(label="BranchGRPO width-pruned", recipe="branchgrpo", published=(13.68, 8.625),
                             settings="the tree + width pruning 0.5 (mode 1)",
                             overrides=["plan=" + TREE_20 % "", "edges.width_pruning=0.5"]),
    "branchgrpo_mix": dict(label="BranchGRPO-Mix", recipe="branchgrpo", published=(13.68, 4.25),
                           settings="the tree, SDE only at splits and in a progressive window of 4",
                           overrides=["plan=" + TREE_20 % ", mix_window: 4", "edges.width_pruning=null"]),
}


# --- timing hooks ----------------------------------------------------------------------------------

def _rows(args: tuple, kwargs: dict) -> int:
    for value in (*args, kwargs.get("hidden_states"), kwargs.get("sample")):
        if hasattr(value, "shape") and len(value.shape) > 0:
            return int(value.shape[0])
    return 0


class ModelCallProbe:
    """Times and counts every denoiser forward, VAE decode and autograd backward of one adapter.

    Denoiser: a forward pre-hook / post-hook pair on adapter.denoiser (rows = the batch of its first
    tensor input; grad or not from torch.is_grad_enabled()). VAE: adapter.vae.decode wrapped on the
    instance (it runs on the reward worker threads). Backward: torch.Tensor.backward wrapped while
    installed (every .backward() of the process: the policy's and, in Adv-GRPO, the discriminator's).
    """

    def __init__(self, adapter):
        self.adapter = adapter
        self.calls: list[tuple[str, float, float, int]] = []   # (kind, start, end, rows)
        self._open: list[tuple[float, int, bool]] = []
        self._lock = threading.Lock()
        self._undo: list = []

    def install(self) -> ModelCallProbe:
        import torch

        den = self.adapter.denoiser

        def pre(module, args, kwargs):
            self._open.append((time.perf_counter(), _rows(args, kwargs), torch.is_grad_enabled()))

        def post(module, args, output):
            if self._open:
                t0, rows, grad = self._open.pop()
                self._add("fwd_grad" if grad else "fwd_nograd", t0, rows)

        handles = [den.register_forward_pre_hook(pre, with_kwargs=True),
                   den.register_forward_hook(post, always_call=True)]
        self._undo.append(lambda: [h.remove() for h in handles])

        vae = self.adapter.vae
        decode = vae.decode

        def timed_decode(z, *args, **kwargs):
            t0 = time.perf_counter()
            try:
                return decode(z, *args, **kwargs)
            finally:
                self._add("decode", t0, int(z.shape[0]))

        vae.decode = timed_decode
        self._undo.append(lambda: vars(vae).pop("decode", None))

        backward = torch.Tensor.backward

        def timed_backward(tensor, *args, **kwargs):
            t0 = time.perf_counter()
            try:
                return backward(tensor, *args, **kwargs)
            finally:
                self._add("backward", t0, 1)

        torch.Tensor.backward = timed_backward
        self._undo.append(lambda: setattr(torch.Tensor, "backward", backward))
        return self

    def remove(self) -> None:
        while self._undo:
            self._undo.pop()()

    def _add(self, kind: str, t0: float, rows: int) -> None:
        with self._lock:
            self.calls.append((kind, t0, time.perf_counter(), rows))

    def summary(self, mark: int, t0: float, t1: float) -> dict[str, float]:
        """Calls since `mark`, inside the wall-clock window [t0, t1]."""
        with self._lock:
            calls = self.calls[mark:]
        out: dict[str, float] = {}
        for kind in ("fwd_nograd", "fwd_grad", "backward", "decode"):
            mine = [c for c in calls if c[0] == kind]
            out[f"{kind}_s"] = sum(c[2] - c[1] for c in mine)
            out[f"{kind}_calls"] = len(mine)
            out[f"{kind}_rows"] = sum(c[3] for c in mine)
        out["union_fwd_decode_s"] = _union([c[1:3] for c in calls if c[0] != "backward"], t0, t1)
        out["union_all_s"] = _union([c[1:3] for c in calls], t0, t1)
        return out


def _union(intervals: list, lo: float, hi: float) -> float:
    """Length of the union of [start, end] intervals clipped to [lo, hi] (calls overlap across threads)."""
    total, end = 0.0, lo
    for a, b in sorted((max(a, lo), min(b, hi)) for a, b in intervals):
        if b <= max(a, end):
            continue
        total += b - max(a, end)
        end = b
    return total


# --- closed form -----------------------------------------------------------------------------------

def _chunk_sizes(n: int, chunks: int) -> list[int]:
    """Sizes of torch.arange(n).chunk(chunks)."""
    if n == 0:
        return []
    size = math.ceil(n / chunks)
    return [min(size, n - s) for s in range(0, n, size)]


def closed_form(cfg, iteration: int) -> dict[str, Any]:
    """Rows through the denoiser, backward passes, reward calls and images of one iteration, from the plan.

    W_d = nodes at depth d of one root's tree (W_0 = 1, W_{i+1} = W_i * branch_i); L = leaves per root;
    c = 2 rows per state under CFG (sampling: cfg_mode, training: train_cfg_mode), else 1.
      chain (full_sde, window, ode_only): T no-grad per image; K grad (K trained steps)
      tree:          sum_{d<T} W_d / L no-grad (children of a split share their parent's forward);
                     trained edges per leaf sum_{i trained} W_{i+1} / L grad (minus pruned edges)
      branch_points: T + k * sum_p (T - 1 - p) no-grad (spine + each side child ODE-completed); k * |points| grad
      probes:        T + sum_{d in probes} (T - d) no-grad (one-step probes: T); |window| grad
      nft:           + n_t old-policy rows no-grad and n_t grad per image, n_t = max(1, floor(T * timestep_fraction))
    Edges with advantage exactly 0 are dropped by the trainer; this count assumes there are none.
    """
    from pipelines.plans import build_plan

    plan = build_plan(cfg.plan.name, cfg.sampler.num_steps, iteration, cfg.seed, **cfg.plan.settings)
    s, T = cfg.sampler, plan.num_steps
    P, G = cfg.prompts_per_iteration, cfg.group_size
    c_roll = 1 if s.cfg_mode == "none" else 2
    c_train = 1 if s.cfg_mode == "none" or s.train_cfg_mode == "none" else 2
    L = plan.leaves_per_root
    roots = G // L
    W = [1]
    for st in plan.steps:
        W.append(W[-1] * st.branch)
    trained_steps = [i for i, st in enumerate(plan.steps) if st.trained]
    simple = True

    if plan.name == "tree":
        per_root = sum(W[:T])
        edges_per_root = sum(W[i + 1] for i in trained_steps)
        formula = (f"no-grad sum_(d<T) W_d / L = {per_root}/{L}; grad trained edges per leaf "
                   f"sum_(i trained) W_(i+1) / L = {edges_per_root}/{L}")
    elif plan.name == "branch_points":
        per_root = T + sum(st.side_branches * (T - 1 - i) for i, st in enumerate(plan.steps))
        edges_per_root = sum(plan.steps[i].side_branches for i in trained_steps)
        points = [i for i, st in enumerate(plan.steps) if st.side_branches]
        k = max((st.side_branches for st in plan.steps), default=0)
        formula = f"no-grad T + k * sum_p (T-1-p) = {T} + {k}*{sum(T - 1 - p for p in points)}; grad k*|points| = {edges_per_root}"
    elif plan.name == "probes":
        probe_rows = 0 if plan.one_step_probes else sum(T - d for d in plan.probe_depths)
        per_root = T + probe_rows
        edges_per_root = len(trained_steps)
        formula = (f"no-grad T + sum_d (T-d) = {T} + {probe_rows}" if not plan.one_step_probes else
                   f"no-grad T = {T} (one-step probes reuse the step's output)") + f"; grad |window| = {edges_per_root}"
    else:  # a chain: full_sde, window, ode_only
        per_root = T
        edges_per_root = len(trained_steps)
        formula = f"no-grad T = {T}; grad trained steps = {edges_per_root}"

    per_prompt = roots * per_root
    first = plan.first_stochastic_step
    if plan.shared_prefix and s.share_noise and roots > 1 and first is not None and plan.steps[first].sde:
        # steps 0..first run once per prompt, then the group fans out (a split at the first SDE step)
        per_prompt = (first + 1) + roots * (T - first - 1) if L == 1 else None
        formula += f"; shared prefix: steps 0..{first} once per prompt"
        simple = per_prompt is not None
    nograd = c_roll * P * per_prompt if per_prompt is not None else math.nan

    edges = P * roots * edges_per_root
    e = cfg.edges
    pruned = None
    if plan.name == "tree" and (e.depth_pruning or e.width_pruning):
        pruned = _pruned_edges(cfg, plan, W, iteration)
        if pruned is None:
            simple = False
        else:
            edges -= P * roots * pruned
            formula += f" minus {pruned}/{L} pruned"
            if e.width_pruning and not e.depth_pruning:
                n = T - 1 - max(i for i, st in enumerate(plan.steps) if st.branch > 1)
                formula += (f" (width pruning keeps ceil({e.width_pruning:g} x {n}) = {math.ceil(n * e.width_pruning)} "
                            f"of the {n} last-layer edges of each leaf chain)")

    images = P * G
    grad, backward, policy_update = 0.0, 0, True
    epochs, minis, micro = cfg.train.inner_epochs, cfg.train.mini_batches, cfg.train.micro_batch_size
    if cfg.adversarial.enabled and (iteration + 1) % cfg.adversarial.d_times != 0:
        policy_update = False  # a discriminator iteration: the policy does not train
        formula += "; discriminator iteration: no policy update"
    elif cfg.method == "nft":
        n_t = max(1, int(T * cfg.nft.timestep_fraction))
        grad = n_t * epochs * images
        nograd += grad * (2 if cfg.nft.kl_coef else 1)
        backward = epochs * sum(math.ceil(m / micro) for m in _chunk_sizes(images, minis)) * n_t
        formula += f"; NFT n_t = {n_t}: + {n_t} old-policy no-grad, {n_t} grad per image"
    else:
        grad = c_train * edges * epochs
        if cfg.loss.kl.coef:
            nograd += grad  # the reference re-scores every trained edge
        backward = epochs * sum(math.ceil(m / micro) for m in _chunk_sizes(edges, minis))
    return {"plan": plan.name, "images": images, "nfe_nograd": nograd, "nfe_grad": grad,
            "rollout_nfe_nograd": c_roll * P * per_prompt if per_prompt is not None else math.nan,
            "backward_passes": backward, "reward_calls": (P // cfg.rollout_prompts) * len(cfg.rewards),
            "edges_trained": edges if policy_update and cfg.method != "nft" else 0,
            "simple": simple, "formula": formula, "pruned_edges_per_root": pruned}


def _pruned_edges(cfg, plan, W: list[int], iteration: int) -> int | None:
    """BranchGRPO pruning, per root; None where the closed form is not simple (both kinds at once,
    width pruning over untrained last-layer steps, mode 2 across roots)."""
    e = cfg.edges
    trained = {i for i, st in enumerate(plan.steps) if st.trained}
    if e.depth_pruning and e.width_pruning:
        return None
    if e.depth_pruning:
        shift = 0
        if e.depth_pruning_slide_every:
            shift = max(min(iteration // e.depth_pruning_slide_every, min(e.depth_pruning)), 0)
        return sum(W[d] for d in {d - shift for d in e.depth_pruning} if 1 <= d <= plan.num_steps and d - 1 in trained)
    split = max((i for i, st in enumerate(plan.steps) if st.branch > 1), default=-1)
    after = list(range(split + 1, plan.num_steps))
    if split < 0 or any(i not in trained for i in after) or e.width_pruning_mode != 1:
        return None
    n = len(after)  # last-layer edges of one leaf chain; the top ceil(n * ratio) by advantage are kept
    return W[-1] * (n - math.ceil(n * e.width_pruning))


# --- one recipe ------------------------------------------------------------------------------------

def quiet_overrides(out_dir: Path, threads: int, iterations: int) -> list[str]:
    return [f"output_dir={out_dir}", "progress=false", "artifacts.tensorboard=false", "artifacts.plot=false",
            "artifacts.save_lora=false", "eval.every=0", f"num_threads={threads}", f"iterations={iterations}"]


def _quiet_warnings() -> None:
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


RECORD_KEYS = ("nfe_nograd", "nfe_grad", "rollout_nfe_nograd", "backward_passes", "reward_calls", "images",
               "time_rollout_s", "time_reward_s", "time_reward_wait_s", "time_train_s", "time_iteration_s",
               "peak_memory_mb")


def drive(cfg, warmup: int, iterations: int, before_iteration=None) -> dict[str, Any]:
    """Build a T2ITrainer for `cfg`, hook it, run warmup + iterations train_iteration() calls."""
    import torch

    from flowgrpo.t2i import T2ITrainer

    threads = torch.get_num_threads()
    t_build = time.perf_counter()
    trainer = T2ITrainer(cfg)
    build_s = time.perf_counter() - t_build
    probe = ModelCallProbe(trainer.adapter).install()
    rows = []
    try:
        for k in range(warmup + iterations):
            it = trainer.iteration
            expected = closed_form(cfg, it)
            if before_iteration is not None:
                before_iteration()
            mark = len(probe.calls)
            cpu0, t0 = time.process_time(), time.perf_counter()
            record = trainer.train_iteration()
            t1, cpu1 = time.perf_counter(), time.process_time()
            row = {"iteration": it + 1, "warmup": k < warmup, "wall_s": t1 - t0, "cpu_s": cpu1 - cpu0,
                   **{key: record.get(key) for key in RECORD_KEYS},
                   "edges_trained": record.get("edges/trained"), "plan_trained_steps": record.get("plan/trained_steps"),
                   "model": probe.summary(mark, t0, t1), "closed_form": expected}
            rows.append(row)
    finally:
        probe.remove()
        trainer.rewards.close()
        torch.set_num_threads(threads)
    return {"build_s": build_s, "iterations": rows, "trainer": trainer}


def _per_image(rows: list[dict], key: str, source=lambda r, k: r[k]) -> float:
    images = sum(r["images"] for r in rows)
    return sum(source(r, key) for r in rows) / images if images else math.nan


def _close(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or abs(a - b) <= 1e-9 * max(1.0, abs(a), abs(b))


def summarize(rows: list[dict]) -> dict[str, Any]:
    """Totals and means over the measured iterations."""
    n = len(rows)
    cf = lambda r, k: r["closed_form"][k]
    hook = lambda r, k: r["model"][k]
    mean = lambda xs: statistics.fmean(xs) if xs else math.nan
    per_image = {"fwd_nograd": _per_image(rows, "nfe_nograd"), "fwd_grad": _per_image(rows, "nfe_grad"),
                 "rollout_fwd_nograd": _per_image(rows, "rollout_nfe_nograd"),
                 "backward": _per_image(rows, "backward_passes")}
    closed = {"fwd_nograd": _per_image(rows, "nfe_nograd", cf), "fwd_grad": _per_image(rows, "nfe_grad", cf),
              "rollout_fwd_nograd": _per_image(rows, "rollout_nfe_nograd", cf),
              "backward": _per_image(rows, "backward_passes", cf)}
    hooked = {"fwd_nograd": _per_image(rows, "fwd_nograd_rows", hook), "fwd_grad": _per_image(rows, "fwd_grad_rows", hook)}
    reward_calls = mean([r["reward_calls"] for r in rows])
    reward_calls_cf = mean([r["closed_form"]["reward_calls"] for r in rows])
    simple = all(r["closed_form"]["simple"] for r in rows)
    counts_match = simple and all(_close(per_image[k], closed[k]) for k in closed) and _close(reward_calls, reward_calls_cf)
    wall = [r["time_iteration_s"] for r in rows]
    phases = {k: mean([r[f"time_{k}_s"] for r in rows]) for k in ("rollout", "reward", "reward_wait", "train")}
    phases["other"] = mean([r["time_iteration_s"] - r["time_rollout_s"] - r["time_reward_wait_s"] - r["time_train_s"]
                            for r in rows])
    model = {k: mean([r["model"][f"{k}_s"] for r in rows]) for k in ("fwd_nograd", "fwd_grad", "backward", "decode")}
    return {
        "measured_iterations": n,
        "images_per_iteration": mean([r["images"] for r in rows]),
        "per_image": per_image, "closed_form_per_image": closed, "hook_rows_per_image": hooked,
        "reward_calls_per_iteration": reward_calls, "closed_form_reward_calls_per_iteration": reward_calls_cf,
        "decoded_images_per_iteration": mean([r["model"]["decode_rows"] for r in rows]),
        "edges_trained_per_iteration": mean([r["edges_trained"] or 0 for r in rows]),
        "counts_match_closed_form": counts_match, "closed_form_simple": simple,
        "hook_rows_match_counters": all(_close(per_image[k], hooked[k]) for k in hooked),
        "seconds_per_iteration_median": statistics.median(wall) if wall else math.nan,
        "seconds_per_iteration_mean": mean(wall),
        "seconds_per_iteration_min": min(wall) if wall else math.nan,
        "seconds_per_iteration_max": max(wall) if wall else math.nan,
        "phases_mean_s": phases, "model_calls_mean_s": model,
        "share_outside_fwd_decode": mean([1 - r["model"]["union_fwd_decode_s"] / r["wall_s"] for r in rows]),
        "share_outside_model_calls": mean([1 - r["model"]["union_all_s"] / r["wall_s"] for r in rows]),
        "cpu_seconds_per_iteration": mean([r["cpu_s"] for r in rows]),
        "peak_memory_mb": max([r["peak_memory_mb"] for r in rows], default=math.nan),
    }


def bench_recipe(recipe: str, args) -> dict[str, Any]:
    from flowgrpo.t2i import load_t2i_config

    _quiet_warnings()
    out = Path(args.out_dir) / recipe
    cfg = load_t2i_config(RECIPES_DIR / f"{recipe}.yaml",
                          quiet_overrides(out, args.num_threads, args.warmup + args.iterations))
    run = drive(cfg, args.warmup, args.iterations)
    rows = run["iterations"]
    measured = [r for r in rows if not r["warmup"]]
    return {"recipe": recipe, "method": cfg.method, "plan": cfg.plan.name, "plan_settings": cfg.plan.settings,
            "family": cfg.model.family, "num_steps": cfg.sampler.num_steps, "group_size": cfg.group_size,
            "prompts_per_iteration": cfg.prompts_per_iteration, "cfg_mode": cfg.sampler.cfg_mode,
            "formula_first_iteration": rows[0]["closed_form"]["formula"], "build_s": run["build_s"],
            "peak_rss_mb": _peak_rss_mb(), "iterations": rows, "summary": summarize(measured)}


def _cycle(cfg) -> int:
    """Iterations in one full sweep of a progressive window (1 for plans that do not move)."""
    st = cfg.plan.settings
    T = cfg.sampler.num_steps
    if cfg.plan.name == "tree" and st.get("mix_window"):
        return len(range(0, T - st["mix_window"] + 1, st.get("mix_stride", 1))) * st.get("mix_iters_per_shift", 25)
    if cfg.plan.name == "window" and st.get("schedule", "random") == "progressive":
        end = st.get("range_end") or T
        positions = len(range(st.get("start", 0), end - st.get("size", 3) + 1, st.get("stride", 1)))
        return positions * st.get("iters_per_shift", 25)
    return 1


def bench_published(keys: list[str], args) -> dict[str, Any]:
    from flowgrpo.t2i import load_t2i_config

    _quiet_warnings()
    out: dict[str, Any] = {}
    for key in keys:
        spec = PUBLISHED[key]
        overrides = PUBLISHED_COMMON + spec["overrides"]
        cfg = load_t2i_config(RECIPES_DIR / f"{spec['recipe']}.yaml",
                              quiet_overrides(Path(args.out_dir) / f"published_{key}", args.num_threads, 1) + overrides)
        rows = drive(cfg, 0, 1)["iterations"]
        s = summarize(rows)
        n = _cycle(cfg)
        sweep = [closed_form(cfg, it) for it in range(n)]
        images = sum(c["images"] for c in sweep)
        out[key] = {
            "label": spec["label"], "settings": spec["settings"], "recipe": spec["recipe"],
            "overrides": overrides, "published_per_image": list(spec["published"]),
            "per_image": s["per_image"], "closed_form_per_image": s["closed_form_per_image"],
            "counts_match_closed_form": s["counts_match_closed_form"],
            "hook_rows_match_counters": s["hook_rows_match_counters"],
            "edges_per_image": rows[0]["edges_trained"] / rows[0]["images"],
            "formula": rows[0]["closed_form"]["formula"],
            "sweep_iterations": n,
            "sweep_per_image": {"fwd_nograd": sum(c["nfe_nograd"] for c in sweep) / images,
                                "fwd_grad": sum(c["nfe_grad"] for c in sweep) / images},
        }
        print(f"  published setting {key}: {s['per_image']['fwd_nograd']:.3f} / {s['per_image']['fwd_grad']:.3f} "
              f"per image (published {spec['published'][0]} / {spec['published'][1]})", file=sys.stderr, flush=True)
    return out


# --- GPU mode (NOT YET RUN on a GPU) ----------------------------------------------------------------

def _register_sd35m_random() -> str:
    """An SD3 adapter whose 'tiny' pipeline is SD3.5-Medium-sized (random weights): the MMDiT of 24 layers,
    24 heads x 64, dual attention in layers 0-12, qk RMS-norm; the SD3 VAE's shape. Text encoders stay
    tiny (CLIP pooled 2 x 1024 and T5 width 4096 to match the transformer's inputs)."""
    from pipelines import adapters
    from pipelines.adapters import tiny_parts
    from pipelines.adapters.sd3 import SD3Adapter

    class SD35MediumRandom(SD3Adapter):
        family = "sd35m_random"

        @classmethod
        def _tiny_pipeline(cls, layers: int = 24, **_: Any) -> Any:
            from diffusers import (
                AutoencoderKL,
                FlowMatchEulerDiscreteScheduler,
                SD3Transformer2DModel,
                StableDiffusion3Pipeline,
            )

            transformer = SD3Transformer2DModel(
                sample_size=128, patch_size=2, in_channels=16, out_channels=16, num_layers=layers,
                attention_head_dim=64, num_attention_heads=24, joint_attention_dim=4096, caption_projection_dim=1536,
                pooled_projection_dim=2048, pos_embed_max_size=384, qk_norm="rms_norm",
                dual_attention_layers=tuple(range(min(13, layers))))
            vae = AutoencoderKL(
                in_channels=3, out_channels=3, latent_channels=16, down_block_types=("DownEncoderBlock2D",) * 4,
                up_block_types=("UpDecoderBlock2D",) * 4, block_out_channels=(128, 256, 512, 512), layers_per_block=2,
                norm_num_groups=32, sample_size=1024, scaling_factor=1.5305, shift_factor=0.0609,
                use_quant_conv=False, use_post_quant_conv=False)
            return StableDiffusion3Pipeline(
                transformer=transformer, scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0), vae=vae,
                text_encoder=tiny_parts.clip_text_model(True, projection=1024), tokenizer=tiny_parts.clip_tokenizer(),
                text_encoder_2=tiny_parts.clip_text_model(True, projection=1024), tokenizer_2=tiny_parts.clip_tokenizer(),
                text_encoder_3=tiny_parts.t5_encoder(4096), tokenizer_3=tiny_parts.t5_tokenizer())

    adapters.ADAPTERS[SD35MediumRandom.family] = SD35MediumRandom
    return SD35MediumRandom.family


PEAK_BF16_TFLOPS = (("H100 PCIe", 756.0), ("H100", 989.4), ("H200", 989.4), ("H800", 989.4), ("A100", 312.0))


def bench_gpu(args) -> dict[str, Any]:
    """Flow-GRPO on an SD3.5-M-sized random transformer at 512 px: rollout images/s, s/iteration, peak
    memory, MFU (denoiser FLOPs counted by torch's FlopCounterMode on one row; a grad row counts 2x a
    forward under LoRA: activation gradients, no base-weight gradients; 3x under full fine-tuning)."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from flowgrpo.t2i import load_t2i_config

    _quiet_warnings()
    family = _register_sd35m_random()
    res = args.gpu_resolution
    overrides = quiet_overrides(Path(args.out_dir) / "gpu", args.num_threads, args.warmup + args.iterations) + [
        f"model.family={family}", f"model.device={args.gpu_device}", f"model.dtype={args.gpu_dtype}",
        f"model.tiny_options={{layers: {args.gpu_layers}, max_sequence_length: 256}}",
        "model.lora={rank: 32, alpha: 64}", f"sampler.height={res}", f"sampler.width={res}",
        f"sampler.num_steps={args.gpu_steps}", "sampler.guidance_scale=4.5", "sampler.cfg_mode=full",
        f"group_size={args.gpu_group}", f"prompts_per_iteration={args.gpu_prompts}", "rollout_prompts=1",
        f"train.micro_batch_size={args.gpu_micro}", "optim.lr=1e-4"]
    cfg = load_t2i_config(RECIPES_DIR / "flow_grpo.yaml", overrides)
    cuda = cfg.model.device.startswith("cuda")

    def reset_peak():
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()

    run = drive(cfg, args.warmup, args.iterations, before_iteration=reset_peak)
    trainer = run["trainer"]
    adapter = trainer.adapter
    x = torch.randn(1, *adapter.latent_shape(res, res), device=adapter.device)
    embeds = adapter.encode_prompts([cfg.data.prompts[0]])  # outside the counter: text encoders are not counted
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        adapter.model_output(x, torch.tensor([0.5]), embeds, 4.5, "none")
    flops_row = counter.get_total_flops()  # on CPU, SDPA attention is not counted (CUDA kernels are)
    name = torch.cuda.get_device_name(0) if cuda else platform.processor()
    peak = args.peak_tflops or next((v for k, v in PEAK_BF16_TFLOPS if k in name), None)
    grad_factor = 2 if cfg.model.finetune == "lora" else 3
    rows = []
    for r in run["iterations"]:
        flops = flops_row * (r["nfe_nograd"] + grad_factor * r["nfe_grad"])
        roll = flops_row * r["rollout_nfe_nograd"]
        rows.append({**r, "denoiser_tflop": flops / 1e12,
                     "rollout_images_per_s": r["images"] / r["time_rollout_s"],
                     "mfu": flops / (r["time_iteration_s"] * peak * 1e12) if peak else None,
                     "rollout_mfu": roll / (r["time_rollout_s"] * peak * 1e12) if peak else None})
    measured = [r for r in rows if not r["warmup"]]
    mean = lambda k: statistics.fmean(r[k] for r in measured) if measured and measured[0][k] is not None else None
    params = sum(p.numel() for p in adapter.denoiser.parameters())
    return {"device": name, "peak_bf16_tflops": peak, "denoiser_params": params, "gflop_per_denoiser_row": flops_row / 1e9,
            "settings": {"resolution": res, "steps": cfg.sampler.num_steps, "group_size": cfg.group_size,
                         "prompts_per_iteration": cfg.prompts_per_iteration, "cfg": "full (2 rows per state)",
                         "dtype": cfg.model.dtype, "lora_rank": cfg.model.lora.rank, "layers": args.gpu_layers,
                         "micro_batch_size": cfg.train.micro_batch_size},
            "overrides": overrides, "iterations": rows,
            "summary": {"seconds_per_iteration_mean": mean("time_iteration_s"), "rollout_images_per_s": mean("rollout_images_per_s"),
                        "peak_memory_mb": max((r["peak_memory_mb"] for r in measured), default=None),
                        "mfu": mean("mfu"), "rollout_mfu": mean("rollout_mfu"),
                        "phases_mean_s": summarize(measured)["phases_mean_s"] if measured else None}}


def gpu_markdown(result: dict) -> str:
    g, s = result["gpu"], result["gpu"]["summary"]
    fmt = lambda v, f: "-" if v is None else format(v, f)
    return "\n".join([
        GPU_SECTION, "", f"`{result['command']}`", "",
        f"- date (UTC): {result['date']}; device: {g['device']}; versions: "
        + ", ".join(f"{k} {v}" for k, v in result["versions"].items() if v),
        f"- Flow-GRPO, denoiser {g['denoiser_params'] / 1e9:.2f} B parameters (random), {g['gflop_per_denoiser_row']:.0f} "
        f"GFLOP per row; settings: {json.dumps(g['settings'])}",
        "- not the real model: random weights, tiny text encoders (272 text tokens: CLIP 16 + T5 256, SD3.5-M has "
        "333), brightness as the reward; MFU counts denoiser FLOPs only (FlopCounterMode on one row; a grad row = "
        "2 forwards under LoRA), over the trainer's iteration time", "",
        "| rollout images/s | s/iteration | peak memory (MB) | MFU (iteration) | MFU (rollout) |", "|---|---|---|---|---|",
        f"| {fmt(s['rollout_images_per_s'], '.2f')} | {fmt(s['seconds_per_iteration_mean'], '.2f')} | "
        f"{fmt(s['peak_memory_mb'], '.0f')} | {fmt(s['mfu'], '.1%')} | {fmt(s['rollout_mfu'], '.1%')} |", ""])


# --- report ----------------------------------------------------------------------------------------

def machine(threads: int) -> dict[str, Any]:
    cpu = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": cpu, "logical_cpus": os.cpu_count(), "torch_threads": threads, "platform": platform.platform(),
            "python": platform.python_version(), "gpu": None}


def versions() -> dict[str, str | None]:
    from importlib.metadata import PackageNotFoundError, version

    out: dict[str, str | None] = {}
    for pkg in ("flowgrpo", "torch", "diffusers", "transformers", "peft"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = None
    return out


def git_state() -> dict[str, Any]:
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=False).stdout.strip()
        dirty = bool(subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, capture_output=True, text=True, check=False).stdout.strip())
        return {"commit": head or None, "dirty": dirty}
    except OSError:
        return {"commit": None, "dirty": None}


def _n(x: float, digits: int = 2) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return f"{x:.{digits}f}".rstrip("0").rstrip(".") if abs(x - round(x)) > 1e-9 else str(round(x))


def reading(result: dict) -> list[str]:
    """A few plain statements computed from the numbers (so a re-run keeps them true)."""
    recipes = {k: v["summary"] for k, v in result["recipes"].items() if "summary" in v}
    out = []
    if not recipes:
        return out
    bad = [k for k, s in recipes.items() if not s["counts_match_closed_form"]]
    hooks_bad = [k for k, s in recipes.items() if not s["hook_rows_match_counters"]]
    out.append(f"- Counts: {len(recipes) - len(bad)} of {len(recipes)} recipes match the closed form exactly"
               + (f"; not: {', '.join(bad)} (see the JSON: an edge with advantage exactly 0 is dropped by the "
                  "trainer, and some pruning combinations have no simple closed form)" if bad else "")
               + ". The hook counts (rows entering adapter.denoiser) equal the sampler's counters"
               + (f" except in {', '.join(hooks_bad)}." if hooks_bad else " in every recipe."))
    most = max(recipes, key=lambda k: recipes[k]["per_image"]["fwd_nograd"])
    least = min(recipes, key=lambda k: recipes[k]["per_image"]["fwd_nograd"])
    line = (f"- No-grad forwards per final image range from {_n(recipes[least]['per_image']['fwd_nograd'])} "
            f"({least}) to {_n(recipes[most]['per_image']['fwd_nograd'])} ({most})")
    if result["recipes"][most]["plan"] in ("branch_points", "probes"):
        line += ("; the side branches and probe completions of the process-reward methods are paid in rollout "
                 "forwards (and in scored images), not in gradient rows")
    out.append(line + ".")
    fast = min(recipes, key=lambda k: recipes[k]["seconds_per_iteration_median"])
    slow = max(recipes, key=lambda k: recipes[k]["seconds_per_iteration_median"])
    out.append(f"- Time per iteration (median): {_n(recipes[fast]['seconds_per_iteration_median'], 3)} s ({fast}) to "
               f"{_n(recipes[slow]['seconds_per_iteration_median'], 3)} s ({slow}). These are tiny random models on "
               f"{result['machine']['logical_cpus']} shared CPU cores (load average {result['load_before'][0]} before, "
               f"{result['load_after'][0]} after): the counts are exact, the seconds are indicative only.")
    roll = {k: s["phases_mean_s"]["rollout"] / s["seconds_per_iteration_mean"] for k, s in recipes.items()}
    train = {k: s["phases_mean_s"]["train"] / s["seconds_per_iteration_mean"] for k, s in recipes.items()}
    r_hi, t_hi = max(roll, key=roll.get), max(train, key=train.get)
    out.append(f"- Phases: the rollout takes {min(roll.values()):.0%} to {roll[r_hi]:.0%} of an iteration (most: {r_hi}), "
               f"the update {min(train.values()):.0%} to {train[t_hi]:.0%} (most: {t_hi}); scoring runs on worker "
               "threads during the rollout, and the main thread waits for it "
               f"{min(s['phases_mean_s']['reward_wait'] for s in recipes.values()) * 1e3:.0f}-"
               f"{max(s['phases_mean_s']['reward_wait'] for s in recipes.values()) * 1e3:.0f} ms per iteration.")
    outside = [s["share_outside_model_calls"] for s in recipes.values()]
    outside_fd = [s["share_outside_fwd_decode"] for s in recipes.values()]
    out.append(f"- Outside denoiser forwards and VAE decodes: {min(outside_fd):.0%} to {max(outside_fd):.0%} of the "
               f"iteration; outside forwards, decodes and backward passes: {min(outside):.0%} to {max(outside):.0%}. "
               "With models this small, Python work (sampler step maths, tree bookkeeping, optimizer, EMA, LoRA "
               "plumbing) is a large share; at real model sizes the model calls should dominate and these shares "
               "shrink (not measured: the GPU mode has not run).")
    ratios = {k: s["seconds_per_iteration_mean"] / s["cpu_seconds_per_iteration"] for k, s in recipes.items()
              if s["cpu_seconds_per_iteration"] > 0}
    if ratios:
        lo, hi = min(ratios, key=ratios.get), max(ratios, key=ratios.get)
        line = (f"- Wall seconds per iteration / the process's CPU seconds: {ratios[lo]:.2f} ({lo}) to {ratios[hi]:.2f} "
                f"({hi}), median {statistics.median(ratios.values()):.2f} (one torch thread plus the reward worker "
                "threads). Where it is well above 1 the process was waiting for the shared cores, and the load from "
                "other jobs changes during a run: wall seconds of two recipes are not comparable one to one, the CPU "
                "seconds column is the steadier comparison")
        if "flow_grpo" in recipes and "grpo_guard" in recipes:
            a, b = recipes["flow_grpo"], recipes["grpo_guard"]
            line += (f" (flow_grpo and grpo_guard do the same counted work: CPU {a['cpu_seconds_per_iteration']:.3f} vs "
                     f"{b['cpu_seconds_per_iteration']:.3f} s, wall {a['seconds_per_iteration_median']:.3f} vs "
                     f"{b['seconds_per_iteration_median']:.3f} s)")
        out.append(line + ".")
    for name, r in result["recipes"].items():
        first = (r.get("iterations") or [{}])[0].get("closed_form", {})
        if first.get("pruned_edges_per_root") == 0:
            why = re.search(r"\((width pruning keeps .*? leaf chain)\)", first["formula"])
            out.append(f"- {name}: pruning is configured but removes no edge at these settings"
                       + (f": {why.group(1)}." if why else "."))
    return out


def published_lines(pub: dict) -> list[str]:
    if not pub:
        return []
    lines = ["", "### Forward counts at BranchGRPO's published settings", "",
             "BranchGRPO's README table reports NFE per image of pi_old (no grad) / pi_theta (grad) for FLUX.1-dev "
             "with 20 steps and 16 images per prompt. Here the same plans run for one iteration on a tiny FLUX "
             "(no CFG, one prompt, 16 images; counts do not depend on model size). Common overrides: "
             f"`{' '.join(PUBLISHED_COMMON)}`.", "",
             "| method | plan | ours no-grad / img | ours grad / img | closed form | published no-grad / grad |",
             "|---|---|---|---|---|---|"]
    for p in pub.values():
        m, c = p["per_image"], p["closed_form_per_image"]
        sweep = ""
        if p["sweep_iterations"] > 1:
            sweep = (f"; mean over a full window sweep ({p['sweep_iterations']} iterations): "
                     f"{_n(p['sweep_per_image']['fwd_nograd'], 3)} / {_n(p['sweep_per_image']['fwd_grad'], 3)}")
        lines.append(f"| {p['label']} | {p['settings']} | {_n(m['fwd_nograd'], 3)} | {_n(m['fwd_grad'], 3)} | "
                     f"{_n(c['fwd_nograd'], 3)} / {_n(c['fwd_grad'], 3)}{' ✓' if p['counts_match_closed_form'] else ''}"
                     f"{sweep} | {_n(p['published_per_image'][0], 3)} / {_n(p['published_per_image'][1], 3)} |")
    lines += ["", "Reading:", ""]
    if "branchgrpo" in pub:
        b = pub["branchgrpo"]
        ng, gr, pub_g = b["per_image"]["fwd_nograd"], b["per_image"]["fwd_grad"], b["published_per_image"][1]
        lines.append(f"- BranchGRPO: we train {_n(gr, 4)} edges per leaf ({_n(gr * 16)} edges per tree / 16 leaves); "
                     f"the README's {_n(pub_g)} is {abs(pub_g / gr - 1):.1%} away from it (we found no count of this "
                     f"tree that gives exactly {_n(pub_g)}). Our rollout needs {_n(ng, 4)} no-grad forwards per leaf "
                     f"({_n(ng * 16)} per tree), fewer than one per edge: the two children of a split share their "
                     "parent's model output (only their noise differs), so a split costs one forward per parent.")
    if "branchgrpo_width" in pub:
        w = pub["branchgrpo_width"]
        got, want = w["per_image"]["fwd_grad"], w["published_per_image"][1]
        lines.append(f"- Width pruning (mode 1, keep half of the last-layer edges of each leaf chain): {_n(got, 4)} grad "
                     f"rows per image; published {_n(want, 4)}" + (" (equal)." if _close(got, want) else "."))
    if "branchgrpo_mix" in pub:
        x = pub["branchgrpo_mix"]
        avg, want = x["sweep_per_image"]["fwd_grad"], x["published_per_image"][1]
        lines.append(f"- BranchGRPO-Mix: which edges are trained depends on where the window is. At iteration 0 (window "
                     f"on steps 0-3) we train {_n(x['per_image']['fwd_grad'], 4)} edges per leaf; averaged over one full "
                     f"sweep of the window (every start position equally long) it is {_n(avg, 3)}, "
                     f"{abs(want / avg - 1):.1%} away from the published {_n(want)}. So the published figure matches a "
                     "mean over all window positions, not the count of one iteration; whether their training visited "
                     "every position equally (300 steps with a shift every 25 would reach only 12 of the 17) is "
                     "not known to us.")
    if "mixgrpo" in pub:
        x = pub["mixgrpo"]
        lines.append(f"- MixGRPO with a window of 4 trains {_n(x['per_image']['fwd_grad'])} steps per image; the table's "
                     "\"(20, 5)\" lists 5 grad forwards per image, which a window of 4 does not give (a window of 5 "
                     "would; we did not find which setting the table used).")
    if "dance_grpo" in pub:
        lines.append(f"- DanceGRPO with all 20 steps trained: {_n(pub['dance_grpo']['per_image']['fwd_nograd'])} / "
                     f"{_n(pub['dance_grpo']['per_image']['fwd_grad'])}, as published.")
    return lines


def markdown(result: dict) -> str:
    mach, ver, a = result["machine"], result["versions"], result["settings"]
    lines = [
        SECTION, "", f"`{result['command']}`", "",
        f"- date (UTC): {result['date']}; git {result['git']['commit']}{' (uncommitted changes)' if result['git']['dirty'] else ''}",
        f"- machine: {mach['cpu']}, {mach['logical_cpus']} logical CPUs shared with other jobs, torch threads "
        f"{a['num_threads']}; load average before / after: {result['load_before']} / {result['load_after']}",
        "- versions: " + ", ".join(f"{k} {v}" for k, v in ver.items() if v),
        f"- each recipe: configs/t2i/tiny/<recipe>.yaml in its own process, {a['warmup']} warm-up + "
        f"{a['iterations']} measured iterations of T2ITrainer.train_iteration() (tiny random models, 32 px, CPU, fp32)"
        + ("; --in-process: all recipes in one process, so peak RSS is cumulative" if a["in_process"] else ""),
        "- no GPU was available for this session: the GPU part of the benchmark (an SD3.5-Medium-sized transformer "
        "with random weights at 512 px: rollout images/s, s/iteration, peak memory, MFU) is written as "
        "`python scripts/bench.py --gpu` and has **not been run yet**; its numbers do not exist.",
        "",
        "Counts per final (trained) image: rows through the denoiser (CFG would double them; the tiny recipes "
        "sample without CFG), measured by the sampler's counters over the measured iterations; the closed form "
        "of the plan in the last column (✓: every count, backward passes and reward calls included, equals it). "
        "Reward calls: scorer invocations per iteration (one per scorer per rollout batch); scored: images "
        "decoded per iteration (final images + probe / side-branch completions).", "",
        "| recipe | plan | images / it | no-grad fwd / img | grad fwd / img | backward / img | reward calls / it | "
        "scored / it | closed form (no-grad / grad) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in result["recipes"].items():
        if "summary" not in r:
            lines.append(f"| {name} | failed: {r.get('error', '?')[:80]} |  |  |  |  |  |  |  |")
            continue
        s = r["summary"]
        m, c = s["per_image"], s["closed_form_per_image"]
        lines.append(f"| {name} | {r['plan']} | {_n(s['images_per_iteration'])} | {_n(m['fwd_nograd'], 3)} | "
                     f"{_n(m['fwd_grad'], 3)} | {_n(m['backward'], 3)} ({_n(m['backward'] * s['images_per_iteration'])} / it) | "
                     f"{_n(s['reward_calls_per_iteration'])} | "
                     f"{_n(s['decoded_images_per_iteration'])} | {_n(c['fwd_nograd'], 3)} / {_n(c['fwd_grad'], 3)}"
                     f"{' ✓' if s['counts_match_closed_form'] else ' ✗'} |")
    lines += [
        "", "Time (mean seconds per measured iteration unless marked). Phases are the trainer's own timers: "
        "rollout (sampling), reward (decode + scorers on the worker threads, overlapping the rollout), "
        "wait (the main thread waiting for the last rewards), train (credit + updates). Model calls from "
        "the hooks: denoiser forwards, backward passes, VAE decodes (worker threads). Outside: the share of "
        "the iteration during which no denoiser forward or VAE decode runs (and, second, nor a backward pass).", "",
        "| recipe | s / it: median (min-max) | rollout | reward | wait | train | fwd no-grad | fwd grad | backward | decode | "
        "outside fwd+decode | outside all model calls | CPU s / it | peak RSS (MB) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in result["recipes"].items():
        if "summary" not in r:
            continue
        s = r["summary"]
        ph, mc = s["phases_mean_s"], s["model_calls_mean_s"]
        lines.append(f"| {name} | {s['seconds_per_iteration_median']:.3f} ({s['seconds_per_iteration_min']:.3f}-"
                     f"{s['seconds_per_iteration_max']:.3f}) | {ph['rollout']:.3f} | {ph['reward']:.3f} | "
                     f"{ph['reward_wait']:.3f} | {ph['train']:.3f} | {mc['fwd_nograd']:.3f} | {mc['fwd_grad']:.3f} | "
                     f"{mc['backward']:.3f} | {mc['decode']:.3f} | {s['share_outside_fwd_decode']:.0%} | "
                     f"{s['share_outside_model_calls']:.0%} | {s['cpu_seconds_per_iteration']:.3f} | "
                     f"{r['peak_rss_mb']:.0f} |")
    lines += ["", "Closed forms used (per image; W_d = nodes at depth d of one root's tree, L = leaves per root): "
              "chain plans T no-grad, K trained steps grad; tree sum_(d<T) W_d / L no-grad, trained edges per leaf "
              "grad; branch points T + k sum_p (T-1-p) no-grad, k |points| grad; probes T + sum_d (T-d) no-grad "
              "(one-step probes: T), |window| grad; DiffusionNFT + n_t old-policy no-grad and n_t grad. Per recipe "
              "the formula with its numbers is in the JSON (`formula_first_iteration`; each iteration's closed form under `iterations`).", "", "Reading:", ""]
    lines += reading(result)
    lines += published_lines(result.get("published") or {})
    return "\n".join(lines) + "\n"


def write_section(path: Path, section: str, heading: str = SECTION) -> None:
    """Replace this script's section of `path` (from its heading to the next '## ' heading), or append it."""
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    pattern = re.compile(rf"^{re.escape(heading)}[ \t]*\n.*?(?=^## |\Z)", re.DOTALL | re.MULTILINE)
    if pattern.search(text):
        text = pattern.sub(lambda m: section.rstrip("\n") + "\n\n", text, count=1)
    else:
        text = text.rstrip("\n") + "\n\n" + section
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text.rstrip("\n") + "\n")


# --- main ------------------------------------------------------------------------------------------

def _json_default(obj):
    if hasattr(obj, "item"):
        return obj.item()
    return str(obj)


def _run_worker(kind: str, names: str, args, tmp: Path) -> dict:
    """Run one worker in its own process (or in this one with --in-process); its result dict."""
    if args.in_process:
        return bench_recipe(names, args) if kind == "recipe" else bench_published(names.split(","), args)
    out = tmp / f"{kind}_{names.replace(',', '_')}.json"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", f"{kind}:{names}", "--worker-out", str(out),
           "--iterations", str(args.iterations), "--warmup", str(args.warmup), "--num-threads", str(args.num_threads),
           "--out-dir", str(args.out_dir)]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0 or not out.exists():
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        raise RuntimeError(f"worker {kind}:{names} exited with {proc.returncode}: {tail[0]}")
    if proc.stderr.strip():
        sys.stderr.write(proc.stderr)
    return json.loads(out.read_text())


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--recipes", default=",".join(RECIPES), help="comma list of configs/t2i/tiny recipes")
    p.add_argument("--iterations", type=int, default=3, help="measured iterations per recipe")
    p.add_argument("--warmup", type=int, default=1, help="iterations run first and left out")
    p.add_argument("--num-threads", type=int, default=1, help="torch CPU threads of each run")
    p.add_argument("--published", default=",".join(PUBLISHED),
                   help=f"published-settings comparisons to run (comma list of {list(PUBLISHED)}, or 'none')")
    p.add_argument("--out-dir", default=None, help="run folders (default: a temporary folder, removed after)")
    p.add_argument("--json", default=str(ROOT / "docs" / "bench_t2i.json"))
    p.add_argument("--markdown", default=str(ROOT / "docs" / "benchmarks.md"))
    p.add_argument("--in-process", action="store_true",
                   help="run every recipe in this process (faster start; peak memory is then cumulative)")
    g = p.add_argument_group("GPU mode (written, NOT YET RUN on a GPU)")
    g.add_argument("--gpu", action="store_true", help="SD3.5-M-sized random transformer instead of the tiny recipes")
    g.add_argument("--gpu-device", default="cuda")
    g.add_argument("--gpu-dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    g.add_argument("--gpu-layers", type=int, default=24, help="MMDiT layers (SD3.5-M: 24)")
    g.add_argument("--gpu-resolution", type=int, default=512)
    g.add_argument("--gpu-steps", type=int, default=10)
    g.add_argument("--gpu-group", type=int, default=8)
    g.add_argument("--gpu-prompts", type=int, default=2)
    g.add_argument("--gpu-micro", type=int, default=8)
    g.add_argument("--peak-tflops", type=float, default=None, help="the device's dense bf16 peak (default: by name)")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--worker-out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.iterations < 1 or args.warmup < 0:
        p.error("--iterations must be >= 1 and --warmup >= 0")

    if args.worker:  # child process: one recipe or the published settings
        kind, names = args.worker.split(":", 1)
        res = bench_recipe(names, args) if kind == "recipe" else bench_published(names.split(","), args)
        res.pop("trainer", None)
        Path(args.worker_out).write_text(json.dumps(res, default=_json_default))
        return res

    command = "python scripts/bench.py" + (" " + shlex.join(sys.argv[1:] if argv is None else argv)
                                           if (sys.argv[1:] if argv is None else argv) else "")
    with tempfile.TemporaryDirectory(prefix="bench_t2i_") as tmp:
        if args.out_dir is None:
            args.out_dir = str(Path(tmp) / "runs")
        result: dict[str, Any] = {
            "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M"), "command": command,
            "settings": {k: getattr(args, k) for k in ("recipes", "iterations", "warmup", "num_threads", "published",
                                                        "in_process")},
            "machine": machine(args.num_threads), "versions": versions(), "git": git_state(),
            "load_before": [round(x, 2) for x in os.getloadavg()],
        }
        if args.gpu:
            result["gpu"] = bench_gpu(args)
            result["gpu"]["iterations"] = [{k: v for k, v in r.items()} for r in result["gpu"]["iterations"]]
            result["load_after"] = [round(x, 2) for x in os.getloadavg()]
            path = Path(args.json) if args.json != str(ROOT / "docs" / "bench_t2i.json") else ROOT / "docs" / "bench_t2i_gpu.json"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(result, indent=1, default=_json_default) + "\n")
            write_section(Path(args.markdown), gpu_markdown(result), GPU_SECTION)
            return result

        result["recipes"] = {}
        for name in [r for r in args.recipes.split(",") if r]:
            t0 = time.perf_counter()
            try:
                res = _run_worker("recipe", name, args, Path(tmp))
                res.pop("trainer", None)
                s = res["summary"]
                print(f"{name}: {s['per_image']['fwd_nograd']:.3f} no-grad / {s['per_image']['fwd_grad']:.3f} grad "
                      f"rows per image, {s['seconds_per_iteration_median']:.3f} s/it "
                      f"({'matches' if s['counts_match_closed_form'] else 'DIFFERS FROM'} the closed form; "
                      f"{time.perf_counter() - t0:.1f} s)", file=sys.stderr, flush=True)
            except Exception as err:  # keep going: one broken recipe must not hide the others
                res = {"recipe": name, "error": f"{type(err).__name__}: {err}"}
                print(f"{name}: FAILED {res['error']}", file=sys.stderr, flush=True)
            result["recipes"][name] = res
        keys = [k for k in args.published.split(",") if k and k != "none"]
        unknown = [k for k in keys if k not in PUBLISHED]
        if unknown:
            raise SystemExit(f"--published: unknown {unknown}; valid: {list(PUBLISHED)}")
        result["published"] = _run_worker("published", ",".join(keys), args, Path(tmp)) if keys else {}
        result["load_after"] = [round(x, 2) for x in os.getloadavg()]
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=1, default=_json_default) + "\n")
    write_section(Path(args.markdown), markdown(result))
    return result


if __name__ == "__main__":
    main()
