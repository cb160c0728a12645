"""Scoring folders of images with the toy scorers: exact per-image values, output files, NaN
handling, and a two-run comparison checked against hand-computed numbers."""

import csv
import io
import json
import math

import numpy as np
import pytest
import torch
from PIL import Image

from eval_helpers import gray_folder, solid, write_jsonl
from flowgrpo.evaluation import EvalConfig, evaluate, main, read_run


def _config(out, **over):
    return EvalConfig.model_validate({"output_dir": str(out), "progress": False, "stats": {"resamples": 300}, **over})


def test_toy_scores_per_image_and_files(tmp_path):
    folder = tmp_path / "imgs"
    folder.mkdir()
    colours = [(255, 0, 0), (40, 40, 40), (0, 128, 255)]
    for i, c in enumerate(colours):
        solid(folder, f"im{i}.png", c)
    write_jsonl(
        folder / "prompts.jsonl",
        [{"file": f"im{i}.png", "prompt": f"colour {i}", "metadata": {"n": i}} for i in range(3)],
    )
    out = tmp_path / "out"
    summary = evaluate(
        _config(
            out,
            input={"images": {"dir": str(folder)}},
            scorers=["brightness", "colorfulness", {"name": "jpeg_compressibility", "quality": 90}],
        )
    )

    # Hand-computed: Rec.601 luma; Hasler-Suesstrunk of a flat colour is 0.3 * |(rg, yb)|; JPEG kB.
    def jpeg_kb(c):
        buf = io.BytesIO()
        Image.new("RGB", (24, 16), c).save(buf, format="JPEG", quality=90)
        return buf.tell() / 1000

    want = {
        "brightness": [(0.299 * r + 0.587 * g + 0.114 * b) / 255 for r, g, b in colours],
        "colorfulness": [0.3 * math.hypot(r - g, (r + g) / 2 - b) + 1e-6 for r, g, b in colours],
        "jpeg_compressibility": [-jpeg_kb(c) for c in colours],
    }
    with open(out / "scores.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [r["prompt"] for r in rows] == ["colour 0", "colour 1", "colour 2"]
    assert list(rows[0])[:3] == ["file", "prompt", "index"]
    lines = [json.loads(x) for x in (out / "scores.jsonl").read_text().splitlines()]
    assert lines[2]["metadata"] == {"n": 2} and lines[0]["file"].endswith("im0.png")
    for key, values in want.items():
        assert [float(r[key]) for r in rows] == pytest.approx(values, rel=1e-4, abs=1e-5), key
        assert [x["scores"][key] for x in lines] == pytest.approx(values, rel=1e-4, abs=1e-5), key
    on_disk = json.loads((out / "summary.json").read_text())
    for key, values in want.items():
        s = on_disk["scores"][key]
        assert s["mean"] == pytest.approx(np.mean(values), rel=1e-4)
        assert s["std"] == pytest.approx(np.std(values, ddof=1), rel=1e-4)
        assert s["count"] == 3 and s["nan_count"] == 0 and s["ci_low"] <= s["mean"] <= s["ci_high"]
    assert "percentile bootstrap" in on_disk["stats"]["ci_method"]
    assert summary["scores"]["brightness"]["mean"] == pytest.approx(on_disk["scores"]["brightness"]["mean"])
    assert (out / "config.yaml").is_file() and (out / "report.html").is_file()


@pytest.fixture
def nan_scorer():
    """A registered test scorer: brightness, but NaN (could not score) for dark images."""
    from reward_models import registry
    from reward_models.base import Scorer

    class DarkIsNaN(Scorer):
        name = "test_dark_is_nan"
        requires_prompts = True

        def score_batch(self, images, prompts, metadata):
            x = torch.stack([t.mean() for t in images.tensors()])
            return {self.key: torch.where(x < 0.2, torch.full_like(x, float("nan")), x), f"{self.key}/double": 2 * x}

    registry.register("test_dark_is_nan")(lambda *, batch_size=2: DarkIsNaN(batch_size=batch_size))
    yield "test_dark_is_nan"
    registry.unregister("test_dark_is_nan")


def test_nan_scores_are_counted_not_replaced(tmp_path, nan_scorer):
    folder = gray_folder(tmp_path / "imgs", [("a", 10), ("b", 100), ("c", 20), ("d", 200), ("e", 250)])
    out = tmp_path / "out"
    summary = evaluate(_config(out, input={"images": {"dir": str(folder)}}, scorers=[nan_scorer], score_batch_size=2))
    s = summary["scores"][nan_scorer]
    assert s["count"] == 3 and s["nan_count"] == 2
    assert s["mean"] == pytest.approx(np.mean([100, 200, 250]) / 255, rel=1e-5)
    assert summary["scores"][f"{nan_scorer}/double"]["count"] == 5  # extras are summarised too
    lines = [json.loads(x) for x in (out / "scores.jsonl").read_text().splitlines()]
    assert [x["scores"][nan_scorer] is None for x in lines] == [True, False, True, False, False]
    assert json.loads((out / "summary.json").read_text())["scores"][nan_scorer]["nan_count"] == 2
    with open(out / "scores.csv", newline="") as f:
        assert [r[nan_scorer] for r in csv.DictReader(f)][0] == "nan"
    run = read_run(out)
    assert run.main_keys == [nan_scorer] and np.isnan(run.scores[nan_scorer][0])


def test_compare_two_runs_against_hand_computed_values(tmp_path, capsys):
    # Run A: explicit (prompt, index) in JSONL, in another order than run B.
    a_dir = tmp_path / "a"
    a_dir.mkdir()
    levels_a = {("red", 0): 100, ("red", 1): 50, ("blue", 0): 200, ("green", 0): 30, ("only_a", 0): 10}
    rows = []
    for i, ((prompt, index), level) in enumerate(levels_a.items()):
        solid(a_dir, f"a{i}.png", (level,) * 3)
        rows.append({"file": f"a{i}.png", "prompt": prompt, "index": index})
    write_jsonl(a_dir / "prompts.jsonl", rows)
    # Run B: a txt prompt file; indices count repeats of a prompt in sorted file order.
    b_dir = gray_folder(tmp_path / "b", [("blue", 150), ("red", 120), ("red", 50), ("green", 90), ("only_b", 255)])

    assert (
        main(
            [
                "--images",
                str(a_dir),
                "--scorers",
                "brightness",
                "-o",
                str(tmp_path / "run_a"),
                "--label",
                "base",
                "--no-progress",
            ]
        )
        == 0
    )
    scorers = "scorers=[brightness, {name: pointwise_as_pairwise, scorer: brightness, temperature: 0.1}]"
    assert (
        main(
            [
                "--images",
                str(b_dir),
                "-o",
                str(tmp_path / "run_b"),
                "--compare",
                str(tmp_path / "run_a"),
                "--label",
                "aligned",
                "--no-progress",
                scorers,
            ]
        )
        == 0
    )
    assert "win rate 0.625" in capsys.readouterr().out

    comp = json.loads((tmp_path / "run_b" / "summary.json").read_text())["comparison"]
    assert (comp["a"], comp["b"]) == ("base", "aligned")
    assert (comp["matched"], comp["unmatched_a"], comp["unmatched_b"]) == (4, 1, 1)
    # matched B - A (x255): red0 +20 (win), red1 0 (tie), blue -50 (loss), green +60 (win)
    c = comp["scores"]["brightness"]
    assert c["win_rate"] == 0.625
    assert c["mean_diff"] == pytest.approx(30 / 4 / 255, abs=1e-6)
    assert c["mean_a"] == pytest.approx((100 + 50 + 200 + 30) / 4 / 255, abs=1e-6)
    assert c["mean_b"] == pytest.approx((120 + 50 + 150 + 90) / 4 / 255, abs=1e-6)
    assert c["pairs"] == 4 and c["nan_pairs"] == 0
    sig = [1 / (1 + math.exp(-d / 255 / 0.1)) for d in (20, 0, -50, 60)]
    p = comp["pairwise"]["pointwise_as_pairwise"]
    assert p["mean_p_b_beats_a"] == pytest.approx(np.mean(sig), abs=1e-5) and p["pairs"] == 4
