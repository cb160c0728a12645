"""The JSON / markdown report of a bench run: machine, versions, the tables and the reading under them."""

from __future__ import annotations

import json
import math
import os
import platform
import re
import statistics
import subprocess
from pathlib import Path
from typing import Any

from .published import PUBLISHED_COMMON
from .recipes import counts_close

ROOT = Path(__file__).resolve().parents[2]
SECTION = "## Text-to-image recipes (tiny models, CPU)"
GPU_JSON = ROOT / "docs" / "bench_t2i_gpu.json"  # what `scripts/bench.py --gpu` writes by default


def machine(threads: int, device: str | None = None) -> dict[str, Any]:
    """The host, and the GPU's name when `device` is a CUDA device (the --gpu mode) and CUDA is present."""
    cpu = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "logical_cpus": os.cpu_count(),
        "torch_threads": threads,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "gpu": _gpu_name(device),
    }


def _gpu_name(device: str | None) -> str | None:
    if not device or not device.startswith("cuda"):
        return None
    import torch

    return torch.cuda.get_device_name(torch.device(device)) if torch.cuda.is_available() else None


def load_gpu(path: Path = GPU_JSON) -> dict | None:
    """The recorded GPU run (`scripts/bench.py --gpu`'s JSON), or None when there is none."""
    return json.loads(path.read_text()) if path.exists() else None


def gpu_pointer(gpu: dict | None) -> str:
    """The CPU section's line on GPU figures: where the recorded GPU run is, or that there is none."""
    if gpu is None:
        return (
            "- GPU figures: none recorded. `python scripts/bench.py --gpu` (an SD3.5-Medium-sized transformer with "
            "random weights at 512 px: rollout images/s, s/iteration, peak memory, MFU) writes them to "
            'docs/bench_t2i_gpu.json and the section "Text-to-image on GPU" of this page.'
        )
    s = gpu["gpu"]["summary"]
    return (
        f'- GPU figures: the section "Text-to-image on GPU" of this page (docs/bench_t2i_gpu.json; '
        f"{gpu['gpu']['device']}, {gpu['date']} UTC: an SD3.5-Medium-sized random transformer at 512 px, "
        f"{s['seconds_per_iteration_mean']:.2f} s per Flow-GRPO iteration)."
    )


def _gpu_outside(gpu: dict | None) -> str:
    """The GPU run's share of the iteration outside model calls, for the CPU section's reading."""
    rows = [r for r in gpu["gpu"]["iterations"] if not r["warmup"]] if gpu else []
    if not rows:
        return "; at real model sizes the model calls should take a larger share (not measured: no GPU run is recorded)"
    # as recipes.summarize computes the tiny recipes' shares
    fd = statistics.fmean(1 - r["model"]["union_fwd_decode_s"] / r["wall_s"] for r in rows)
    every = statistics.fmean(1 - r["model"]["union_all_s"] / r["wall_s"] for r in rows)
    return (
        f". On the GPU run (SD3.5-M-sized, {gpu['gpu']['device']}; its section below): {fd:.0%} outside forwards "
        f"and decodes, {every:.0%} outside forwards, decodes and backward passes, on the host clock (the hooks do "
        "not synchronise the GPU, the phase timers do)"
    )


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
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=False
        ).stdout.strip()
        dirty = bool(
            subprocess.run(
                ["git", "status", "--porcelain"], cwd=ROOT, capture_output=True, text=True, check=False
            ).stdout.strip()
        )
        return {"commit": head or None, "dirty": dirty}
    except OSError:
        return {"commit": None, "dirty": None}


def _n(x: float, digits: int = 2) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return f"{x:.{digits}f}".rstrip("0").rstrip(".") if abs(x - round(x)) > 1e-9 else str(round(x))


