"""Video outputs of a run: MP4 (PyAV) or animated WebP files, video grids, and eval media in the trackers."""

import io
import logging
import sys
import types
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image

from flowgrpo import video_io
from flowgrpo.t2i import artifacts

try:
    import av  # the optional extra `video`
except ImportError:
    av = None
needs_av = pytest.mark.skipif(av is None, reason="PyAV not installed (pip install 'flowgrpo[video]')")


def _clip(frames=5, h=33, w=47):
    """Frame f of every clip a flat grey (f + 1) / (frames + 1): frames are told apart by their mean."""
    levels = torch.arange(1, frames + 1, dtype=torch.float32) / (frames + 1)
    return levels[:, None, None, None].expand(frames, 3, h, w).clone()


@pytest.fixture
def no_pyav(monkeypatch):
    """PyAV missing: `import av` raises ImportError, and the fallback has not been announced yet."""
    monkeypatch.setitem(sys.modules, "av", None)
    monkeypatch.setattr(video_io, "_fallback_said", False)


@needs_av
def test_mp4_is_h264_yuv420p_padded_to_even_sizes(tmp_path):
    path = video_io.write_video(_clip(), tmp_path / "clip.png", fps=16)
    assert path == tmp_path / "clip.mp4"  # the stem kept, the suffix of the format
    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        assert (stream.codec_context.name, stream.codec_context.pix_fmt) == ("h264", "yuv420p")
        assert stream.average_rate == 16
        frames = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
    assert len(frames) == 5 and frames[0].shape == (34, 48, 3)  # 33 x 47 padded, not resized
    means = [f.mean() / 255 for f in frames]
    assert np.allclose(means, [(f + 1) / 6 for f in range(5)], atol=0.02)
    assert video_io.is_video(path) and video_io.read_video(path).shape == (5, 34, 48, 3)


def test_without_pyav_an_animated_webp_with_one_info_line(tmp_path, no_pyav, caplog):
    with caplog.at_level(logging.INFO, logger="flowgrpo.video_io"):
        first = video_io.write_video(_clip(), tmp_path / "a", fps=8)
        video_io.write_video(_clip(), tmp_path / "b", fps=8)
    assert first == tmp_path / "a.webp"
    assert [r.levelno for r in caplog.records] == [logging.INFO] and "PyAV" in caplog.records[0].getMessage()
    with Image.open(first) as im:
        im.load()
        assert im.n_frames == 5 and im.size == (47, 33) and im.info["duration"] == 125  # ms per frame at 8 fps
    frames = video_io.read_video(first)
    assert frames.shape == (5, 33, 47, 3)
    assert np.array_equal(frames, video_io.to_uint8_frames(_clip()))  # lossless
    with pytest.raises(ValueError, match="needs PyAV"):
        video_io.read_video(tmp_path / "a.mp4")


def test_bad_fps_and_bad_clips_are_one_line_errors(tmp_path):
    with pytest.raises(ValueError, match=r"fps must be .* 1\.\.240, got 0"):
        video_io.write_video(_clip(), tmp_path / "x", fps=0)
    with pytest.raises(ValueError, match=r"\[F, 3, H, W\].*\(5, 4, 8, 8\)"):
        video_io.write_video(torch.zeros(5, 4, 8, 8), tmp_path / "x")


def _clips():
    """4 clips of 3 frames, 8 x 8: clip i, frame f has the grey level (4 f + i + 1) / 13."""
    level = (torch.arange(3)[None, :] * 4 + torch.arange(4)[:, None] + 1).float() / 13
    return level[:, :, None, None, None].expand(4, 3, 3, 8, 8).clone()


@pytest.mark.parametrize("missing", [pytest.param(False, marks=needs_av), True])
def test_save_grid_of_clips_tiles_every_frame(tmp_path, monkeypatch, missing):
    if missing:
        monkeypatch.setitem(sys.modules, "av", None)
    path = artifacts.save_grid(_clips(), tmp_path / "grids" / "eval_before.png", 2, 64, prompts=["a", "b"], fps=4)
    assert path == tmp_path / "grids" / ("eval_before.webp" if missing else "eval_before.mp4")
    assert not (tmp_path / "grids" / "eval_before.png").exists()
    frames = video_io.read_video(path).astype(np.float64) / 255
    assert frames.shape == (3, 16, 16, 3)  # 2 x 2 tiles of 8 px, every frame
    for f in range(3):
        tiles = [frames[f, r * 8 + 2 : r * 8 + 6, c * 8 + 2 : c * 8 + 6].mean() for r in range(2) for c in range(2)]
        assert np.allclose(tiles, [(4 * f + i + 1) / 13 for i in range(4)], atol=0.03), (f, tiles)


