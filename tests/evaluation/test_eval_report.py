"""The HTML report, opened in real headless chromium: it renders, and every embedded image decodes."""

import re

import numpy as np
import pytest
from PIL import Image

from eval_helpers import noisy, run_chromium, write_jsonl
from flowgrpo.evaluation import EvalConfig, evaluate

TOP_K = 3


def _folder(root, seed, n=8):
    root.mkdir()
    rows = []
    for i in range(n):
        noisy(root, f"img{i}.png", seed * 100 + i)
        rows.append({"file": f"img{i}.png", "prompt": f"a <b>scene</b> & number {i % 4}"})
    write_jsonl(root / "prompts.jsonl", rows)
    return root


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    """A comparison report: run B (8 images) against run A (8 images) with two scorers."""
    tmp = tmp_path_factory.mktemp("report")
    base = dict(
        progress=False,
        scorers=["brightness", "colorfulness"],
        stats={"resamples": 200},
        report={"top_k": TOP_K, "thumbnail_size": 96},
    )
    evaluate(
        EvalConfig.model_validate(
            {
                **base,
                "input": {"label": "base", "images": {"dir": str(_folder(tmp / "a", 1))}},
                "output_dir": str(tmp / "run_a"),
            }
        )
    )
    evaluate(
        EvalConfig.model_validate(
            {
                **base,
                "input": {"label": "tuned", "images": {"dir": str(_folder(tmp / "b", 2))}},
                "output_dir": str(tmp / "run_b"),
                "compare": str(tmp / "run_a"),
            }
        )
    )
    return tmp / "run_b" / "report.html"


def test_report_is_self_contained_and_complete(report):
    page = report.read_text(encoding="utf-8")
    srcs = re.findall(r'<img[^>]*\ssrc="([^"]*)"', page)
    assert srcs and all(s.startswith("data:image/") for s in srcs)
    assert not re.search(r"(src|href)\s*=\s*[\"']?(https?:)?//", page) and "url(" not in page
    # per scorer: 1 histogram + best k + worst k + k gain pairs + k loss pairs (2 images each)
    assert len(srcs) == 2 * (1 + TOP_K + TOP_K + 2 * TOP_K + 2 * TOP_K)
    assert page.count("<h2") == 2 + 2  # summary, comparison, one section per scorer
    assert "a &lt;b&gt;scene&lt;/b&gt; &amp; number" in page and "<b>scene</b>" not in page  # prompts are escaped
    assert "win rate" in page and "tuned" in page and "base" in page


def _dom(report, profile):
    done = run_chromium(["--dump-dom", report.as_uri()], profile)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def test_report_images_load_in_chromium(report, tmp_path):
    dom = _dom(report, tmp_path / "profile")
    total = int(re.search(r'data-images-total="(\d+)"', dom).group(1))
    loaded = int(re.search(r'data-images-loaded="(\d+)"', dom).group(1))
    assert total == 2 * (1 + 6 * TOP_K) and loaded == total
    assert 'data-images-ok="true"' in dom

    # The check can fail: one corrupt image makes the page report it.
    broken = tmp_path / "broken.html"
    page = report.read_text(encoding="utf-8")
    first = re.search(r'src="(data:image/[^"]+)"', page).group(1)
    broken.write_text(page.replace(first, "data:image/png;base64,AAAAAAAA", 1), encoding="utf-8")
    dom = _dom(broken, tmp_path / "profile2")
    assert 'data-images-ok="false"' in dom
    assert int(re.search(r'data-images-loaded="(\d+)"', dom).group(1)) == total - 1


def test_report_screenshot_in_chromium(report, tmp_path):
    shot = tmp_path / "report.png"
    done = run_chromium([f"--screenshot={shot}", "--window-size=1200,2000", report.as_uri()], tmp_path / "profile")
    assert done.returncode == 0, done.stderr[-2000:]
    assert shot.is_file() and shot.stat().st_size > 0
    with Image.open(shot) as im:
        assert im.size == (1200, 2000)
        pixels = np.asarray(im.convert("RGB"))
    assert len(np.unique(pixels.reshape(-1, 3), axis=0)) > 50  # text, tables, a histogram, images: not one flat colour
    assert pixels.std() > 10