def reading(result: dict, gpu: dict | None = None) -> list[str]:
    """A few plain statements computed from the numbers (so a re-run keeps them true); `gpu`: the recorded
    GPU run (load_gpu), whose share outside model calls is set beside the tiny models' ones."""
    recipes = {k: v["summary"] for k, v in result["recipes"].items() if "summary" in v}
    out = []
    if not recipes:
        return out
    bad = [k for k, s in recipes.items() if not s["counts_match_closed_form"]]
    hooks_bad = [k for k, s in recipes.items() if not s["hook_rows_match_counters"]]
    out.append(
        f"- Counts: {len(recipes) - len(bad)} of {len(recipes)} recipes match the closed form exactly"
        + (
            f"; not: {', '.join(bad)} (see the JSON: an edge with advantage exactly 0 is dropped by the "
            "trainer, and some pruning combinations have no simple closed form)"
            if bad
            else ""
        )
        + ". The hook counts (rows entering adapter.denoiser) equal the sampler's counters"
        + (f" except in {', '.join(hooks_bad)}." if hooks_bad else " in every recipe.")
    )
    most = max(recipes, key=lambda k: recipes[k]["per_image"]["fwd_nograd"])
    least = min(recipes, key=lambda k: recipes[k]["per_image"]["fwd_nograd"])
    line = (
        f"- No-grad forwards per final image range from {_n(recipes[least]['per_image']['fwd_nograd'])} "
        f"({least}) to {_n(recipes[most]['per_image']['fwd_nograd'])} ({most})"
    )
    if result["recipes"][most]["plan"] in ("branch_points", "probes"):
        line += (
            "; the side branches and probe completions of the process-reward methods are paid in rollout "
            "forwards (and in scored images), not in gradient rows"
        )
    out.append(line + ".")
    fast = min(recipes, key=lambda k: recipes[k]["seconds_per_iteration_median"])
    slow = max(recipes, key=lambda k: recipes[k]["seconds_per_iteration_median"])
    out.append(
        f"- Time per iteration (median): {_n(recipes[fast]['seconds_per_iteration_median'], 3)} s ({fast}) to "
        f"{_n(recipes[slow]['seconds_per_iteration_median'], 3)} s ({slow}). These are tiny random models on "
        f"{result['machine']['logical_cpus']} shared CPU cores (load average {result['load_before'][0]} before, "
        f"{result['load_after'][0]} after): the counts are exact, the seconds are indicative only."
    )
    roll = {k: s["phases_mean_s"]["rollout"] / s["seconds_per_iteration_mean"] for k, s in recipes.items()}
    train = {k: s["phases_mean_s"]["train"] / s["seconds_per_iteration_mean"] for k, s in recipes.items()}
    r_hi, t_hi = max(roll, key=roll.get), max(train, key=train.get)
    out.append(
        f"- Phases: the rollout takes {min(roll.values()):.0%} to {roll[r_hi]:.0%} of an iteration (most: {r_hi}), "
        f"the update {min(train.values()):.0%} to {train[t_hi]:.0%} (most: {t_hi}); scoring runs on worker "
        "threads during the rollout, and the main thread scores the last batch itself in its reward wait, "
        f"{min(s['phases_mean_s']['reward_wait'] for s in recipes.values()) * 1e3:.0f}-"
        f"{max(s['phases_mean_s']['reward_wait'] for s in recipes.values()) * 1e3:.0f} ms per iteration."
    )
    outside = [s["share_outside_model_calls"] for s in recipes.values()]
    outside_fd = [s["share_outside_fwd_decode"] for s in recipes.values()]
    out.append(
        f"- Outside denoiser forwards and VAE decodes: {min(outside_fd):.0%} to {max(outside_fd):.0%} of the "
        f"iteration; outside forwards, decodes and backward passes: {min(outside):.0%} to {max(outside):.0%}. "
        "With models this small, Python work (sampler step maths, tree bookkeeping, optimizer, EMA, LoRA "
        "plumbing) is a large share" + _gpu_outside(gpu) + "."
    )
    ratios = {
        k: s["seconds_per_iteration_mean"] / s["cpu_seconds_per_iteration"]
        for k, s in recipes.items()
        if s["cpu_seconds_per_iteration"] > 0
    }
    if ratios:
        lo, hi = min(ratios, key=ratios.get), max(ratios, key=ratios.get)
        line = (
            f"- Wall seconds per iteration / the process's CPU seconds: {ratios[lo]:.2f} ({lo}) to {ratios[hi]:.2f} "
            f"({hi}), median {statistics.median(ratios.values()):.2f} (one torch thread plus the reward worker "
            "threads). Where it is well above 1 the process was waiting for the shared cores, and the load from "
            "other jobs changes during a run: wall seconds of two recipes are not comparable one to one, the CPU "
            "seconds column is the steadier comparison"
        )
        if "flow_grpo" in recipes and "grpo_guard" in recipes:
            a, b = recipes["flow_grpo"], recipes["grpo_guard"]
            line += (
                f" (flow_grpo and grpo_guard do the same counted work: CPU {a['cpu_seconds_per_iteration']:.3f} vs "
                f"{b['cpu_seconds_per_iteration']:.3f} s, wall {a['seconds_per_iteration_median']:.3f} vs "
                f"{b['seconds_per_iteration_median']:.3f} s)"
            )
        out.append(line + ".")
    for name, r in result["recipes"].items():
        first = (r.get("iterations") or [{}])[0].get("closed_form", {})
        if first.get("pruned_edges_per_root") == 0:
            why = re.search(r"\((width pruning keeps .*? leaf chain)\)", first["formula"])
            out.append(
                f"- {name}: pruning is configured but removes no edge at these settings"
                + (f": {why.group(1)}." if why else ".")
            )
    return out


