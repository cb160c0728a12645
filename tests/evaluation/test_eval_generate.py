"""Generating with the tiny SD3 adapter (ODE, 32x32, 2 steps) and scoring, with and without LoRA."""

import json

import numpy as np
import pytest
import torch
from PIL import Image

from eval_helpers import tiny_generate
from flowgrpo.evaluation import EvalConfig, evaluate


def _pixels(run_dir, n):
    rows = [json.loads(x) for x in (run_dir / "scores.jsonl").read_text().splitlines()]
    assert len(rows) == n
    return {(r["prompt"], r["index"]): np.asarray(Image.open(run_dir / r["file"]), dtype=np.int16) for r in rows}


def _config(out, **over):
    return EvalConfig.model_validate(
        {"output_dir": str(out), "progress": False, "stats": {"resamples": 200}, "report": {"enabled": False}, **over}
    )


@pytest.fixture(autouse=True)
def _one_thread():
    """The tiny model gains nothing from threads, and on a loaded CI machine spinning threads cost seconds."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def prompts(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "a red cube", "tag": "colour"}\n{"prompt": "a dog"}\n{"prompt": "a red cube"}\n')
    return path


def test_generate_score_and_rescore_the_saved_folder(tmp_path, prompts, loras):
    out = tmp_path / "gen"
    summary = evaluate(_config(out, input={"generate": tiny_generate(prompts)}, scorers=["brightness", "colorfulness"]))
    assert summary["images"] == 6 and summary["scores"]["brightness"]["count"] == 6
    listing = [json.loads(x) for x in (out / "images" / "prompts.jsonl").read_text().splitlines()]
    # 3 prompts x 2 images; the repeated prompt's images are numbered on, so (prompt, index) stays unique
    assert [(r["prompt"], r["index"]) for r in listing] == [
        ("a red cube", 0),
        ("a red cube", 1),
        ("a dog", 0),
        ("a dog", 1),
        ("a red cube", 2),
        ("a red cube", 3),
    ]
    assert listing[0]["metadata"] == {"tag": "colour"} and listing[0]["file"] == "00000_00.png"
    pixels = _pixels(out, 6)
    first = pixels[("a red cube", 0)]
    assert first.shape == (32, 32, 3) and first.std() > 1  # a decoded image, not a flat fill
    assert not np.array_equal(first, pixels[("a red cube", 1)])  # two noises, two images
    # the brightness score is the image's own Rec.601 luma (scored from the saved PNG)
    rows = {(r["prompt"], r["index"]): r for r in map(json.loads, (out / "scores.jsonl").read_text().splitlines())}
    luma = (first / 255.0) @ np.array([0.299, 0.587, 0.114])
    assert rows[("a red cube", 0)]["scores"]["brightness"] == pytest.approx(luma.mean(), abs=1e-5)

    # Deterministic: the same config again gives the same pixels; the saved folder re-scores identically.
    evaluate(_config(tmp_path / "gen2", input={"generate": tiny_generate(prompts)}, scorers=["brightness"]))
    again = _pixels(tmp_path / "gen2", 6)
    assert all(np.array_equal(pixels[k], again[k]) for k in pixels)
    rescored = evaluate(
        _config(
            tmp_path / "rescore", input={"images": {"dir": str(out / "images")}}, scorers=["brightness", "colorfulness"]
        )
    )
    for key in ("brightness", "colorfulness"):
        assert rescored["scores"][key]["mean"] == pytest.approx(summary["scores"][key]["mean"], rel=1e-6)


@pytest.fixture(scope="module")
def loras(tmp_path_factory):
    """LoRA folders written by adapter.save_lora: B = 0 (the base model) and B random (a changed model).
    Building the tiny adapter here also pays the one-time diffusers / peft imports outside the tests."""
    from pipelines.adapters import build_adapter

    root = tmp_path_factory.mktemp("loras")
    adapter = build_adapter("sd3", tiny=True)
    adapter.add_lora(rank=4, init="gaussian")
    out = {}
    for scale in (0.0, 0.5):
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for name, p in adapter.denoiser.named_parameters():
                if ".lora_B." in name:
                    p.copy_(scale * torch.randn(p.shape, generator=g))
        out[scale] = adapter.save_lora(root / f"lora_{scale}")
    build_adapter("sd3", tiny=True).load_lora(out[0.0])  # the loader's imports, once
    return out


@pytest.mark.parametrize("scale", [0.0, 0.5], ids=["zero-lora", "trained-lora"])
def test_lora_against_its_base_model(tmp_path, prompts, loras, scale):
    lora = loras[scale]
    out = tmp_path / "eval"
    summary = evaluate(
        _config(
            out,
            input={"label": "lora", "generate": tiny_generate(prompts, lora=str(lora))},
            baseline={"label": "base", "generate": tiny_generate(prompts)},
            scorers=["brightness", "colorfulness"],
        )
    )
    comp = summary["comparison"]
    assert (comp["a"], comp["b"], comp["matched"], comp["unmatched_a"], comp["unmatched_b"]) == (
        "base",
        "lora",
        6,
        0,
        0,
    )
    base, tuned = _pixels(out / "baseline", 6), _pixels(out, 6)
    assert (out / "baseline" / "summary.json").is_file()
    if scale == 0.0:
        # B = 0: the LoRA model is the base model, and both runs start from the same noise
        assert all(np.array_equal(base[k], tuned[k]) for k in base)
        assert comp["scores"]["brightness"]["mean_diff"] == 0 and comp["scores"]["brightness"]["win_rate"] == 0.5
        return
    assert sum(np.abs(base[k] - tuned[k]).mean() for k in base) / 6 > 1.0  # the LoRA was loaded and used
    # comparison numbers = the per-image scores of both runs, matched by (prompt, index)
    rows_a = {
        (r["prompt"], r["index"]): r["scores"]
        for r in map(json.loads, (out / "baseline" / "scores.jsonl").read_text().splitlines())
    }
    rows_b = {
        (r["prompt"], r["index"]): r["scores"] for r in map(json.loads, (out / "scores.jsonl").read_text().splitlines())
    }
    for key in ("brightness", "colorfulness"):
        a = np.array([rows_a[k][key] for k in rows_b])
        b = np.array([rows_b[k][key] for k in rows_b])
        c = comp["scores"][key]
        assert c["mean_diff"] == pytest.approx(np.mean(b - a), abs=1e-9)
        assert c["win_rate"] == pytest.approx(np.mean((b > a) + 0.5 * (b == a)))
        assert c["pairs"] == 6
