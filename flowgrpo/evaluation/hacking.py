"""The report's "Reward-hacking indicators" section: the image statistics of flowgrpo/t2i/image_stats.py over a run's
images (saturation, clipped pixels, grid8 / grid16 and high-frequency energy; diversity over the images of each
prompt; of a video its middle frame), the baseline's beside them in a comparison, and, when the evaluated LoRA comes
from a training run, that run's monitor verdict (its monitor.json: the alarm, why it fired, the best-gold iteration).
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from pathlib import Path
from typing import Any, Optional

import numpy as np

from ..video_io import is_video, read_video
from .results import Run

MAX_SIDE = 256  # images are scored at most this large (longest side): statistics of the look, not of every pixel


def run_stats(run: Run) -> dict[str, float]:
    """Mean image statistics over a run's images; diversity over the prompts with two or more images."""
    import torch
    from PIL import Image

    from ..t2i.image_stats import GRID_PERIODS, group_diversity, image_stats

    groups: dict[str, list[torch.Tensor]] = defaultdict(list)
    sums: dict[str, list[float]] = defaultdict(list)
    for i, sample in enumerate(run.samples):
        try:
            if is_video(run.path(i)):  # a clip: the statistics of its middle frame
                frames = read_video(run.path(i))
                im = Image.fromarray(frames[len(frames) // 2])
            else:
                with Image.open(run.path(i)) as opened:
                    im = opened.convert("RGB")
            im.thumbnail((MAX_SIDE, MAX_SIDE))
            x = torch.from_numpy(np.asarray(im, dtype=np.float32) / 255.0).permute(2, 0, 1)[None]
        except (OSError, ValueError):  # unreadable (or an .mp4 without PyAV): left out
            continue
        for k, v in image_stats(x, 1).items():
            if k != "diversity":
                sums[k].append(v)
        groups[sample.prompt].append(x)
    out = {k: float(np.nanmean(v)) if v else math.nan for k, v in sums.items()}
    divs = []
    for images in groups.values():
        if len(images) > 1 and len({t.shape for t in images}) == 1:
            divs.append(float(group_diversity(torch.cat(images), len(images))[0]))
    out["diversity"] = float(np.mean(divs)) if divs else math.nan
    keys = ["saturation", "clipped", *(f"grid{p}" for p in GRID_PERIODS), "high_freq", "diversity"]
    return {k: out.get(k, math.nan) for k in keys}


def training_monitor(lora: Optional[str]) -> Optional[dict[str, Any]]:
    """The monitor.json of the training run a LoRA folder belongs to (run/lora, run/best_gold/lora, ...)."""
    if not lora:
        return None
    for folder in list(Path(lora).resolve().parents)[:3]:
        path = folder / "monitor.json"
        if path.is_file():
            try:
                data = json.loads(path.read_text(encoding="utf-8"))
            except (OSError, ValueError):
                return None
            return {
                "run": str(folder),
                "alarm": data.get("alarm"),
                "fired": data.get("fired"),
                "best_gold": data.get("best_gold"),
                "gold_scorers": data.get("gold_scorers"),
                "last_iteration": data.get("iteration"),
            }
    return None


def hacking_section(hacking: dict[str, Any], fmt: Any, escape: Any) -> str:
    """HTML of the section from the summary's `hacking` block."""
    runs = hacking.get("stats") or {}
    parts = [
        "<h3>Reward-hacking indicators</h3>",
        '<p class="meta">Image statistics (flowgrpo/t2i/image_stats.py): mean HSV saturation, share of clipped '
        "channel values, share of luma power on the 8 / 16-pixel grid lattice and above a quarter of the sampling "
        "rate, mean pairwise distance of a prompt's images (diversity). Over-saturation, clipping, grid energy "
        "and falling diversity are what reward hacking leaves behind.</p>",
    ]
    if runs:
        keys = list(next(iter(runs.values())))
        head = "<tr><th>run</th>" + "".join(f"<th>{escape(k)}</th>" for k in keys) + "</tr>"
        rows = [
            f"<tr><td>{escape(label)}</td>" + "".join(f"<td>{fmt(s.get(k))}</td>" for k in keys) + "</tr>"
            for label, s in runs.items()
        ]
        parts.append(f"<table>{head}{''.join(rows)}</table>")
    mon = hacking.get("training_monitor")
    if mon:
        fired = mon.get("fired")
        verdict = (
            f'<b class="down">alarm</b> at iteration {fired["iteration"]}: {escape("; ".join(fired["reasons"]))}'
            if fired
            else "no alarm"
        )
        best = mon.get("best_gold") or {}
        parts.append(
            f'<p class="meta">Training run {escape(mon["run"])} (monitor up to iteration {mon.get("last_iteration")}, '
            f"gold {escape(', '.join(mon.get('gold_scorers') or []) or 'none')}): {verdict}; best gold at "
            f"iteration {best.get('iteration')} ({escape(best.get('weights') or 'weights not saved')}).</p>"
        )
    return "".join(parts)


def hacking_summary(runs: list[Run], lora: Optional[str]) -> dict[str, Any]:
    """The summary's `hacking` block: each run's image statistics, the training run's monitor verdict."""
    return {"stats": {run.label: run_stats(run) for run in runs}, "training_monitor": training_monitor(lora)}
