"""`flowgrpo evaluate` on video: the tiny Wan family's clips saved as MP4, scored by video scorers, played in the report
(opened in real headless chromium); without PyAV animated WebP; clear errors for images / videos mixed up."""

import json
import re
import sys

import numpy as np
import pytest
import torch

from eval_helpers import run_chromium, tiny_generate, write_jsonl
from flowgrpo import video_io
from flowgrpo.evaluation import EvalConfig, EvaluationError, evaluate
from reward_models import build_scorer

TOP_K = 2
SCORERS = ["motion_magnitude", {"name": "per_frame", "reward": "brightness"}]


def _config(out, input, **over):
    return EvalConfig.model_validate(
        {
            "output_dir": str(out),
            "input": input,
            "progress": False,
            "stats": {"resamples": 50},
            "scorers": SCORERS,
            "report": {"top_k": TOP_K, "thumbnail_size": 64},
            **over,
        }
    )


@pytest.fixture(scope="module")
def video_run(tmp_path_factory):
    """2 prompts x 2 clips of the tiny Wan (5 frames, 32 x 32, 2 steps), as MP4."""
    pytest.importorskip("av", reason="PyAV not installed (pip install 'flowgrpo[video]')")
    tmp = tmp_path_factory.mktemp("video")
    prompts = write_jsonl(tmp / "prompts.jsonl", [{"prompt": "a red cube"}, {"prompt": "a dog"}])
    out = tmp / "run"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        summary = evaluate(_config(out, {"generate": tiny_generate(prompts, model="wan", fps=8)}))
    finally:
        torch.set_num_threads(threads)
    return out, summary


def test_clips_are_saved_as_mp4_and_scored_from_the_files(video_run, tmp_path):
    out, summary = video_run
    listing = [json.loads(x) for x in (out / "images" / "prompts.jsonl").read_text().splitlines()]
    assert [r["file"] for r in listing] == ["00000_00.mp4", "00000_01.mp4", "00001_00.mp4", "00001_01.mp4"]
    clip = video_io.read_video(out / "images" / "00000_00.mp4")
    assert clip.shape == (5, 32, 32, 3) and clip.std() > 1  # the adapter's 5 frames, decoded, not a flat fill
    assert summary["images"] == 4 and summary["scores"]["motion_magnitude"]["count"] == 4
    # the scores are those of the saved files
    rows = [json.loads(x) for x in (out / "scores.jsonl").read_text().splitlines()]
    clips = torch.stack([torch.from_numpy(video_io.read_video(out / r["file"])).permute(0, 3, 1, 2) for r in rows])
    want = build_scorer("motion_magnitude")(clips)["motion_magnitude"].numpy()
    assert np.allclose([r["scores"]["motion_magnitude"] for r in rows], want, atol=1e-6)
    # the generated folder scores again as a folder of videos, to the same numbers
    again = evaluate(_config(tmp_path / "again", {"images": {"dir": str(out / "images")}}))
    for key in ("motion_magnitude", "brightness"):
        assert again["scores"][key]["mean"] == pytest.approx(summary["scores"][key]["mean"], abs=1e-9)


def test_report_links_the_videos_and_they_play_in_chromium(video_run, tmp_path):
    out, _ = video_run
    page = (out / "report.html").read_text(encoding="utf-8")
    srcs = re.findall(r'<video src="([^"]+)" controls loop muted', page)
    assert len(srcs) == 2 * 2 * TOP_K  # best and worst k of each of the two main keys
    assert set(srcs) <= {f"images/0000{p}_0{g}.mp4" for p in range(2) for g in range(2)}  # relative links
    dom = _dom(out / "report.html", tmp_path / "profile")
    assert 'data-videos-ok="true"' in dom and f'data-videos-loaded="{len(srcs)}"' in dom

    # The check can fail: a video that is not there is counted as not loaded.
    broken = out / "broken.html"
    broken.write_text(page.replace(f'src="{srcs[0]}"', 'src="images/missing.mp4"', 1), encoding="utf-8")
    dom = _dom(broken, tmp_path / "profile2")
    assert 'data-videos-ok="false"' in dom and f'data-videos-loaded="{len(srcs) - 1}"' in dom


def _dom(report, profile):
    done = run_chromium(["--virtual-time-budget=5000", "--dump-dom", report.as_uri()], profile)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def _webp_folder(root, monkeypatch):
    """Two animated WebP clips (written without PyAV) with their prompts; brightness rises along each clip."""
    monkeypatch.setitem(sys.modules, "av", None)
    root.mkdir()
    rows = []
    for i in range(2):
        levels = torch.linspace(0.2, 0.6 + 0.2 * i, 4)
        path = video_io.write_video(levels[:, None, None, None].expand(4, 3, 32, 32), root / f"clip{i}", fps=4)
        rows.append({"file": path.name, "prompt": f"clip {i}"})
    write_jsonl(root / "prompts.jsonl", rows)
    return root


def test_without_pyav_webp_clips_are_scored_and_shown_as_img(tmp_path, monkeypatch):
    clips = _webp_folder(tmp_path / "clips", monkeypatch)
    summary = evaluate(_config(tmp_path / "run", {"images": {"dir": str(clips)}}, scorers=SCORERS[1:]))
    assert summary["scores"]["brightness"]["count"] == 2
    assert summary["scores"]["brightness"]["mean"] == pytest.approx(np.mean([0.4, 0.5]), abs=0.01)
    page = (tmp_path / "run" / "report.html").read_text(encoding="utf-8")
    srcs = re.findall(r'<img src="(\.\./clips/clip\d\.webp)"', page)
    assert len(srcs) == 2 * TOP_K and "<video" not in page  # linked beside the report, not embedded
    dom = _dom(tmp_path / "run" / "report.html", tmp_path / "profile")
    assert 'data-images-ok="true"' in dom and 'data-videos-total="0"' in dom


def test_scorers_and_runs_that_do_not_fit_are_one_line_errors(tmp_path, monkeypatch):
    clips = _webp_folder(tmp_path / "clips", monkeypatch)
    with pytest.raises(EvaluationError, match=r"'brightness' scores images, but the run holds videos.*per_frame"):
        evaluate(_config(tmp_path / "a", {"images": {"dir": str(clips)}}, scorers=["brightness"]))
    from PIL import Image

    Image.new("RGB", (8, 8)).save(clips / "still.png")
    rows = [json.loads(x) for x in (clips / "prompts.jsonl").read_text().splitlines()]
    write_jsonl(clips / "prompts.jsonl", [*rows, {"file": "still.png", "prompt": "still"}])
    with pytest.raises(EvaluationError, match="images or videos, not both"):
        evaluate(_config(tmp_path / "b", {"images": {"dir": str(clips)}}))
    stills = tmp_path / "stills"
    stills.mkdir()
    Image.new("RGB", (8, 8)).save(stills / "a.png")
    write_jsonl(stills / "prompts.jsonl", [{"file": "a.png", "prompt": "a"}])
    with pytest.raises(EvaluationError, match="'motion_magnitude' scores videos, but the run holds images"):
        evaluate(_config(tmp_path / "c", {"images": {"dir": str(stills)}}, scorers=["motion_magnitude"]))
