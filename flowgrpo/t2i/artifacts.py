"""What a run leaves behind besides checkpoints: sample grids, the reward curve, trackers."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..metrics import read_metrics
from ..video_io import DEFAULT_FPS, gif_bytes, is_video, read_video, write_video

# A video grid's longest side: 64 clips of 480 x 832 tile to 3840 x 6656 pixels per frame, more than a browser plays
# (and 81 such frames held at once); larger grids are shrunk to this.
VIDEO_GRID_MAX_SIDE = 1920


def save_grid(
    images: torch.Tensor, path: Path, cols: int, max_images: int, prompts: Any = None, fps: int = DEFAULT_FPS
) -> Path:
    """images [N, 3, H, W] in [0, 1] -> one PNG, `cols` per row (one group per row). `prompts` (one per row): rows of
    edit prompts start with their source image(s): source | edits (edit_data.with_sources).

    Clips [N, F, 3, H, W] (a video family's decode) -> one video of the same tiling, frame by frame, written beside
    `path` with its stem: `.mp4` (PyAV) or animated `.webp` (flowgrpo.video_io), `fps` frames per second, shrunk to
    at most VIDEO_GRID_MAX_SIDE pixels. Returns the path written."""
    if images.ndim == 5:
        frames = []
        for f in range(images.shape[1]):
            grid = _grid(images[:, f], cols, max_images, prompts).convert("RGB")
            grid.thumbnail((VIDEO_GRID_MAX_SIDE, VIDEO_GRID_MAX_SIDE))  # only ever shrinks
            frames.append(np.asarray(grid))
        return write_video(np.stack(frames), path, fps)
    if images.ndim != 4:
        raise ValueError(f"save_grid takes images [N, 3, H, W] or clips [N, F, 3, H, W], got {tuple(images.shape)}")
    grid = _grid(images, cols, max_images, prompts)
    path.parent.mkdir(parents=True, exist_ok=True)
    grid.save(path)
    return path


def _grid(images: torch.Tensor, cols: int, max_images: int, prompts: Any) -> Any:
    """The PIL grid of images [N, 3, H, W] (save_grid's tiling)."""
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
    return make_image_grid(pils, rows=max(1, n // cols), cols=cols if n >= cols else n)


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
    """tensorboard (default) and wandb (optional): scalars (`log`) and eval images / videos (`log_media`)."""

    def __init__(self, out: Path | None = None, cfg=None):
        self.tb = self.wandb = None
        self.out = out
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

    def log_media(self, tag: str, media: str | Path | torch.Tensor, step: int, fps: int = DEFAULT_FPS) -> None:
        """An image or a video under `tag`: a file save_grid wrote (PNG; MP4 / animated WebP) or a tensor, an image
        [3, H, W] or a clip [F, 3, H, W] in [0, 1]. tensorboard gets an image summary (a video as an animated GIF,
        which its Images tab plays; torch's add_video would need moviepy); wandb a wandb.Image / wandb.Video."""
        from PIL import Image

        path: Path | None = None
        if isinstance(media, torch.Tensor):
            if media.ndim not in (3, 4) or media.shape[-3] != 3:
                raise ValueError(f"log_media takes an image [3, H, W] or a clip [F, 3, H, W], got {tuple(media.shape)}")
            pixels = media.detach().float().clamp(0, 1).cpu()
        else:
            path = Path(media)
            if not path.is_file():
                raise FileNotFoundError(f"log_media: no file {path}")
            if is_video(path):
                pixels = torch.from_numpy(read_video(path)).permute(0, 3, 1, 2).float() / 255
            else:
                with Image.open(path) as im:
                    pixels = torch.from_numpy(np.asarray(im.convert("RGB")).copy()).permute(2, 0, 1).float() / 255
        if self.tb is not None:
            _tensorboard_media(self.tb, tag, pixels, step, fps)
        if self.wandb is not None:
            import wandb

            if pixels.ndim == 4:
                if path is None or path.suffix.lower() not in (".mp4", ".gif"):  # wandb.Video plays mp4 / gif files
                    name = f"{tag.replace('/', '_')}_{step:06d}.gif"
                    path = (self.out or Path(".")) / "media" / name
                    path.parent.mkdir(parents=True, exist_ok=True)
                    path.write_bytes(gif_bytes(pixels, fps, max_side=1 << 14)[0])
                self.wandb.log({tag: wandb.Video(str(path))}, step=step)
            else:
                array = (pixels.permute(1, 2, 0) * 255).round().to(torch.uint8).numpy()
                self.wandb.log({tag: wandb.Image(str(path) if path is not None else array)}, step=step)

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


def _tensorboard_media(writer: Any, tag: str, pixels: torch.Tensor, step: int, fps: int) -> None:
    """An image [3, H, W] as a PNG, a clip [F, 3, H, W] as an animated GIF: one image summary in the event file."""
    import io

    from PIL import Image
    from tensorboard.compat.proto.summary_pb2 import Summary

    if pixels.ndim == 4:
        data, h, w = gif_bytes(pixels, fps)
    else:
        im = Image.fromarray((pixels.permute(1, 2, 0) * 255).round().to(torch.uint8).numpy())
        buf = io.BytesIO()
        im.save(buf, format="PNG")
        data, h, w = buf.getvalue(), im.height, im.width
    image = Summary.Image(height=h, width=w, colorspace=3, encoded_image_string=data)
    # through the writer's own file writer (what its add_* methods use): add_video would need moviepy
    writer._get_file_writer().add_summary(Summary(value=[Summary.Value(tag=tag, image=image)]), step)
    writer.flush()