def published_lines(pub: dict) -> list[str]:
    if not pub:
        return []
    lines = [
        "",
        "### Forward counts at BranchGRPO's published settings",
        "",
        "BranchGRPO's README table reports NFE per image of pi_old (no grad) / pi_theta (grad) for FLUX.1-dev "
        "with 20 steps and 16 images per prompt. Here the same plans run for one iteration on a tiny FLUX "
        "(no CFG, one prompt, 16 images; counts do not depend on model size). Common overrides: "
        f"`{' '.join(PUBLISHED_COMMON)}`.",
        "",
        "| method | plan | ours no-grad / img | ours grad / img | closed form | published no-grad / grad |",
        "|---|---|---|---|---|---|",
    ]
    for p in pub.values():
        m, c = p["per_image"], p["closed_form_per_image"]
        sweep = ""
        if p["sweep_iterations"] > 1:
            sweep = (
                f"; mean over a full window sweep ({p['sweep_iterations']} iterations): "
                f"{_n(p['sweep_per_image']['fwd_nograd'], 3)} / {_n(p['sweep_per_image']['fwd_grad'], 3)}"
            )
        lines.append(
            f"| {p['label']} | {p['settings']} | {_n(m['fwd_nograd'], 3)} | {_n(m['fwd_grad'], 3)} | "
            f"{_n(c['fwd_nograd'], 3)} / {_n(c['fwd_grad'], 3)}{' ✓' if p['counts_match_closed_form'] else ''}"
            f"{sweep} | {_n(p['published_per_image'][0], 3)} / {_n(p['published_per_image'][1], 3)} |"
        )
    lines += ["", "Reading:", ""]
    if "branchgrpo" in pub:
        b = pub["branchgrpo"]
        ng, gr, pub_g = b["per_image"]["fwd_nograd"], b["per_image"]["fwd_grad"], b["published_per_image"][1]
        lines.append(
            f"- BranchGRPO: we train {_n(gr, 4)} edges per leaf ({_n(gr * 16)} edges per tree / 16 leaves); "
            f"the README's {_n(pub_g)} is {abs(pub_g / gr - 1):.1%} away from it (we found no count of this "
            f"tree that gives exactly {_n(pub_g)}). Our rollout needs {_n(ng, 4)} no-grad forwards per leaf "
            f"({_n(ng * 16)} per tree), fewer than one per edge: the two children of a split share their "
            "parent's model output (only their noise differs), so a split costs one forward per parent."
        )
    if "branchgrpo_width" in pub:
        w = pub["branchgrpo_width"]
        got, want = w["per_image"]["fwd_grad"], w["published_per_image"][1]
        lines.append(
            f"- Width pruning (mode 1, keep half of the last-layer edges of each leaf chain): {_n(got, 4)} grad "
            f"rows per image; published {_n(want, 4)}" + (" (equal)." if counts_close(got, want) else ".")
        )
    if "branchgrpo_mix" in pub:
        x = pub["branchgrpo_mix"]
        avg, want = x["sweep_per_image"]["fwd_grad"], x["published_per_image"][1]
        lines.append(
            f"- BranchGRPO-Mix: which edges are trained depends on where the window is. At iteration 0 (window "
            f"on steps 0-3) we train {_n(x['per_image']['fwd_grad'], 4)} edges per leaf; averaged over one full "
            f"sweep of the window (every start position equally long) it is {_n(avg, 3)}, "
            f"{abs(want / avg - 1):.1%} away from the published {_n(want)}. So the published figure matches a "
            "mean over all window positions, not the count of one iteration; whether their training visited "
            "every position equally (300 steps with a shift every 25 would reach only 12 of the 17) is "
            "not known to us."
        )
    if "mixgrpo" in pub:
        x = pub["mixgrpo"]
        lines.append(
            f"- MixGRPO with a window of 4 trains {_n(x['per_image']['fwd_grad'])} steps per image; the table's "
            '"(20, 5)" lists 5 grad forwards per image, which a window of 4 does not give (a window of 5 '
            "would; we did not find which setting the table used)."
        )
    if "dance_grpo" in pub:
        lines.append(
            f"- DanceGRPO with all 20 steps trained: {_n(pub['dance_grpo']['per_image']['fwd_nograd'])} / "
            f"{_n(pub['dance_grpo']['per_image']['fwd_grad'])}, as published."
        )
    return lines


