"""The report of scripts/bench_text.py: per-step summaries in the same four phases for both trainers, ours / TRL
ratios per round, and the markdown section it writes into docs/benchmarks.md."""

from __future__ import annotations

import re
import statistics
from collections import defaultdict
from pathlib import Path

SECTION = "## Text trainer vs TRL GRPOTrainer"

SPLIT = ("generate", "logprob", "reward", "train")


def split_phases(step: dict, trl: bool) -> dict:
    """One step's seconds in the same four phases for both trainers (+ `other`: the rest of the step).

    Ours: the trainer's timers (logprob = the no-grad passes: old / reference log-probs, the on-policy
    check). TRL: generate = `transformers.generate`, reward = `_calculate_rewards`, logprob = the rest of
    `_prepare_inputs` (its no-grad old / reference log-probs when it runs any, tokenising, padding),
    train = the step minus `_prepare_inputs` (the loss forward, backward and optimizer step)."""
    ph = step["phases"]
    if trl:
        prep = ph.get("_prepare_inputs", 0.0)
        gen, rew = ph.get("transformers.generate", 0.0), ph.get("_calculate_rewards", 0.0)
        out = {"generate": gen, "logprob": prep - gen - rew, "reward": rew, "train": step["seconds"] - prep}
    else:
        out = {k: ph.get(k, 0.0) for k in SPLIT}
    out["other"] = step["seconds"] - sum(out[k] for k in SPLIT)
    return out


def summarize(steps: list[dict], trl: bool = False) -> dict:
    secs = [s["seconds"] for s in steps]
    cpus = [s.get("cpu_seconds", float("nan")) for s in steps]
    toks = [s.get("tokens", float("nan")) for s in steps]
    phases = defaultdict(list)
    split = defaultdict(list)
    for s in steps:
        for k, v in s["phases"].items():
            phases[k].append(v)
        for k, v in split_phases(s, trl).items():
            split[k].append(v)
    return {
        "measured_steps": len(steps),
        "seconds_per_step_median": statistics.median(secs),
        "seconds_per_step_mean": statistics.fmean(secs),
        "seconds_per_step_min": min(secs),
        "seconds_per_step_max": max(secs),
        "cpu_seconds_per_step_median": statistics.median(cpus),
        "tokens_per_step_mean": statistics.fmean(toks),
        "tokens_per_second": sum(toks) / sum(secs),
        "phases_mean_seconds": {k: statistics.fmean(v) for k, v in sorted(phases.items())},
        "split_mean_seconds": {k: statistics.fmean(split[k]) for k in (*SPLIT, "other")},
        "steps": steps,
    }


def round_ratios(ours: list[dict], trl: list[dict], steps: int, key: str) -> dict:
    """ours / TRL per round (median `key` of the round's measured steps): the two ran minutes apart at
    most, so a change of machine load between rounds cancels out of each ratio."""
    ratios = []
    for r in range(len(trl) // steps):
        a = statistics.median(s[key] for s in ours[r * steps : (r + 1) * steps])
        b = statistics.median(s[key] for s in trl[r * steps : (r + 1) * steps])
        ratios.append(a / b)
    return {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios), "rounds": ratios}


LABELS = {
    "ours_matched": "ours (matched)",
    "ours_default": "ours (default, + on-policy check)",
    "ours_plain": "ours (matched, shared prompt off)",
    "trl": "TRL GRPOTrainer",
}


def _ratio_cell(run: dict, kind: str) -> str:
    q = run.get("ratio_vs_trl", {}).get(kind)
    return "-" if q is None else f"{q['median']:.2f}x ({q['min']:.2f}-{q['max']:.2f})"


