"""Helpers for the evaluation tests: image folders with known scores, a tiny-model config, chromium."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def solid(folder: Path, name: str, rgb) -> Path:
    path = folder / name
    Image.new("RGB", (24, 16), tuple(int(c) for c in rgb)).save(path)
    return path


def noisy(folder: Path, name: str, seed: int, size=(40, 32)) -> Path:
    rng = np.random.default_rng(seed)
    scale = 0.2 + 0.8 * rng.random()
    array = (rng.random((size[1], size[0], 3)) * 255 * scale).astype(np.uint8)
    path = folder / name
    Image.fromarray(array).save(path)
    return path


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def gray_folder(folder: Path, items: list[tuple[str, int]], txt: bool = True) -> Path:
    """Solid grey images (brightness = level / 255) named f{i}.png, prompts in prompts.txt (file order)."""
    folder.mkdir(parents=True, exist_ok=True)
    for i, (_, level) in enumerate(items):
        solid(folder, f"f{i}.png", (level, level, level))
    if txt:
        (folder / "prompts.txt").write_text("\n".join(p for p, _ in items) + "\n", encoding="utf-8")
    return folder


def tiny_generate(prompts: Path, **over) -> dict:
    """A generate input for the tiny SD3 adapter: 32x32, 2 steps, CPU."""
    return {
        "model": "sd3",
        "tiny": True,
        "prompts": str(prompts),
        "images_per_prompt": 2,
        "num_steps": 2,
        "guidance_scale": 3.0,
        "height": 32,
        "width": 32,
        "batch_size": 2,
        "device": "cpu",
        **over,
    }


def chromium() -> str:
    """The headless browser; a test that needs it fails (never skips) without it."""
    name = os.environ.get("CHROMIUM", "/usr/bin/chromium")
    path = shutil.which(name) or (name if os.path.isfile(name) else None)
    if path is None:
        pytest.fail(
            f"chromium not found ({name}): install Debian's chromium (apt-get install chromium) to run "
            "the HTML report tests in a real headless browser"
        )
    return path


def run_chromium(args: list[str], profile: Path, timeout: float = 60) -> subprocess.CompletedProcess:
    cmd = [chromium(), *CHROMIUM_FLAGS, f"--user-data-dir={profile}", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
