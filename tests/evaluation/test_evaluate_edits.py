"""`flowgrpo evaluate` on image edits: rows naming input images, the tiny FLUX.1 Kontext adapter, edit scorers
reading metadata["source_images"], and the report's source | edit rows rendered in headless chromium."""

import json
import re

import numpy as np
import pytest
import torch
from PIL import Image

from eval_helpers import run_chromium, solid, write_jsonl
from flowgrpo.evaluation import EvalConfig, evaluate
from flowgrpo.evaluation.sources import EvaluationError


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def edits(tmp_path):
    (tmp_path / "src").mkdir()
    solid(tmp_path / "src", "red.png", (200, 30, 30))
    solid(tmp_path / "src", "blue.png", (20, 40, 220))
    return write_jsonl(
        tmp_path / "edits.jsonl",
        [
            {"prompt": "make it green", "images": ["src/red.png"], "tag": "colour"},
            {"instruction": "make it darker", "image": "src/blue.png"},
        ],
    )


def _generate(prompts, **over):
    return {
        "model": "flux_kontext",
        "tiny": True,
        "prompts": str(prompts),
        "num_steps": 2,
        "cfg_mode": "none",
        "guidance_scale": 2.5,
        "height": 32,
        "width": 32,
        "batch_size": 2,
        "device": "cpu",
        **over,
    }


def _config(out, generate, scorers=("edit_preservation", "brightness"), report=False):
    return EvalConfig.model_validate(
        {
            "input": {"generate": generate},
            "scorers": list(scorers),
            "output_dir": str(out),
            "progress": False,
            "stats": {"resamples": 50},
            "report": {"enabled": report, "top_k": 2, "thumbnail_size": 64},
        }
    )


def test_generate_edits_score_them_against_their_sources_and_report_pairs(tmp_path, edits):
    out = tmp_path / "run"
    summary = evaluate(_config(out, _generate(edits), report=True))
    assert summary["images"] == 2 and summary["scores"]["edit_preservation"]["count"] == 2
    rows = [json.loads(x) for x in (out / "scores.jsonl").read_text().splitlines()]
    assert [r["prompt"] for r in rows] == ["make it green", "make it darker"]
    assert rows[0]["metadata"]["tag"] == "colour" and rows[0]["metadata"]["images"] == ["images/00000_src0.png"]
    # the saved source is the image the model saw: the 24x16 file brought to 32x32
    src = np.asarray(Image.open(out / "images" / "00000_src0.png"), dtype=np.float64)
    assert src.shape == (32, 32, 3) and np.allclose(src.reshape(-1, 3), [200, 30, 30], atol=1)
    # edit_preservation (pixel) = 1 - mean |edit - source|, from metadata["source_images"]
    edit = np.asarray(Image.open(out / rows[0]["file"]), dtype=np.float64)
    want = 1 - np.abs(edit - src).mean() / 255
    assert rows[0]["scores"]["edit_preservation"] == pytest.approx(want, abs=1e-4)
    listing = [json.loads(x) for x in (out / "images" / "prompts.jsonl").read_text().splitlines()]
    assert listing[1]["metadata"]["images"] == ["00001_src0.png"]

    # the generated folder re-scores as an image folder, its sources found through the listing
    again = evaluate(
        EvalConfig.model_validate(
            {
                "input": {"images": {"dir": str(out / "images")}},
                "scorers": ["edit_preservation"],
                "output_dir": str(tmp_path / "rescore"),
                "progress": False,
                "stats": {"resamples": 50},
                "report": {"enabled": False},
            }
        )
    )
    assert again["scores"]["edit_preservation"]["mean"] == pytest.approx(
        summary["scores"]["edit_preservation"]["mean"], rel=1e-9
    )

    page = (out / "report.html").read_text(encoding="utf-8")
    assert page.count('<figure class="source"') == 2 * 2 * 2  # 2 scorers x (best 2 + worst 2), one source each
    done = run_chromium(["--dump-dom", (out / "report.html").as_uri()], tmp_path / "profile")
    assert done.returncode == 0, done.stderr[-2000:]
    dom = done.stdout
    assert 'data-images-ok="true"' in dom
    shown = int(re.search(r'data-edit-rows="(\d+)"', dom).group(1))
    beside = int(re.search(r'data-edit-rows-beside="(\d+)"', dom).group(1))
    assert shown == 8 and beside == shown  # every source is laid out left of its edit, on one line


def test_a_text_to_image_family_given_image_rows_is_one_line(tmp_path, edits):
    gen = _generate(edits, model="sd3", cfg_mode="full")
    with pytest.raises(EvaluationError, match="2 prompt rows name input images, but model family 'sd3'") as err:
        evaluate(_config(tmp_path / "out", gen, scorers=["brightness"]))
    assert "\n" not in str(err.value)


def test_an_edit_family_given_plain_prompts_is_one_line(tmp_path):
    prompts = tmp_path / "p.txt"
    prompts.write_text("a cat\na dog\n")
    with pytest.raises(EvaluationError, match="'flux_kontext' edits images: every prompt row needs 'images'") as err:
        evaluate(_config(tmp_path / "out", _generate(prompts), scorers=["brightness"]))
    assert "\n" not in str(err.value)


def test_a_missing_input_image_names_file_and_line(tmp_path, edits):
    edits.write_text(edits.read_text() + json.dumps({"prompt": "x", "images": ["src/none.png"]}) + "\n")
    with pytest.raises(EvaluationError, match=r"edits.jsonl:3: image '.*none.png' does not exist") as err:
        evaluate(_config(tmp_path / "out", _generate(edits), scorers=["brightness"]))
    assert "\n" not in str(err.value)