def markdown(result: dict) -> str:
    cfg, mach, ver = result["config"], result["machine"], result["versions"]
    lines = [
        SECTION,
        "",
        f"`python scripts/bench_text.py {result['argv']}`".replace(" `", "`")
        if result["argv"]
        else "`python scripts/bench_text.py`",
        "",
        f"- date (UTC): {result['date']}",
        f"- machine: {mach['cpu']}, {mach['logical_cpus']} logical CPUs, torch threads {mach['torch_threads']}"
        + (f", GPU {mach['gpu']}" if mach.get("gpu") else "")
        + f"; device `{cfg['device']}`",
        f"- load average before / after: {result['load_before']} / {result['load_after']}"
        " (other jobs on the machine slow every contender alike; rounds alternate the order)",
        "- versions: " + ", ".join(f"{k} {v}" for k, v in ver.items() if v),
        f"- work per step: {cfg['prompts']} prompts x {cfg['group_size']} completions x up to "
        f"{cfg['max_new_tokens']} tokens, loss `{cfg['loss']}`, no KL, 1 optimizer step, fp32, "
        f"gradient checkpointing {'on in both' if cfg.get('checkpointing') else 'off'}; "
        f"{cfg['rounds']} rounds x {cfg['steps']} measured steps after {cfg['warmup']} warm-up step(s) per round",
        "",
        "ours / TRL: per round, the median s/step of ours over TRL's in the same round; the median over rounds "
        "(min-max). Wall: elapsed seconds; CPU: the process's CPU seconds (less sensitive to waiting for a core).",
        "",
        "| model | trainer | s/step (median) | s/step (mean) | CPU s/step (median) | tokens/s "
        "| ours / TRL wall | ours / TRL CPU |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for size, runs in result["results"].items():
        params = result["params"][size]
        for name, label in LABELS.items():
            if name not in runs:
                continue
            r = runs[name]

            lines.append(
                f"| {size} ({params / 1e6:.2f} M) | {label} | {r['seconds_per_step_median']:.3f} | "
                f"{r['seconds_per_step_mean']:.3f} | {r['cpu_seconds_per_step_median']:.3f} | "
                f"{r['tokens_per_second']:.0f} | {_ratio_cell(r, 'wall')} | {_ratio_cell(r, 'cpu')} |"
            )
    lines += [
        "",
        "Where the time goes (mean seconds per measured step, the same phases for both trainers; TRL: generate = "
        "`transformers.generate`, logprob = the rest of `_prepare_inputs` (no-grad passes when any, tokenising, "
        "padding), train = the step minus `_prepare_inputs`; other = the rest of the step):",
        "",
        "| model | trainer | step | generate | logprob | reward | train | other |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for size, runs in result["results"].items():
        for name, label in LABELS.items():
            if name not in runs:
                continue
            sp = runs[name]["split_mean_seconds"]
            lines.append(
                f"| {size} | {label} | {runs[name]['seconds_per_step_mean']:.3f} | "
                + " | ".join(f"{sp[k]:.3f}" for k in (*SPLIT, "other"))
                + " |"
            )
    if result.get("notes"):
        lines += ["", *result["notes"]]
    return "\n".join(lines) + "\n"


def reading(results: dict, params: dict) -> list[str]:
    """The paragraph under the tables, from the numbers of this run."""
    out = ["Reading:", ""]
    for size, runs in results.items():
        if "ours_matched" not in runs:
            continue
        m, t = runs["ours_matched"], runs["trl"]
        sm, st = m["split_mean_seconds"], t["split_mean_seconds"]
        q, qc = m["ratio_vs_trl"]["wall"], m["ratio_vs_trl"]["cpu"]
        text = (
            f"- {size} ({params[size] / 1e6:.2f} M parameters): ours (matched) takes {q['median']:.2f}x TRL's time "
            f"per step (rounds {q['min']:.2f}-{q['max']:.2f}; CPU seconds {qc['median']:.2f}x). Generation: "
            f"{sm['generate']:.3f} vs {st['generate']:.3f} s (the same `model.generate` in both), "
            f"{sm['generate'] / st['generate']:.2f}x; the update (forward + backward + AdamW): {sm['train']:.3f} vs "
            f"{st['train']:.3f} s, {sm['train'] / st['train']:.2f}x."
        )
        if "ours_default" in runs:
            text += f" The on-policy check costs {runs['ours_default']['split_mean_seconds']['logprob']:.3f} s a step."
        if "ours_plain" in runs:
            text += f" With the shared-prompt forward off the update takes {runs['ours_plain']['split_mean_seconds']['train']:.3f} s."
        out.append(text)
    out += [
        "- Generation is the same `model.generate` call in both. The update runs each distinct prompt once per "
        "micro-batch instead of once per completion (the gain grows with prompt length and group size; here "
        "prompts are ~25 tokens, completions up to 64, G = 8).",
        "- CPU, tiny random models, 2 shared cores: the ratios say which trainer does less work per step; "
        "absolute seconds are indicative only. Not measured here: GPUs, real model sizes, vLLM generation.",
    ]
    return out


def write_section(path: Path, section: str) -> None:
    """Replace (or append) only our section of the markdown file; create it with a '# Benchmarks' heading."""
    text = path.read_text() if path.is_file() else "# Benchmarks\n"
    pattern = re.compile(rf"^{re.escape(SECTION)}[ \t]*\n.*?(?=^## |\Z)", re.S | re.M)
    if pattern.search(text):
        text = pattern.sub(lambda m: section + "\n", text, count=1)
    else:
        text = text.rstrip("\n") + "\n\n" + section
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text.rstrip("\n") + "\n")
