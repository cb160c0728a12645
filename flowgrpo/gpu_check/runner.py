"""Command line of the GPU check: run every check, keep going past a failed one, write the report.

Where the report goes: a full run (CUDA, real sizes) from a checkout updates the committed page
docs/gpu_validation.md (+ .json) by default: that page is what the repository shows of a GPU. A `--tiny` run
measures nothing about a GPU and never writes into the source tree: it writes gpu_validation.md (+ .json) in the
working folder, or at `--out`; `--out` naming the committed page is refused. An installed (not checked-out)
package writes to the working folder in both modes.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional, Sequence

if TYPE_CHECKING:
    from .report import Section

# torch and the model libraries are imported in main(), after the arguments: `--help` and a refused --out are instant

CHECKS = ("sd35", "flux", "wan", "text", "vllm", "text_full")
_CHECKOUT = Path(__file__).resolve().parents[2]
# the checkout's committed report (a full run from the repository); an installed package writes to the working folder
DEFAULT_OUT = (
    _CHECKOUT / "docs" / "gpu_validation.md" if (_CHECKOUT / "pyproject.toml").is_file() else Path("gpu_validation.md")
)
TINY_OUT = Path("gpu_validation.md")  # a --tiny run: the working folder, never the source tree


def report_path(args: argparse.Namespace) -> tuple[Path, Optional[str]]:
    """(where the report goes, why it may not be written there or None)."""
    out = args.out if args.out is not None else (TINY_OUT if args.tiny else DEFAULT_OUT)
    if args.tiny:
        committed = (_CHECKOUT / "docs" / "gpu_validation.md").resolve()
        if out.resolve().with_suffix(".md") == committed:
            return out, (
                f"--tiny runs measure nothing about a GPU and never replace the committed report {committed}; "
                "leave out --out (the report goes to ./gpu_validation.md) or name another file"
            )
    return out, None


def parse(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="flowgrpo gpu-check", description="Validate the GPU path (real-size random models) and write a report."
    )
    p.add_argument("--tiny", action="store_true", help="tiny models on CPU (or --device): the same code, in seconds")
    p.add_argument(
        "--out",
        "--output",
        type=Path,
        default=None,
        help="markdown report, JSON written beside it (default: --tiny: ./gpu_validation.md; a full run from a "
        "checkout: the committed docs/gpu_validation.md; an installed package: ./gpu_validation.md)",
    )
    p.add_argument("--device", default=None, help="default: cuda when available, else cpu (tiny only)")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"), help="frozen weights (LoRA: fp32)")
    p.add_argument(
        "--peak-tflops", type=float, default=None, help="dense bf16 peak, when the device is not in the table"
    )
    p.add_argument("--skip", nargs="*", default=[], choices=CHECKS, help="checks to leave out")
    p.add_argument(
        "--no-compile", action="store_true", help="leave out the regional-compile variant of the SD3.5 check"
    )
    p.add_argument("--attention", default="native", help="diffusers attention backend (native = PyTorch SDPA)")
    p.add_argument("--decode-batch-size", type=int, default=4, help="VAE decode chunk (images)")
    p.add_argument(
        "--threads", type=int, default=None, help="torch CPU threads (1 on a shared CPU: no stalled barriers)"
    )
    return p.parse_args(argv)


def _run(sec_fn: Callable[[], "Section"], title: str, device: str) -> "Section":
    from .device import free
    from .report import Section

    t0 = time.perf_counter()
    try:
        sec = sec_fn()
    except Exception as err:  # one failed check must not lose the others' figures
        traceback.print_exc()
        sec = Section(title, error=f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}")
    try:
        free(device)  # the check's models are gone once it returns: give their memory back before the next
    except Exception as err:  # a CUDA error is sticky (illegal address): the report still gets written
        sec.notes.append(f"freeing device memory failed: {type(err).__name__}: {str(err).splitlines()[0]}")
    sec.seconds = time.perf_counter() - t0
    print(
        f"[gpu_check] {sec.title}: {sec.error or sec.skipped or 'done'} ({sec.seconds:.1f} s)",
        file=sys.stderr,
        flush=True,
    )
    return sec


def main(argv: Optional[Sequence[str]] = None, invoked_as: str = "python scripts/gpu_check.py") -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # random weights only: nothing is downloaded
    args = parse(argv)
    out, refused = report_path(args)
    if refused:
        print(f"gpu_check: {refused}", file=sys.stderr)
        return 2
    import torch

    from pipelines.speed import SpeedConfig

    from . import models
    from .device import describe
    from .image import flux_check, sd35_check
    from .report import Report, write
    from .text import text_check
    from .video import FULL as WAN_FULL
    from .video import TINY as WAN_TINY
    from .video import wan_check

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if not args.tiny and not device.startswith("cuda"):
        print(
            "gpu_check: no CUDA device here; the real-size check needs one (run with --tiny for the CPU smoke "
            "run of the same code)",
            file=sys.stderr,
        )
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    sizes = models.TINY if args.tiny else models.FULL
    dtype = getattr(torch, args.dtype)
    speed = SpeedConfig(attention_backend=args.attention, decode_batch_size=args.decode_batch_size)
    info = describe(device, args.peak_tflops)
    start = time.perf_counter()
    command = invoked_as + "".join(f" {shlex.quote(a)}" for a in (argv or sys.argv[1:]))
    report = Report(command=command, mode="tiny" if args.tiny else "full", info=info, sections=[], total_seconds=0.0)

    def check(fn: Callable[[], "Section"], title: str) -> None:
        report.sections.append(_run(fn, title, device))
        report.total_seconds = time.perf_counter() - start
        write(report, out)  # after every check: a run cut short (time limit, lost machine) keeps what it measured

    if "sd35" not in args.skip:
        check(lambda: sd35_check(sizes, info, dtype, speed, not args.no_compile), "SD3.5-Medium")
    if "flux" not in args.skip:
        check(lambda: flux_check(sizes, info, dtype, speed), "FLUX.1-dev")
    if "wan" not in args.skip:
        check(lambda: wan_check(WAN_TINY if args.tiny else WAN_FULL, info, dtype, speed), "Wan2.1-T2V-14B")
    for backend, key in (("transformers", "text"), ("vllm", "vllm")):
        if key not in args.skip:
            check(lambda b=backend: text_check(sizes, info, dtype, b), f"text ({backend})")
    if "text_full" not in args.skip:
        check(lambda: text_check(sizes, info, dtype, "transformers", full=True), "text full fine-tune")
    sections = report.sections
    json_path = write(report, out)
    print(f"[gpu_check] wrote {out} and {json_path} in {report.total_seconds:.0f} s", file=sys.stderr)
    return 1 if any(s.error for s in sections) else 0
