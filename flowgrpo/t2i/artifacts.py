"""What a run leaves behind besides checkpoints: sample grids, the reward curve, trackers."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch

from ..metrics import read_metrics


def save_grid(images: torch.Tensor, path: Path, cols: int, max_images: int, prompts: Any = None) -> Path:
    """images [N, 3, H, W] in [0, 1] -> one PNG, `cols` per row (one group per row). `prompts` (one per row): rows of
    edit prompts start with their source image(s): source | edits (edit_data.with_sources)."""
    from diffusers.utils import make_image_grid
    from PIL import Image

    if prompts is not None:
        from .edit_data import with_sources

        images, wide = with_sources(images, prompts, cols)
        max_images, cols = -(-max_images // cols) * wide, wide

    images = images[:max_images].detach().float().clamp(0, 1)
    cols = max(1, min(cols, images.shape[0]))
    n = (images.shape[0] // cols) * cols or images.shape[0]
    arrays = (images[:n].permute(0, 2, 3, 1) * 255).round().to(torch.uint8).cpu().numpy()
    pils = [Image.fromarray(a) for a in arrays]
    path.parent.mkdir(parents=True, exist_ok=True)
    make_image_grid(pils, rows=max(1, n // cols), cols=cols if n >= cols else n).save(path)
    return path


def to_json(record: dict[str, Any]) -> str:
    return json.dumps(
        {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}, indent=2
    )


def plot_rewards(metrics_path: Path, out: Path) -> Path:
    """reward_mean (and each reward's mean) per iteration, with the reward std as a band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in read_metrics(metrics_path) if r.get("reward_mean") is not None]
    it = [r["iteration"] for r in rows]
    mean = [r["reward_mean"] for r in rows]
    std = [r.get("reward_std") or 0.0 for r in rows]
    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=120)
    ax.plot(it, mean, label="reward_mean", color="C0")
    ax.fill_between(
        it,
        [m - s for m, s in zip(mean, std)],
        [m + s for m, s in zip(mean, std)],
        color="C0",
        alpha=0.2,
        label="± reward_std",
    )
    ax.set_xlabel("iteration")
    ax.set_ylabel("reward")
    ax.grid(alpha=0.3)
    ax.legend(loc="best")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    plt.close(fig)
    return out


class Trackers:
    """tensorboard (default) and wandb (optional): scalars only."""

    def __init__(self, out: Path | None = None, cfg=None):
        self.tb = self.wandb = None
        if out is None or cfg is None:
            return
        if cfg.artifacts.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(log_dir=str(out / "tensorboard"))
        if cfg.artifacts.wandb:
            import wandb

            self.wandb = wandb.init(
                project=cfg.artifacts.wandb_project, config=cfg.model_dump(mode="json"), dir=str(out)
            )

    def log(self, record: dict[str, Any], step: int) -> None:
        scalars = {
            k: float(v)
            for k, v in record.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(float(v))
        }
        if self.tb is not None:
            for k, v in scalars.items():
                self.tb.add_scalar(k, v, step)
            self.tb.flush()
        if self.wandb is not None:
            self.wandb.log(scalars, step=step)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()