def test_a_large_video_grid_is_shrunk(tmp_path, no_pyav):
    path = artifacts.save_grid(torch.rand(2, 2, 3, 10, 1200), tmp_path / "wide.png", 2, 64)
    assert video_io.read_video(path).shape == (2, 8, artifacts.VIDEO_GRID_MAX_SIDE, 3)  # 2400 x 10 -> 1920 x 8


def test_save_grid_of_images_is_unchanged(tmp_path):
    path = artifacts.save_grid(torch.rand(4, 3, 8, 8), tmp_path / "g.png", 2, 64)
    with Image.open(path) as im:
        assert path.suffix == ".png" and im.size == (16, 16)
    with pytest.raises(ValueError, match=r"\[N, F, 3, H, W\], got \(8, 8\)"):
        artifacts.save_grid(torch.rand(8, 8), tmp_path / "g.png", 2, 64)


def _trackers(tmp_path, wandb=False):
    cfg = SimpleNamespace(artifacts=SimpleNamespace(tensorboard=True, wandb=wandb, wandb_project="p"))
    cfg.model_dump = lambda mode: {}
    return artifacts.Trackers(tmp_path, cfg)


@needs_av
def test_tensorboard_gets_videos_as_gifs_and_images(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    video = artifacts.save_grid(_clips(), tmp_path / "grids" / "eval_after.png", 2, 64)
    image = artifacts.save_grid(torch.rand(4, 3, 8, 8), tmp_path / "grids" / "rollout.png", 2, 64)
    trackers = _trackers(tmp_path)
    trackers.log_media("eval/video", video, 3)
    trackers.log_media("eval/clip", _clip(4, 8, 6), 3, fps=8)
    trackers.log_media("eval/image", image, 3)
    trackers.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"images": 0})
    events.Reload()
    assert set(events.Tags()["images"]) == {"eval/video", "eval/clip", "eval/image"}
    (gif,) = events.Images("eval/video")
    assert gif.step == 3 and (gif.width, gif.height) == (16, 16)
    for tag, frames in (("eval/video", 3), ("eval/clip", 4)):
        data = events.Images(tag)[0].encoded_image_string
        assert data[:6] == b"GIF89a"
        with Image.open(io.BytesIO(data)) as im:
            assert im.n_frames == frames
    assert events.Images("eval/image")[0].encoded_image_string[:4] == b"\x89PNG"
    with pytest.raises(ValueError, match=r"image \[3, H, W\] or a clip"):
        _trackers(tmp_path).log_media("x", torch.zeros(2, 8, 8), 0)


@pytest.mark.parametrize("missing", [pytest.param(False, marks=needs_av), True])
def test_wandb_gets_the_written_video(tmp_path, monkeypatch, missing):
    logged = []
    fake = types.ModuleType("wandb")
    fake.Video = lambda path: ("Video", path)
    fake.Image = lambda data: ("Image", data)
    fake.init = lambda **kw: SimpleNamespace(log=lambda d, step: logged.append((d, step)), finish=lambda: None)
    monkeypatch.setitem(sys.modules, "wandb", fake)
    if missing:
        monkeypatch.setitem(sys.modules, "av", None)
    video = artifacts.save_grid(_clips(), tmp_path / "grids" / "eval.png", 2, 64)
    trackers = _trackers(tmp_path, wandb=True)
    trackers.tb = None  # wandb alone
    trackers.log_media("eval/video", video, 7)
    ((record, step),) = logged
    kind, path = record["eval/video"]
    assert kind == "Video" and step == 7
    # wandb.Video plays MP4 and GIF files: without PyAV the WebP goes to it as a GIF
    assert path == str(video) if not missing else path.endswith("eval_video_000007.gif")