def markdown(result: dict, gpu: dict | None = None) -> str:
    """The CPU section; `gpu`: the recorded GPU run (load_gpu), pointed to and quoted in the reading."""
    mach, ver, a = result["machine"], result["versions"], result["settings"]
    lines = [
        SECTION,
        "",
        f"`{result['command']}`",
        "",
        f"- date (UTC): {result['date']}; git {result['git']['commit']}{' (uncommitted changes)' if result['git']['dirty'] else ''}",
        f"- machine: {mach['cpu']}, {mach['logical_cpus']} logical CPUs shared with other jobs, torch threads "
        f"{a['num_threads']}; load average before / after: {result['load_before']} / {result['load_after']}",
        "- versions: " + ", ".join(f"{k} {v}" for k, v in ver.items() if v),
        f"- each recipe: configs/t2i/tiny/<recipe>.yaml in its own process, {a['warmup']} warm-up + "
        f"{a['iterations']} measured iterations of T2ITrainer.train_iteration() (tiny random models, 32 px, CPU, fp32)"
        + ("; --in-process: all recipes in one process, so peak RSS is cumulative" if a["in_process"] else ""),
        *remeasured_lines(result),
        gpu_pointer(gpu),
        "",
        "Counts per final (trained) image: rows through the denoiser (CFG would double them; the tiny recipes "
        "sample without CFG), measured by the sampler's counters over the measured iterations; the closed form "
        "of the plan in the last column (✓: every count, backward passes and reward calls included, equals it). "
        "Reward calls: scorer invocations per iteration (one per scorer per rollout batch); scored: images "
        "decoded per iteration (final images + probe / side-branch completions).",
        "",
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
        lines.append(
            f"| {name} | {r['plan']} | {_n(s['images_per_iteration'])} | {_n(m['fwd_nograd'], 3)} | "
            f"{_n(m['fwd_grad'], 3)} | {_n(m['backward'], 3)} ({_n(m['backward'] * s['images_per_iteration'])} / it) | "
            f"{_n(s['reward_calls_per_iteration'])} | "
            f"{_n(s['decoded_images_per_iteration'])} | {_n(c['fwd_nograd'], 3)} / {_n(c['fwd_grad'], 3)}"
            f"{' ✓' if s['counts_match_closed_form'] else ' ✗'} |"
        )
    lines += [
        "",
        "Time (mean seconds per measured iteration unless marked). Phases are the trainer's own timers: "
        "rollout (sampling), reward (decode + scorers on the worker threads, overlapping the rollout), "
        "wait (the main thread waiting for the last rewards), train (credit + updates). Model calls from "
        "the hooks: denoiser forwards, backward passes, VAE decodes (worker threads). Outside: the share of "
        "the iteration during which no denoiser forward or VAE decode runs (and, second, nor a backward pass).",
        "",
        "| recipe | s / it: median (min-max) | rollout | reward | wait | train | fwd no-grad | fwd grad | backward | decode | "
        "outside fwd+decode | outside all model calls | CPU s / it | peak RSS (MB) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in result["recipes"].items():
        if "summary" not in r:
            continue
        s = r["summary"]
        ph, mc = s["phases_mean_s"], s["model_calls_mean_s"]
        lines.append(
            f"| {name} | {s['seconds_per_iteration_median']:.3f} ({s['seconds_per_iteration_min']:.3f}-"
            f"{s['seconds_per_iteration_max']:.3f}) | {ph['rollout']:.3f} | {ph['reward']:.3f} | "
            f"{ph['reward_wait']:.3f} | {ph['train']:.3f} | {mc['fwd_nograd']:.3f} | {mc['fwd_grad']:.3f} | "
            f"{mc['backward']:.3f} | {mc['decode']:.3f} | {s['share_outside_fwd_decode']:.0%} | "
            f"{s['share_outside_model_calls']:.0%} | {s['cpu_seconds_per_iteration']:.3f} | "
            f"{r['peak_rss_mb']:.0f} |"
        )
    lines += [
        "",
        "Closed forms used (per image; W_d = nodes at depth d of one root's tree, L = leaves per root): "
        "chain plans T no-grad, K trained steps grad; tree sum_(d<T) W_d / L no-grad, trained edges per leaf "
        "grad; branch points T + k sum_p (T-1-p) no-grad, k |points| grad; probes T + sum_d (T-d) no-grad "
        "(one-step probes: T), |window| grad; DiffusionNFT + n_t old-policy no-grad and n_t grad. Methods that "
        "train on clean samples (per iteration; E inner epochs, a term = one micro-batch at one time = one backward): "
        "AWM / SFT tau E S grad over S kept samples (AWM all, SFT top-k P min(k, G)), each velocity penalty (KL to "
        "the reference, AWM's EMA KL) the same rows again without grad, AWM's old log-probs tau (E S - S_1) no-grad "
        "(every term after the first mini-batch); Diffusion-DPO 2 tau E M grad and 2 tau E M reference rows for M "
        "pairs (online best_worst: P; offline: pairs_per_iteration); GARDO + the reference's rows on the gated "
        "samples (K edges or n_t times each; the gated count is data-dependent and read from the record); reward "
        "backprop (DRaFT-K, ReFL, AlignProp) K grad rows per sample (AlignProp's K drawn per micro-batch, read from "
        "its seeded draw), one backward and one call of each scorer per micro-batch; DRaFT-LV the last step from "
        "the re-noised final sample once per noise draw, n grad rows per sample and n calls of each scorer per "
        "micro-batch (the hooks also see the grad "
        "rows that gradient checkpointing recomputes in backward: hook and counter rows differ there). Per recipe "
        "the formula with its numbers is in the JSON (`formula_first_iteration`; each iteration's closed form under `iterations`).",
        "",
        "Reading:",
        "",
    ]
    lines += reading(result, gpu) + remeasured_reading(result)
    lines += published_lines(result.get("published") or {})
    return "\n".join(lines) + "\n"


MERGE_SETTINGS = ("iterations", "warmup", "num_threads", "in_process", "to_reward", "to_reward_rise")


def merge_run(base: dict, run: dict, key: str, order: list[str]) -> dict:
    """`base` (a recorded run) with `run`'s entries under `key` ("recipes" or "to_reward") replacing or joining
    its own, in `order` (others after); the rerun's date, git, load and command go under base["remeasured"]: the
    header keeps describing the first run. The measuring settings must be the same (a clear error names them)."""
    a, b = base["settings"], run["settings"]
    differ = [k for k in MERGE_SETTINGS + tuple(k for k in b if k.startswith("to_reward")) if a.get(k) != b.get(k)]
    if differ:
        raise SystemExit(
            f"--merge: the recorded run was measured with other settings ({', '.join(f'{k} {a.get(k)!r}' for k in differ)}"
            f"; this run: {', '.join(f'{k} {b.get(k)!r}' for k in differ)}): rerun with the recorded ones"
        )
    entries = {**base[key], **run[key]}
    names = [n for n in order if n in entries] + [n for n in entries if n not in order]
    base[key] = {n: entries[n] for n in names}
    base["settings"]["recipes"] = ",".join(names)
    if run.get("published"):
        base["published"] = run["published"]
    stamp = {k: run[k] for k in ("date", "command", "git", "load_before", "load_after")}
    base.setdefault("remeasured", []).append({**stamp, "recipes": list(run[key])})
    return base


def remeasured_lines(result: dict) -> list[str]:
    """One header line per --merge rerun: which rows it replaced, when, from which code, under which load."""
    return [
        f"- re-measured {', '.join(r['recipes'])} (their rows replace the first run's): {r['date']}; git "
        f"{r['git']['commit']}{' (uncommitted changes)' if r['git']['dirty'] else ''}; load average before / after: "
        f"{r['load_before']} / {r['load_after']}; `{r['command']}`" + (f" ({r['note']})" if r.get("note") else "")
        for r in result.get("remeasured", [])
    ]


def remeasured_reading(result: dict) -> list[str]:
    """A reading line when --merge reruns ran under another load than the first run: their seconds are not
    comparable with the other rows' (their counts are)."""
    runs = result.get("remeasured", [])
    if not runs:
        return []
    names = ", ".join(n for r in runs for n in r["recipes"])
    load = max(x for r in runs for x in (r["load_before"][0], r["load_after"][0]))
    first = max(result["load_before"][0], result["load_after"][0])
    return [
        f"- Re-measured rows ({names}): load average up to {load} during their run, {first} during the first run; "
        "where these differ much, their seconds (wall, and CPU seconds less so) are not comparable with the other "
        "rows', their counts are."
    ]


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
