#!/usr/bin/env python
"""Our text GRPO trainer against TRL's GRPOTrainer: same tiny model, same prompts, same work per step.

    HF_HUB_OFFLINE=1 python scripts/bench_text.py                 # defaults below; CPU unless --device cuda
    HF_HUB_OFFLINE=1 python scripts/bench_text.py --steps 8 --rounds 3 --loss grpo

Both trainers run in this one process on a random Qwen2 built from a config (the byte-level tokenizer
of the tests: no download), with the same initial weights, prompts, reward function, group size,
completion length, sampling settings (temperature 1, no top-k / top-p), loss type, no KL, one
optimizer step per generation batch, one micro-batch, fp32. TRL runs offline: no hub, no vLLM,
report_to none, no gradient checkpointing (our trainer has none either), bf16 off (fp32 as ours).

Contenders:
  ours (matched)  the same passes as TRL: generate, one forward+backward (old log-probs = the
                  detached current ones, as TRL does when num_iterations = 1)
  ours (default)  + the live on-policy ratio check (a no-grad re-scoring of 2 sequences a step)
  ours (plain)    matched, with the shared-prompt forward off (train.shared_prompt=false): each
                  completion's forward runs its prompt again, as TRL's does
  TRL             GRPOTrainer.train(), timed step by step with a callback (from on_step_begin to
                  on_step_end: fetching the step's prompts from the dataloader and logging are outside)

Each contender runs `--rounds` times (a fresh trainer each round, the order rotated between rounds,
so a change of machine load hits all of them alike); the first `--warmup` steps of every round are
left out. Reported: seconds per step (median and mean over measured steps), completion tokens per
second, the ratio TRL / ours (> 1: ours is faster), and where the time goes (our phase timers;
TRL's own profiling timers, captured from `trl.extras.profiling`).

Writes --json (default docs/bench_text.json) and the section "## Text trainer vs TRL GRPOTrainer"
of --markdown (default docs/benchmarks.md; created with a "# Benchmarks" heading if missing; other
sections are left as they are).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import re
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = Path(__file__).resolve().parents[1]
# our trainer's phase timers (metrics keys) -> the names the report uses
PHASES = {"time_rollout_s": "generate", "time_reward_s": "reward", "time_logprob_s": "logprob", "time_train_s": "train"}
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import flowgrpo  # noqa: E402,F401  (first: its import hooks make transformers / TRL importable on a CPU torch)

SECTION = "## Text trainer vs TRL GRPOTrainer"
SIZES = {  # name -> tiny Qwen2 settings
    "tiny": dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128),
    "small": dict(hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=512),
}
LOSSES = ("grpo", "dapo", "dr_grpo", "bnpo")


def reward_lower(prompts, completions, **kwargs):
    """The reward of both trainers: the share of the completion's characters that are lower-case letters.

    Dense on purpose: the random model's completions differ in it, so every group has a spread and every
    completion a non-zero advantage, and both trainers do the full forward + backward on every row
    (ours skips rows whose advantage is 0, which a sparse reward would turn into skipped work).
    """
    return [sum(ch.islower() for ch in c) / max(len(c), 1) for c in completions]


# --- our trainer -----------------------------------------------------------------------------------


def run_ours(args, size: str, variant: str, out_dir: Path) -> list[dict]:
    from flowgrpo.text import TextGRPOTrainer, load_text_config

    P, G, T = args.prompts, args.group_size, args.max_new_tokens
    tiny = SIZES[size]
    overrides = [
        f"output_dir={out_dir}",
        "progress=false",
        f"steps={args.warmup + args.steps}",
        f"seed={args.seed}",
        "model.name_or_path=tiny",
        f"model.device={args.device}",
        "model.tiny.max_position_embeddings=512",
        *[f"model.tiny.{k}={v}" for k, v in tiny.items()],
        "data.task={name: pattern, rows: 64}",
        "data.chat_template=false",
        f"generation.prompts_per_step={P}",
        f"generation.group_size={G}",
        f"generation.max_new_tokens={T}",
        "generation.temperature=1.0",
        "generation.top_p=1.0",
        "generation.top_k=0",
        f"generation.batch_size={P * G}",
        "rewards=[{name: reward_lower}]",
        "advantage.estimator=grpo",
        f"loss.preset={args.loss}",
        "loss.kl.coef=0",
        f"optim.lr={args.lr}",
        "optim.max_grad_norm=1.0",
        "train.inner_epochs=1",
        "train.mini_batches=1",
        f"train.micro_batch_size={P * G}",
        f"train.logprob_batch_size={P * G}",
        f"ratio_check.enabled={str(variant == 'ours_default').lower()}",
        f"train.shared_prompt={'false' if variant == 'ours_plain' else 'auto'}",
        "checkpoint.every=0",
        "checkpoint.save_final_model=false",
    ]
    if args.threads:
        overrides.append(f"num_threads={args.threads}")
    trainer = TextGRPOTrainer(
        load_text_config(ROOT / "configs" / "text" / "tiny_pattern.yaml", overrides),
        reward_funcs={"reward_lower": reward_lower},
    )
    steps = []
    for i in range(args.warmup + args.steps):
        _sync(args.device)
        t0 = time.perf_counter()
        rec = trainer.train_step()
        _sync(args.device)
        seconds = time.perf_counter() - t0
        if i >= args.warmup:
            steps.append(
                {
                    "seconds": seconds,
                    "tokens": rec["tokens/generated"],
                    "phases": {name: rec[k] for k, name in PHASES.items() if k in rec},
                    "reward": rec["reward_mean"],
                    "counts": {
                        k: rec[k] for k in ("nfe_nograd", "nfe_grad", "backward_passes", "check/rows") if k in rec
                    },
                }
            )
    return steps


# --- TRL -------------------------------------------------------------------------------------------

_TRL_TIMERS: list[tuple[str, float]] = []


def _capture_trl_profiling():
    """TRL times its phases (generate, reward functions, loss...) but sends them only to trackers; collect them."""
    from trl.extras import profiling

    def log_metrics(self, duration):
        _TRL_TIMERS.append((self.name, duration))

    profiling.ProfilingContext._log_metrics = log_metrics


def run_trl(args, size: str, out_dir: Path) -> list[dict]:
    from datasets import Dataset
    from transformers import PrinterCallback, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from flowgrpo.text.config import TinyModelConfig
    from flowgrpo.text.data import pattern_task
    from flowgrpo.text.models import build_tiny_model, build_tiny_tokenizer

    P, G, T = args.prompts, args.group_size, args.max_new_tokens
    tok = build_tiny_tokenizer()
    tok.chat_template = None  # plain-text prompts, as ours with data.chat_template=false
    model = build_tiny_model(TinyModelConfig(max_position_embeddings=512, **SIZES[size]), len(tok), tok.eos_token_id)
    dataset = Dataset.from_list(pattern_task(rows=64))
    config = GRPOConfig(
        output_dir=str(out_dir),
        per_device_train_batch_size=P * G,
        gradient_accumulation_steps=1,
        num_generations=G,
        max_completion_length=T,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        loss_type=args.loss,
        beta=0.0,
        num_iterations=1,
        epsilon=0.2,
        epsilon_high=0.28 if args.loss == "dapo" else 0.2,
        scale_rewards="group",
        learning_rate=args.lr,
        max_grad_norm=1.0,
        lr_scheduler_type="constant",
        warmup_steps=0,
        bf16=False,
        fp16=False,
        activation_checkpointing=False,
        use_vllm=False,
        use_cpu=args.device == "cpu",
        report_to="none",
        logging_steps=1,
        save_strategy="no",
        max_steps=args.warmup + args.steps,
        disable_tqdm=True,
        seed=args.seed,
        log_completions=False,
        dataloader_num_workers=0,
        push_to_hub=False,
    )

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.steps, self.t0, self.mark = [], 0.0, 0

        def on_step_begin(self, args_, state, control, **kwargs):
            _sync(args.device)
            self.mark = len(_TRL_TIMERS)
            self.t0 = time.perf_counter()

        def on_step_end(self, args_, state, control, **kwargs):
            _sync(args.device)
            seconds = time.perf_counter() - self.t0
            phases = defaultdict(float)
            for name, d in _TRL_TIMERS[self.mark :]:
                phases[name.split(".", 1)[-1]] += d
            self.steps.append({"seconds": seconds, "phases": dict(phases)})

        def on_log(self, args_, state, control, logs=None, **kwargs):
            if logs and "completions/mean_length" in logs and self.steps:
                self.steps[-1]["tokens"] = logs["completions/mean_length"] * P * G
                self.steps[-1]["reward"] = logs.get("reward")

    timer = StepTimer()
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward_lower,
        args=config,
        train_dataset=dataset,
        processing_class=tok,
        callbacks=[timer],
    )
    trainer.remove_callback(PrinterCallback)  # no log lines on stdout
    if args.threads:
        torch.set_num_threads(args.threads)
    trainer.train()
    return timer.steps[args.warmup :]


# --- report ----------------------------------------------------------------------------------------


def _sync(device: str) -> None:
    if device.startswith("cuda") and torch.cuda.is_available():
        torch.cuda.synchronize()


def machine() -> dict:
    cpu = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info = {
        "cpu": cpu,
        "logical_cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "platform": platform.platform(),
        "python": platform.python_version(),
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for pkg in ("flowgrpo", "torch", "transformers", "trl", "accelerate", "datasets", "peft"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = None
    return out


def summarize(steps: list[dict]) -> dict:
    secs = [s["seconds"] for s in steps]
    toks = [s.get("tokens", float("nan")) for s in steps]
    phases = defaultdict(list)
    for s in steps:
        for k, v in s["phases"].items():
            phases[k].append(v)
    return {
        "measured_steps": len(steps),
        "seconds_per_step_median": statistics.median(secs),
        "seconds_per_step_mean": statistics.fmean(secs),
        "seconds_per_step_min": min(secs),
        "seconds_per_step_max": max(secs),
        "tokens_per_step_mean": statistics.fmean(toks),
        "tokens_per_second": sum(toks) / sum(secs),
        "phases_mean_seconds": {k: statistics.fmean(v) for k, v in sorted(phases.items())},
        "steps": steps,
    }


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
        f"{cfg['max_new_tokens']} tokens, loss `{cfg['loss']}`, no KL, 1 optimizer step, fp32; "
        f"{cfg['rounds']} rounds x {cfg['steps']} measured steps after {cfg['warmup']} warm-up step(s) per round",
        "",
        "| model | trainer | s/step (median) | s/step (mean) | tokens/s | TRL / this (median s/step) |",
        "|---|---|---|---|---|---|",
    ]
    for size, runs in result["results"].items():
        params = result["params"][size]
        trl = runs["trl"]["seconds_per_step_median"]
        for name, label in (
            ("ours_matched", "ours (matched)"),
            ("ours_default", "ours (default, + on-policy check)"),
            ("ours_plain", "ours (matched, shared prompt off)"),
            ("trl", "TRL GRPOTrainer"),
        ):
            r = runs[name]
            ratio = trl / r["seconds_per_step_median"]
            lines.append(
                f"| {size} ({params / 1e6:.2f} M) | {label} | {r['seconds_per_step_median']:.3f} | "
                f"{r['seconds_per_step_mean']:.3f} | {r['tokens_per_second']:.0f} | "
                f"{'-' if name == 'trl' else f'{ratio:.2f}x'} |"
            )
    lines += ["", "Where the time goes (mean seconds per measured step):", ""]
    for size, runs in result["results"].items():
        for name in ("ours_matched", "ours_default", "ours_plain", "trl"):
            phases = runs[name]["phases_mean_seconds"]
            if name == "trl":  # the nested timers TRL reports that say most
                keep = [
                    k
                    for k in phases
                    if k in ("_prepare_inputs", "transformers.generate", "compute_loss", "_calculate_rewards")
                ]
                phases = {k: phases[k] for k in keep}
            text = ", ".join(f"{k} {v:.3f}" for k, v in phases.items())
            lines.append(f"- {size}, {name}: step {runs[name]['seconds_per_step_mean']:.3f} = {text}")
    if result.get("notes"):
        lines += ["", *result["notes"]]
    return "\n".join(lines) + "\n"


def reading(results: dict, params: dict) -> list[str]:
    """The paragraph under the tables, from the numbers of this run."""
    out = ["Reading:", ""]
    for size, runs in results.items():
        m, d, pl, t = (runs[c] for c in ("ours_matched", "ours_default", "ours_plain", "trl"))
        gen_ours, gen_trl = (
            m["phases_mean_seconds"]["generate"],
            t["phases_mean_seconds"].get("transformers.generate", 0),
        )
        rest_trl = t["seconds_per_step_mean"] - t["phases_mean_seconds"].get("_prepare_inputs", 0)
        out.append(
            f"- {size} ({params[size] / 1e6:.2f} M parameters): ours {m['speedup_vs_trl']:.2f}x TRL's speed "
            f"(median s/step; {d['speedup_vs_trl']:.2f}x with the on-policy check). Generation is the same "
            f"`model.generate` in both ({gen_ours:.3f} vs {gen_trl:.3f} s, "
            f"{100 * gen_ours / m['seconds_per_step_mean']:.0f}% of our step). The update (forward + backward + "
            f"AdamW) takes {m['phases_mean_seconds']['train']:.3f} s in ours, "
            f"{pl['phases_mean_seconds']['train']:.3f} s with the shared-prompt forward off, and "
            f"{rest_trl:.3f} s in TRL (its step minus `_prepare_inputs`, which holds generation and scoring). "
            f"The on-policy check costs {d['phases_mean_seconds'].get('logprob', 0):.3f} s a step."
        )
    out += [
        "- So: where the model compute is the same (generation; the update with the shared-prompt forward off) "
        "the two trainers take the same time, and the difference is our update running each distinct prompt "
        "once per micro-batch instead of once per completion (the gain grows with prompt length and group "
        "size; here prompts are ~25 tokens, completions up to 64, G = 8) plus less per-step Python work "
        "(what separates the tiny model's rows).",
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


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", default="tiny,small", help=f"comma list of {sorted(SIZES)}")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--loss", default="dapo", choices=LOSSES)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--steps", type=int, default=6, help="measured steps per round")
    p.add_argument("--warmup", type=int, default=1, help="steps left out at the start of every round")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--device", default="cpu", help="cpu | cuda")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=str(ROOT / "docs" / "bench_text.json"))
    p.add_argument("--markdown", default=str(ROOT / "docs" / "benchmarks.md"))
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    _capture_trl_profiling()
    import logging

    import transformers

    transformers.logging.set_verbosity_error()
    logging.getLogger("flowgrpo").setLevel(logging.WARNING)

    load_before = [round(x, 2) for x in os.getloadavg()]
    results, params = {}, {}
    contenders = ["ours_matched", "ours_default", "ours_plain", "trl"]
    with tempfile.TemporaryDirectory() as tmp:
        for size in args.sizes.split(","):
            from flowgrpo.text.config import TinyModelConfig
            from flowgrpo.text.models import build_tiny_model, build_tiny_tokenizer

            tok = build_tiny_tokenizer()
            params[size] = sum(
                x.numel()
                for x in build_tiny_model(TinyModelConfig(**SIZES[size]), len(tok), tok.eos_token_id).parameters()
            )
            steps = {c: [] for c in contenders}
            for rnd in range(args.rounds):
                k = rnd % len(contenders)
                order = contenders[k:] + contenders[:k]
                for c in order:
                    out = Path(tmp) / f"{size}_{c}_{rnd}"
                    if c == "trl":
                        steps[c] += run_trl(args, size, out)
                    else:
                        steps[c] += run_ours(args, size, c, out)
                    print(
                        f"[{size}] round {rnd + 1}/{args.rounds} {c}: "
                        f"{statistics.median(s['seconds'] for s in steps[c][-args.steps :]):.3f} s/step",
                        flush=True,
                    )
            results[size] = {c: summarize(steps[c]) for c in contenders}
    load_after = [round(x, 2) for x in os.getloadavg()]
    result = {
        "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M"),
        "argv": " ".join(sys.argv[1:] if argv is None else argv),
        "config": {k: v for k, v in vars(args).items() if k not in ("json", "markdown")},
        "machine": machine(),
        "versions": versions(),
        "params": params,
        "load_before": load_before,
        "load_after": load_after,
        "results": results,
    }
    for runs in results.values():
        for c in ("ours_matched", "ours_default", "ours_plain"):
            runs[c]["speedup_vs_trl"] = runs["trl"]["seconds_per_step_median"] / runs[c]["seconds_per_step_median"]
    result["notes"] = reading(results, params)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    write_section(Path(args.markdown), markdown(result))
    for size, runs in results.items():
        print(
            f"{size}: TRL / ours (matched) = {runs['ours_matched']['speedup_vs_trl']:.2f}x, "
            f"TRL / ours (default) = {runs['ours_default']['speedup_vs_trl']:.2f}x"
        )
    return result


if __name__ == "__main__":
    main()
