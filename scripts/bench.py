#!/usr/bin/env python
"""What each tiny text-to-image recipe costs: denoiser rows, backward passes, reward calls, time per phase.

    HF_HUB_OFFLINE=1 python scripts/bench.py                       # all 14 tiny recipes, 3 iterations after 1 warm-up
    HF_HUB_OFFLINE=1 python scripts/bench.py --recipes flow_grpo,branchgrpo --iterations 1 --warmup 0
    HF_HUB_OFFLINE=1 python scripts/bench.py --gpu                 # SD3.5-M-sized random transformer, 512 px (CUDA)
    python scripts/bench.py --gpu-render docs/bench_t2i_gpu.json   # re-write the GPU section from a saved run
    HF_HUB_OFFLINE=1 python scripts/bench.py --to-reward-rise 0.005 # each recipe's counts / time to reach a reward
    HF_HUB_OFFLINE=1 python scripts/bench.py --recipes draft_lv --published none --merge  # re-measure some rows only

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

The parts, one module each under scripts/bench_t2i/: probes (the timing hooks), closed_form (the expected
counts), recipes (one recipe), published (the published settings), gpu (GPU mode), report (JSON / markdown),
to_reward (the compute-normalised comparison).

--to-reward R / --to-reward-rise D: instead, train every recipe (same seed) until its rollout reward (a running
mean) first reaches R, or its own first-iteration reward + D, and report the iterations, counted denoiser rows,
backward passes, reward calls and seconds it took; writes docs/bench_t2i_to_reward.json and the section
"## Compute to reach a reward (tiny models, CPU)".

--merge: run only --recipes and put their rows into the recorded JSON (the other rows, the header and the published
part are kept; the rerun's date, git, load and command are listed as "re-measured" in the section), then re-write
the section from it: for a recipe added or changed since the last full run.

Writes --json (docs/bench_t2i.json) and the section "## Text-to-image recipes (tiny models, CPU)" of
--markdown (docs/benchmarks.md, created with "# Benchmarks" if missing; other sections are kept). --gpu writes
docs/bench_t2i_gpu.json and the section "## Text-to-image on GPU (...)" instead.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from scripts.bench_t2i.gpu import GPU_SECTION, bench_gpu, gpu_markdown  # noqa: E402
from scripts.bench_t2i.published import PUBLISHED, bench_published  # noqa: E402
from scripts.bench_t2i.recipes import RECIPES, bench_recipe  # noqa: E402
from scripts.bench_t2i.report import (  # noqa: E402,F401
    SECTION,
    git_state,
    load_gpu,
    machine,
    markdown,
    merge_run,
    remeasured_lines,
    versions,
    write_section,
)
from scripts.bench_t2i.to_reward import SECTION as TO_REWARD_SECTION  # noqa: E402
from scripts.bench_t2i.to_reward import bench_to_reward, to_reward_markdown  # noqa: E402

# --- main ------------------------------------------------------------------------------------------


def _json_default(obj):
    if hasattr(obj, "item"):
        return obj.item()
    return str(obj)


def _run_worker(kind: str, names: str, args, tmp: Path) -> dict:
    """Run one worker in its own process (or in this one with --in-process); its result dict."""
    if args.in_process:
        return _work(kind, names, args)
    out = tmp / f"{kind}_{names.replace(',', '_')}.json"
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--worker",
        f"{kind}:{names}",
        "--worker-out",
        str(out),
        "--iterations",
        str(args.iterations),
        "--warmup",
        str(args.warmup),
        "--num-threads",
        str(args.num_threads),
        "--out-dir",
        str(args.out_dir),
        *(_to_reward_argv(args) if kind == "reward" else []),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0 or not out.exists():
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        raise RuntimeError(f"worker {kind}:{names} exited with {proc.returncode}: {tail[0]}")
    if proc.stderr.strip():
        sys.stderr.write(proc.stderr)
    return json.loads(out.read_text())


def _to_reward_argv(args) -> list[str]:
    out = ["--to-reward-max-iterations", str(args.to_reward_max_iterations)]
    out += ["--to-reward-window", str(args.to_reward_window)]
    if args.to_reward is not None:
        return out + ["--to-reward", str(args.to_reward)]
    return out + ["--to-reward-rise", str(args.to_reward_rise)]


def _work(kind: str, names: str, args) -> dict:
    if kind == "recipe":
        return bench_recipe(names, args)
    if kind == "reward":
        return bench_to_reward(names, args)
    return bench_published(names.split(","), args)


def _to_reward(args, result: dict, tmp: Path) -> dict:
    """Every recipe until it reaches the target: docs/bench_t2i_to_reward.json and its markdown section."""
    result["settings"].update(
        {k: getattr(args, k) for k in ("to_reward", "to_reward_rise", "to_reward_window", "to_reward_max_iterations")}
    )
    result["to_reward"] = {}
    for name in [r for r in args.recipes.split(",") if r]:
        try:
            res = _run_worker("reward", name, args, tmp)
            at = res["reached_at"] or f"not reached in {res['iterations_run']}"
            print(f"{name}: {at} iterations, {res['cpu_s']:.1f} CPU s", file=sys.stderr, flush=True)
        except Exception as err:  # keep going: one broken recipe must not hide the others
            res = {"recipe": name, "error": f"{type(err).__name__}: {err}"}
            print(f"{name}: FAILED {res['error']}", file=sys.stderr, flush=True)
        result["to_reward"][name] = res
    result["load_after"] = [round(x, 2) for x in os.getloadavg()]
    path = (
        Path(args.json)
        if args.json != str(ROOT / "docs" / "bench_t2i.json")
        else ROOT / "docs" / "bench_t2i_to_reward.json"
    )
    if args.merge:
        result = merge_run(json.loads(path.read_text()), result, "to_reward", list(RECIPES))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1, default=_json_default) + "\n")
    write_section(Path(args.markdown), to_reward_markdown(result), TO_REWARD_SECTION)
    return result


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--recipes", default=",".join(RECIPES), help="comma list of configs/t2i/tiny recipes")
    p.add_argument("--iterations", type=int, default=3, help="measured iterations per recipe")
    p.add_argument("--warmup", type=int, default=1, help="iterations run first and left out")
    p.add_argument("--num-threads", type=int, default=1, help="torch CPU threads of each run")
    p.add_argument(
        "--published",
        default=",".join(PUBLISHED),
        help=f"published-settings comparisons to run (comma list of {list(PUBLISHED)}, or 'none')",
    )
    p.add_argument("--out-dir", default=None, help="run folders (default: a temporary folder, removed after)")
    p.add_argument("--json", default=str(ROOT / "docs" / "bench_t2i.json"))
    p.add_argument("--markdown", default=str(ROOT / "docs" / "benchmarks.md"))
    p.add_argument(
        "--merge",
        action="store_true",
        help="run only --recipes and merge their rows into the recorded --json (and its section)",
    )
    p.add_argument(
        "--in-process",
        action="store_true",
        help="run every recipe in this process (faster start; peak memory is then cumulative)",
    )
    t = p.add_argument_group("compute to reach a reward (instead of the count part)")
    t.add_argument("--to-reward", type=float, default=None, help="target: this absolute rollout reward")
    t.add_argument(
        "--to-reward-rise", type=float, default=None, help="target: the recipe's first-iteration reward + this"
    )
    t.add_argument("--to-reward-window", type=int, default=3, help="running mean over this many iterations")
    t.add_argument("--to-reward-max-iterations", type=int, default=40, help="stop here if never reached")
    g = p.add_argument_group("GPU mode (first run: H200, docs/bench_t2i_gpu.json)")
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
    g.add_argument(
        "--gpu-render",
        default=None,
        metavar="JSON",
        help="no run: re-write the GPU section of --markdown from a saved --gpu JSON (e.g. docs/bench_t2i_gpu.json)",
    )
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--worker-out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.iterations < 1 or args.warmup < 0:
        p.error("--iterations must be >= 1 and --warmup >= 0")
    if args.to_reward is not None and args.to_reward_rise is not None:
        p.error("--to-reward and --to-reward-rise: give one target, not both")
    if args.to_reward_window < 1 or args.to_reward_max_iterations < 1:
        p.error("--to-reward-window and --to-reward-max-iterations must be >= 1")

    if args.gpu_render:  # the section from a recorded run (e.g. after the JSON's metadata was corrected)
        saved = json.loads(Path(args.gpu_render).read_text())
        if "gpu" not in saved:
            p.error(f"--gpu-render {args.gpu_render}: not a --gpu JSON (no 'gpu' key); valid: what --gpu --json wrote")
        write_section(Path(args.markdown), gpu_markdown(saved), GPU_SECTION)
        return saved

    if args.worker:  # child process: one recipe or the published settings
        kind, names = args.worker.split(":", 1)
        res = _work(kind, names, args)
        res.pop("trainer", None)
        Path(args.worker_out).write_text(json.dumps(res, default=_json_default))
        return res

    command = "python scripts/bench.py" + (
        " " + shlex.join(sys.argv[1:] if argv is None else argv) if (sys.argv[1:] if argv is None else argv) else ""
    )
    with tempfile.TemporaryDirectory(prefix="bench_t2i_") as tmp:
        if args.out_dir is None:
            args.out_dir = str(Path(tmp) / "runs")
        result: dict[str, Any] = {
            "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M"),
            "command": command,
            "settings": {
                k: getattr(args, k)
                for k in ("recipes", "iterations", "warmup", "num_threads", "published", "in_process")
            },
            "machine": machine(args.num_threads, args.gpu_device if args.gpu else None),
            "versions": versions(),
            "git": git_state(),
            "load_before": [round(x, 2) for x in os.getloadavg()],
        }
        if args.to_reward is not None or args.to_reward_rise is not None:
            return _to_reward(args, result, Path(tmp))
        if args.gpu:
            result["gpu"] = bench_gpu(args)
            result["gpu"]["iterations"] = [{k: v for k, v in r.items()} for r in result["gpu"]["iterations"]]
            result["load_after"] = [round(x, 2) for x in os.getloadavg()]
            path = (
                Path(args.json)
                if args.json != str(ROOT / "docs" / "bench_t2i.json")
                else ROOT / "docs" / "bench_t2i_gpu.json"
            )
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
                print(
                    f"{name}: {s['per_image']['fwd_nograd']:.3f} no-grad / {s['per_image']['fwd_grad']:.3f} grad "
                    f"rows per image, {s['seconds_per_iteration_median']:.3f} s/it "
                    f"({'matches' if s['counts_match_closed_form'] else 'DIFFERS FROM'} the closed form; "
                    f"{time.perf_counter() - t0:.1f} s)",
                    file=sys.stderr,
                    flush=True,
                )
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
    if args.merge:
        result = merge_run(json.loads(Path(args.json).read_text()), result, "recipes", list(RECIPES))
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=1, default=_json_default) + "\n")
    write_section(Path(args.markdown), markdown(result, load_gpu()))
    return result


if __name__ == "__main__":
    main()
