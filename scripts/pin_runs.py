#!/usr/bin/env python
"""Pinned short runs: every tiny recipe's metrics and final weights, to show a refactor changes no behaviour.

    python scripts/pin_runs.py --check                  # run them all, compare with tests/fidelity/pinned_runs.json
    python scripts/pin_runs.py --write                  # regenerate that file (from the code you mean to pin)
    python scripts/pin_runs.py --check --only flow_grpo tiny_pattern

Runs (in this process, one CPU thread each): every image recipe configs/t2i/tiny/*.yaml, configs/t2i/demo.yaml
and the CPU text config configs/text/tiny_pattern.yaml (configs/text/smollm2_arithmetic.yaml needs a 135M
model from an extra package: not pinned), each for the few iterations that still run what sets it apart
(RUNS below: >= 2 optimizer steps; 3 iterations where a sliding window shifts every 2; 4 for Adv-GRPO's
alternating discriminator / policy iterations).

Fingerprint of a run: every numeric value of every returned metrics record (and of eval_final.json) except
timing and memory (TIMING), floats as exact reprs; and for every weight file at the end of the run (the
exported final model: lora/, lora_ema/ or final/, in their library's format; the final checkpoint's
tensors.<group>.safetensors) the sha256 of its tensors (name, dtype, shape, bytes, in name order) and their
float64 sum, absolute sum and L2 norm.

Comparison: bit-exact (equal floats, equal hashes) where the platform (torch, python, CPU model, avx512)
equals the recorded one; elsewhere metrics within rtol 1e-4 (atol 1e-5: values that are rounding noise
around 0) and each weight group's norm / absolute sum within rtol 1e-4 (its sum within 1e-4 x abs sum).
Metrics a run adds beyond the pinned ones are listed, not failed.

To pin the code before a refactor, run this script against a worktree of that commit:
    git worktree add /tmp/pin_base HEAD
    PYTHONPATH=/tmp/pin_base python scripts/pin_runs.py --root /tmp/pin_base --write
(--root: the configs and the flowgrpo package that must be the one imported; default: this checkout).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

ROOT = Path(__file__).resolve().parents[1]
PINNED = ROOT / "tests" / "fidelity" / "pinned_runs.json"
RTOL = 1e-4
ATOL = 1e-5
TIMING = re.compile(r"(^|/)time_|per_second|peak_memory|_seconds?$|wall")


@dataclass(frozen=True)
class Run:
    kind: str  # "t2i" or "text"
    config: str  # relative to the root
    overrides: tuple[str, ...]


# quiet, one thread, no side outputs; checkpoint only at the end; the final model exported
T2I_COMMON = (
    "progress=false",
    "num_threads=1",
    "artifacts.tensorboard=false",
    "artifacts.plot=false",
    "checkpoint.every=0",
    "checkpoint.keep_last=1",
    "checkpoint.save_final_model=true",
)
TEXT_COMMON = (
    "progress=false",
    "num_threads=1",
    "checkpoint.every=0",
    "checkpoint.keep_last=1",
    "checkpoint.save_final_model=true",
)
T2I_ITERATIONS = {
    "mixgrpo": 3,  # progressive window, iters_per_shift 2: iteration 3 trains the shifted window
    "mixgrpo_flash": 3,
    "branchgrpo_mix": 3,  # mix_iters_per_shift 2
    "adv_grpo": 4,  # d_times 2: discriminator, policy, discriminator, policy
}


def _runs() -> dict[str, Run]:
    names = [
        "adv_grpo", "branchgrpo", "branchgrpo_mix", "dance_grpo", "diffusion_nft", "flow_grpo", "flow_grpo_fast",
        "grpo_guard", "mixgrpo", "mixgrpo_flash", "pref_grpo", "tempflow_grpo", "tp_grpo", "vgpo",
    ]  # fmt: skip
    runs = {
        name: Run("t2i", f"configs/t2i/tiny/{name}.yaml", (f"iterations={T2I_ITERATIONS.get(name, 2)}", *T2I_COMMON))
        for name in names
    }
    runs["demo"] = Run("t2i", "configs/t2i/demo.yaml", ("iterations=2", *T2I_COMMON))
    runs["tiny_pattern"] = Run("text", "configs/text/tiny_pattern.yaml", ("iterations=2", *TEXT_COMMON))
    return runs


RUNS = _runs()


# --- platform ---------------------------------------------------------------------------------------------


def platform_fingerprint() -> dict[str, Any]:
    import torch

    cpu, flags = platform.processor() or platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                cpu = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
            if cpu and flags:
                break
    except OSError:
        pass
    return {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpu": cpu,
        "avx512": any(f.startswith("avx512") for f in flags),
        "machine": platform.machine(),
    }


# --- one run ----------------------------------------------------------------------------------------------


def _number(v: Any) -> Any:
    """An int stays an int; a float becomes its exact repr ("nan", "inf" included); anything else: None."""
    if isinstance(v, bool):
        return int(v)
    if isinstance(v, int):
        return v
    try:
        import numpy as np
        import torch

        if isinstance(v, (np.integer,)):
            return int(v)
        if isinstance(v, np.floating):
            return repr(float(v))
        if isinstance(v, torch.Tensor) and v.numel() == 1:
            v = v.item()
            return v if isinstance(v, int) and not isinstance(v, bool) else repr(float(v))
    except ImportError:
        pass
    if isinstance(v, float):
        return repr(v)
    return None


def _metrics(record: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for k, v in sorted(record.items()):
        if TIMING.search(k):
            continue
        n = _number(v)
        if n is not None:
            out[k] = n
    return out


def _tensor_group(path: Path) -> dict[str, Any]:
    import torch
    from safetensors.torch import load_file

    tensors = load_file(str(path))
    h = hashlib.sha256()
    total = abs_total = sq = 0.0
    numel = 0
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        if t.is_floating_point() or t.is_complex():
            d = t.to(torch.float64)
            total += float(d.sum())
            abs_total += float(d.abs().sum())
            sq += float((d * d).sum())
        numel += t.numel()
    return {
        "sha256": h.hexdigest(),
        "tensors": len(tensors),
        "numel": numel,
        "sum": repr(total),
        "abs_sum": repr(abs_total),
        "norm": repr(math.sqrt(sq)),
    }


def _weights(out: Path) -> dict[str, dict[str, Any]]:
    groups = {}
    for f in sorted(out.rglob("*.safetensors")):
        rel = f.relative_to(out)
        if rel.parts[0] == "checkpoints":
            continue
        groups[rel.as_posix()] = _tensor_group(f)
    steps = sorted((out / "checkpoints").glob("step_*"))
    if steps:
        for f in sorted(steps[-1].glob("tensors.*.safetensors")):
            groups[f"checkpoint/{f.name}"] = _tensor_group(f)
    return groups


def run_one(name: str, root: Path, workdir: Path) -> dict[str, Any]:
    """Train run `name` from the configs under `root`, writing under `workdir`; its fingerprint."""
    import torch

    spec = RUNS[name]
    out = workdir / name
    overrides = [f"output_dir={out}", *spec.overrides]
    threads = torch.get_num_threads()
    t0 = time.perf_counter()
    try:
        if spec.kind == "t2i":
            from flowgrpo.t2i import load_t2i_config, train_t2i

            history = train_t2i(load_t2i_config(root / spec.config, overrides))
        else:
            from flowgrpo.text import load_text_config, train_text

            history = train_text(load_text_config(root / spec.config, overrides))
    finally:
        torch.set_num_threads(threads)
    records = [_metrics(r) for r in history]
    final_eval = out / "eval_final.json"
    if final_eval.is_file():
        records.append({"eval_final": 1, **_metrics(json.loads(final_eval.read_text()))})
    return {
        "config": spec.config,
        "overrides": list(spec.overrides),
        "records": records,
        "weights": _weights(out),
        "seconds": round(time.perf_counter() - t0, 2),
    }


# --- comparison -------------------------------------------------------------------------------------------


def _float(v: Any) -> float:
    return float(v)  # float("nan"), float("inf") and reprs alike


def _close(a: float, b: float, rtol: float = RTOL, atol: float = ATOL) -> bool:
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    return math.isclose(a, b, rel_tol=rtol, abs_tol=atol)


def compare(pinned: dict[str, Any], now: dict[str, Any], exact: bool) -> tuple[list[str], list[str]]:
    """(problems, notes) of a run's fingerprint against the pinned one."""
    problems, notes = [], []
    if list(pinned["overrides"]) != list(now["overrides"]):
        problems.append(f"overrides differ: pinned {pinned['overrides']} now {now['overrides']}")
    if len(pinned["records"]) != len(now["records"]):
        problems.append(f"{len(now['records'])} records, pinned {len(pinned['records'])}")
    for i, (p, n) in enumerate(zip(pinned["records"], now["records"])):
        for k, pv in p.items():
            if k not in n:
                problems.append(f"record {i + 1}: {k} missing")
                continue
            nv = n[k]
            if isinstance(pv, int) and isinstance(nv, int):
                same = pv == nv
            elif exact:
                same = isinstance(pv, str) and isinstance(nv, str) and (pv == nv)
            else:
                same = _close(_float(pv), _float(nv))
            if not same:
                problems.append(f"record {i + 1}: {k} = {nv}, pinned {pv}")
        extra = sorted(set(n) - set(p))
        if extra:
            notes.append(f"record {i + 1}: new metrics {extra}")
    for g, pw in pinned["weights"].items():
        nw = now["weights"].get(g)
        if nw is None:
            problems.append(f"weights {g} missing")
            continue
        if (pw["tensors"], pw["numel"]) != (nw["tensors"], nw["numel"]):
            problems.append(
                f"weights {g}: {nw['tensors']} tensors / {nw['numel']} values, pinned {pw['tensors']} / {pw['numel']}"
            )
        elif exact:
            if pw["sha256"] != nw["sha256"]:
                problems.append(f"weights {g}: sha256 differs (norm {nw['norm']}, pinned {pw['norm']})")
        else:
            scale = _float(pw["abs_sum"])
            ok = (
                _close(_float(pw["norm"]), _float(nw["norm"]), atol=0)
                and _close(_float(pw["abs_sum"]), _float(nw["abs_sum"]), atol=0)
                and abs(_float(pw["sum"]) - _float(nw["sum"])) <= RTOL * scale
            )
            if not ok:
                problems.append(f"weights {g}: norm {nw['norm']} abs_sum {nw['abs_sum']} sum {nw['sum']}, pinned "
                                f"{pw['norm']} {pw['abs_sum']} {pw['sum']}")  # fmt: skip
    extra = sorted(set(now["weights"]) - set(pinned["weights"]))
    if extra:
        notes.append(f"new weight files {extra}")
    return problems, notes


