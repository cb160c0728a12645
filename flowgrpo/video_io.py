"""Video files of decoded clips, shared by the trainer's grids (flowgrpo.t2i.artifacts) and `flowgrpo evaluate`.

A clip is [F, 3, H, W] float in [0, 1] (one video of a video adapter's decode, which gives [B, F, 3, H, W]) or uint8
[F, H, W, 3]. `write_video` writes an MP4 through PyAV (the optional extra `video`: `pip install 'flowgrpo[video]'`;
the wheel ships its own FFmpeg) as H.264 in yuv420p with the index at the front (`+faststart`), what every browser
plays; odd sizes are padded to even (yuv420p halves the chroma planes) by repeating the last row / column, so no
frame is resampled. Without PyAV it writes an animated WebP with PIL (lossless, browsers play it in an <img>) and
says so once in an INFO log line. `read_video` reads either back as uint8 [F, H, W, 3]; `gif_bytes` encodes a clip
as an animated GIF, the form tensorboard's Images tab plays.
"""

from __future__ import annotations

import io
import logging
from pathlib import Path
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

DEFAULT_FPS = 16  # Wan 2.1's frame rate (81 frames = 5 s)
VIDEO_SUFFIXES = (".mp4", ".webp")  # what write_video writes (a .webp is a video only when animated)
_fallback_said = False  # the INFO line about the WebP fallback is said once per process


def _pyav() -> Any:
    """The `av` module, or None when PyAV is not installed."""
    try:
        import av
    except ImportError:
        return None
    return av


def to_uint8_frames(clip: Any) -> np.ndarray:
    """A clip as uint8 [F, H, W, 3]: float [F, 3, H, W] in [0, 1] (clamped, rounded) or uint8 [F, H, W, 3] as is."""
    import torch

    if isinstance(clip, torch.Tensor):
        if clip.dtype == torch.uint8:
            clip = clip.cpu().numpy()
        else:
            if clip.ndim != 4 or clip.shape[1] != 3:
                raise ValueError(f"a clip must be [F, 3, H, W] float in [0, 1], got shape {tuple(clip.shape)}")
            frames = (clip.detach().float().clamp(0, 1) * 255).round().to(torch.uint8)
            return frames.permute(0, 2, 3, 1).contiguous().cpu().numpy()
    arr = np.asarray(clip)
    if arr.dtype != np.uint8 or arr.ndim != 4 or arr.shape[3] != 3:
        raise ValueError(
            f"a clip must be [F, 3, H, W] float in [0, 1] or uint8 [F, H, W, 3], got {arr.dtype} {arr.shape}"
        )
    return arr


def _check_fps(fps: Any) -> int:
    if isinstance(fps, bool) or not isinstance(fps, (int, float)) or fps != int(fps) or not 1 <= fps <= 240:
        raise ValueError(f"fps must be a whole number of frames per second in 1..240, got {fps!r}")
    return int(fps)


def write_video(clip: Any, path: str | Path, fps: int = DEFAULT_FPS) -> Path:
    """Write `clip` as `path` with the suffix .mp4 (PyAV) or .webp (no PyAV); returns the path written."""
    global _fallback_said
    fps = _check_fps(fps)
    frames = to_uint8_frames(clip)
    if frames.shape[0] == 0:
        raise ValueError(f"a clip needs at least one frame, got shape {frames.shape}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    av = _pyav()
    if av is not None:
        return _write_mp4(av, frames, path.with_suffix(".mp4"), fps)
    if not _fallback_said:
        log.info("PyAV is not installed (pip install 'flowgrpo[video]'): writing videos as animated WebP")
        _fallback_said = True
    return _write_webp(frames, path.with_suffix(".webp"), fps)


def _write_mp4(av: Any, frames: np.ndarray, path: Path, fps: int) -> Path:
    _, h, w, _ = frames.shape
    if h % 2 or w % 2:  # yuv420p needs even sizes: repeat the last row / column rather than resample
        frames = np.pad(frames, ((0, 0), (0, h % 2), (0, w % 2), (0, 0)), mode="edge")
    with av.open(str(path), mode="w", options={"movflags": "+faststart"}) as container:
        stream = container.add_stream("libx264", rate=fps, options={"crf": "18", "preset": "medium"})
        stream.width, stream.height = frames.shape[2], frames.shape[1]
        stream.pix_fmt = "yuv420p"
        for array in frames:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(array, format="rgb24")))
        container.mux(stream.encode())  # flush the encoder's delayed frames
    return path


def _write_webp(frames: np.ndarray, path: Path, fps: int) -> Path:
    from PIL import Image

    pils = [Image.fromarray(a) for a in frames]
    duration = max(1, round(1000 / fps))  # milliseconds per frame
    pils[0].save(path, format="WEBP", save_all=True, append_images=pils[1:], duration=duration, loop=0, lossless=True)
    return path


def read_video(path: str | Path) -> np.ndarray:
    """The frames of a video written by write_video (MP4 through PyAV, animated WebP / GIF through PIL): uint8
    [F, H, W, 3]."""
    path = Path(path)
    if path.suffix.lower() == ".mp4":
        av = _pyav()
        if av is None:
            raise ValueError(f"reading {path} needs PyAV: pip install 'flowgrpo[video]'")
        with av.open(str(path)) as container:
            return np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])
    from PIL import Image, ImageSequence

    with Image.open(path) as im:
        return np.stack([np.asarray(f.convert("RGB")) for f in ImageSequence.Iterator(im)])


def is_video(path: str | Path) -> bool:
    """An MP4, or a WebP / GIF with more than one frame."""
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix == ".mp4":
        return True
    if suffix not in (".webp", ".gif"):
        return False
    from PIL import Image

    try:
        with Image.open(path) as im:
            return int(getattr(im, "n_frames", 1)) > 1
    except OSError:
        return False


def gif_bytes(clip: Any, fps: int = DEFAULT_FPS, max_side: int = 512) -> tuple[bytes, int, int]:
    """(GIF bytes, height, width) of `clip`, each frame shrunk to at most `max_side` pixels (the longest side):
    tensorboard's Images tab plays an animated GIF."""
    from PIL import Image

    fps = _check_fps(fps)
    pils = [Image.fromarray(a) for a in to_uint8_frames(clip)]
    for im in pils:
        im.thumbnail((max_side, max_side))
    buf = io.BytesIO()
    pils[0].save(buf, format="GIF", save_all=True, append_images=pils[1:], duration=max(1, round(1000 / fps)), loop=0)
    return buf.getvalue(), pils[0].height, pils[0].width
