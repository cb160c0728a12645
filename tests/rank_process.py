"""The ranks of `launch_ranks`, forked from multiprocessing's fork server instead of started from scratch.

Each rank of a test launch used to be a new interpreter that spent ~4 s of its ~7 s importing torch, diffusers,
transformers and peft. The fork server (one per test process) imports them once; every rank is then a fork of
it that runs the real script (`runpy`, as `python scripts/<script>` would) in its own OS process, with its own
environment, gloo process group and exit code. What stays a plain `python` process: `accelerate launch` runs,
tests/text's SIGKILL tests and every other subprocess of the tests.
"""

from __future__ import annotations

import multiprocessing
from multiprocessing import forkserver
import os
import runpy
import sys

# Imported once by the fork server: what both trainers import before their first step. Not DeepSpeed: its import
# sets up an accelerator and logging, which only the ZeRO launches should see.
PRELOAD = [
    "torchvision_cpu_hook",
    "flowgrpo",
    "flowgrpo.cli",
    "flowgrpo.t2i",
    "flowgrpo.text",
    "diffusers",
    "transformers",
    "peft",
    "accelerate",
    "rank_process",
]


def start_server() -> multiprocessing.context.ForkServerContext:
    """The fork server's context; the server starts (once per test process) with the environment the test
    process has now."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    forkserver.ensure_running()
    return ctx


def run_script(script: str, args: list[str], env: dict[str, str], stderr_path: str) -> None:
    """The body of one rank: `python <script> <args>` with `env`, stdout discarded, stderr into a file."""
    os.environ.clear()
    os.environ.update(env)
    if env.get("ACCELERATE_USE_DEEPSPEED") == "true":
        import ds_shm

        ds_shm.skip_shm_kernel()
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
    os.dup2(os.open(stderr_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), 2)
    sys.argv = [script, *args]
    runpy.run_path(script, run_name="__main__")  # the script's own sys.exit(code) ends the rank with its code


def run_cli_main(
    argv: list[str], env: dict[str, str], cwd: str, stdout_path: str, stderr_path: str, prelude: str = ""
) -> None:
    """The body of a forked `flowgrpo argv...` (tests/reliability/cli_helpers.py): its environment and folder,
    stdout and stderr into files, `prelude` (Python: a test's injected fault) run first, `main`'s return value as
    the exit code (an uncaught error: 1 and its traceback, as in a fresh interpreter)."""
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(os.open(stdout_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), 1)
    os.dup2(os.open(stderr_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), 2)
    if prelude:
        exec(compile(prelude, "<prelude>", "exec"), {"__name__": "__prelude__"})
    from flowgrpo.cli import main

    sys.argv = ["flowgrpo", *argv]
    sys.exit(main(list(argv)))
