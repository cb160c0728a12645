#!/usr/bin/env python
"""Our text GRPO trainer against TRL's GRPOTrainer: same tiny model, same prompts, same work per step.

    HF_HUB_OFFLINE=1 python scripts/bench_text.py                 # defaults below; CPU unless --device cuda
    HF_HUB_OFFLINE=1 python scripts/bench_text.py --steps 8 --rounds 3 --loss grpo

Both trainers run in this one process on a random Qwen2 built from a config (the byte-level tokenizer
of the tests: no download), with the same initial weights, prompts, reward function, group size,
completion length, sampling settings (temperature 1, no top-k / top-p), loss type, no KL, one
optimizer step per generation batch, one micro-batch, fp32. TRL runs offline: no hub, no vLLM,
report_to none, no gradient checkpointing unless --checkpointing turns it on in both, bf16 off (fp32 as ours).

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
left out. Reported: seconds per step (median and mean over measured steps; wall and the process's
CPU seconds), completion tokens per second, ours / TRL per round (< 1: ours is faster; the median
over rounds and the min-max: each round's two medians were taken minutes apart at most, so load
changes between rounds cancel out of the ratio; `--contenders` picks which of ours run), and where
the time goes in the same four phases for both (generate / logprob / reward / train: our phase
timers; TRL's own profiling timers, captured from `trl.extras.profiling`).

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
from bench_text_report import LABELS, markdown, reading, round_ratios, summarize, write_section  # noqa: E402

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
        f"iterations={args.warmup + args.steps}",
        f"seed={args.seed}",
        "model.name_or_path=tiny",
        f"model.device={args.device}",
        "model.tiny.max_position_embeddings=512",
        *[f"model.tiny.{k}={v}" for k, v in tiny.items()],
        "data.task={name: pattern, rows: 64}",
        "data.chat_template=false",
        f"prompts_per_iteration={P}",
        f"group_size={G}",
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
        f"train.gradient_checkpointing={str(args.checkpointing).lower()}",
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
        c0, t0 = time.process_time(), time.perf_counter()
        rec = trainer.train_iteration()
        _sync(args.device)
        seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
        if i >= args.warmup:
            steps.append(
                {
                    "seconds": seconds,
                    "cpu_seconds": cpu,
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
        activation_checkpointing=args.checkpointing,
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
            self.steps, self.t0, self.c0, self.mark = [], 0.0, 0.0, 0

        def on_step_begin(self, args_, state, control, **kwargs):
            _sync(args.device)
            self.mark = len(_TRL_TIMERS)
            self.c0, self.t0 = time.process_time(), time.perf_counter()

        def on_step_end(self, args_, state, control, **kwargs):
            _sync(args.device)
            seconds, cpu = time.perf_counter() - self.t0, time.process_time() - self.c0
            phases = defaultdict(float)
            for name, d in _TRL_TIMERS[self.mark :]:
                phases[name.split(".", 1)[-1]] += d
            self.steps.append({"seconds": seconds, "cpu_seconds": cpu, "phases": dict(phases)})

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
    p.add_argument(
        "--checkpointing",
        action="store_true",
        help="both trainers recompute each decoder layer in backward (ours: train.gradient_checkpointing, which "
        "turns the shared-prompt forward off; TRL: activation_checkpointing)",
    )
    p.add_argument(
        "--contenders",
        default="ours_matched,ours_default,ours_plain,trl",
        help="comma list of ours_matched, ours_default, ours_plain, trl (trl is always run)",
    )
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
    contenders = [c for c in LABELS if c in args.contenders.split(",") or c == "trl"]
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
            results[size] = {c: summarize(steps[c], trl=c == "trl") for c in contenders}
            for c in contenders:
                if c != "trl":
                    results[size][c]["ratio_vs_trl"] = {
                        kind: round_ratios(steps[c], steps["trl"], args.steps, key)
                        for kind, key in (("wall", "seconds"), ("cpu", "cpu_seconds"))
                    }
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
        for c in runs:
            if c != "trl":
                runs[c]["speedup_vs_trl"] = runs["trl"]["seconds_per_step_median"] / runs[c]["seconds_per_step_median"]
    result["notes"] = reading(results, params)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    write_section(Path(args.markdown), markdown(result))
    for size, runs in results.items():
        for c in runs:
            if c != "trl":
                w, cp = runs[c]["ratio_vs_trl"]["wall"], runs[c]["ratio_vs_trl"]["cpu"]
                print(
                    f"{size}: {c} / TRL = {w['median']:.2f}x wall ({w['min']:.2f}-{w['max']:.2f}), "
                    f"{cp['median']:.2f}x CPU ({cp['min']:.2f}-{cp['max']:.2f})"
                )
    return result


if __name__ == "__main__":
    main()
