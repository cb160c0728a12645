"""Run the `flowgrpo` command in a fresh process, as a user would (optionally with torchvision hidden)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# a bare install has no torchvision (it is only in the `clip` extra): every path finder misses it
_HIDE_TORCHVISION = """
import importlib.machinery
_find = importlib.machinery.PathFinder.find_spec.__func__
def _hidden(cls, name, path=None, target=None):
    return None if name == "torchvision" or name.startswith("torchvision.") else _find(cls, name, path, target)
importlib.machinery.PathFinder.find_spec = classmethod(_hidden)
"""


def run_cli(
    *argv: str, cwd: Path, bare: bool = False, timeout: float = 600, env: dict | None = None
) -> subprocess.CompletedProcess:
    """`flowgrpo argv...` in `cwd`; returns the finished process (text stdout / stderr)."""
    code = (
        _HIDE_TORCHVISION if bare else ""
    ) + "import sys\nfrom flowgrpo.cli import main\nsys.exit(main(sys.argv[1:]))\n"
    full_env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT), **(env or {})}
    return subprocess.run(
        [sys.executable, "-c", code, *argv], cwd=cwd, env=full_env, capture_output=True, text=True, timeout=timeout
    )