def load_pinned(path: Path = PINNED) -> dict[str, Any]:
    return json.loads(path.read_text())


# --- command line -----------------------------------------------------------------------------------------


def _check_import(root: Path) -> None:
    import flowgrpo

    here = Path(flowgrpo.__file__).resolve().parent
    if here != (root / "flowgrpo").resolve():
        sys.exit(f"flowgrpo is imported from {here}, not from --root {root}: set PYTHONPATH={root}")


def _git_head(root: Path) -> str | None:
    try:
        return subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write", action="store_true", help="regenerate the pinned file")
    mode.add_argument("--check", action="store_true", help="compare with the pinned file")
    ap.add_argument(
        "--root", type=Path, default=ROOT, help="checkout whose configs and flowgrpo run (default: this one)"
    )
    ap.add_argument("--file", type=Path, default=PINNED, help=f"pinned file (default: {PINNED.relative_to(ROOT)})")
    ap.add_argument("--only", nargs="+", choices=sorted(RUNS), help="these runs only")
    ap.add_argument("--reverse", action="store_true", help="run in reverse order (order independence)")
    args = ap.parse_args(argv)
    root = args.root.resolve()
    _check_import(root)
    import torch

    torch.set_num_threads(1)
    names = args.only or sorted(RUNS)
    if args.reverse:
        names = names[::-1]
    plat = platform_fingerprint()
    pinned = None if args.write else load_pinned(args.file)
    exact = pinned is not None and pinned["platform"] == plat
    results, failed = {}, 0
    if pinned is not None:
        print(f"comparison: {'exact (same platform)' if exact else 'tolerant (platform differs: rtol 1e-4)'}")
        print(f"{'run':16} {'status':6} {'records':>7} {'metrics':>8} {'weights':>7} {'seconds':>7}  first problem")
    with tempfile.TemporaryDirectory(prefix="pin_runs_") as tmp:
        for name in names:
            try:
                fp = run_one(name, root, Path(tmp))
            except Exception as err:  # one broken run must not hide the others' results
                print(f"{name:16} {'ERROR':6} {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}")
                traceback.print_exc()
                failed += 1
                continue
            results[name] = fp
            if pinned is None:
                print(f"{name:16} {len(fp['records'])} records, {len(fp['weights'])} weight files, {fp['seconds']} s",
                      flush=True)  # fmt: skip
                continue
            if name not in pinned["runs"]:
                print(f"{name:16} {'NEW':6} (not pinned)")
                failed += 1
                continue
            problems, notes = compare(pinned["runs"][name], fp, exact)
            failed += bool(problems)
            n_metrics = sum(len(r) for r in fp["records"])
            print(f"{name:16} {'FAIL' if problems else 'ok':6} {len(fp['records']):>7} {n_metrics:>8} "
                  f"{len(fp['weights']):>7} {fp['seconds']:>7}  {problems[0] if problems else ''}", flush=True)  # fmt: skip
            for line in problems[1:6] + notes[:3]:
                print(f"{'':16} {line}")
    if args.write:
        pinned_all = load_pinned(args.file)["runs"] if (args.only and args.file.is_file()) else {}
        pinned_all.update(results)
        for fp in pinned_all.values():
            fp.pop("seconds", None)
        doc = {
            "about": "scripts/pin_runs.py: short runs of every tiny recipe; regenerate with --write",
            "source_commit": _git_head(root),
            "platform": plat,
            "runs": dict(sorted(pinned_all.items())),
        }
        args.file.parent.mkdir(parents=True, exist_ok=True)
        args.file.write_text(json.dumps(doc, indent=1, sort_keys=False) + "\n")
        print(f"wrote {args.file} ({len(pinned_all)} runs)")
        return 0
    print(f"{len(names) - failed}/{len(names)} runs match")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
