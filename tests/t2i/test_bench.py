"""scripts/bench.py on two tiny recipes for one iteration: the JSON's structure, counted forwards against
the closed form of the full_sde and tree plans (worked out by hand here), and the markdown section."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_t2i_script", ROOT / "scripts" / "bench.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def run(bench, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bench")
    backward = torch.Tensor.backward
    threads = torch.get_num_threads()
    bench.main(
        [
            "--recipes",
            "flow_grpo,branchgrpo",
            "--iterations",
            "1",
            "--warmup",
            "0",
            "--published",
            "dance_grpo,branchgrpo",
            "--in-process",
            "--out-dir",
            str(tmp / "runs"),
            "--json",
            str(tmp / "bench.json"),
            "--markdown",
            str(tmp / "benchmarks.md"),
        ]
    )
    assert torch.Tensor.backward is backward, "the backward timing wrapper must be removed after the run"
    assert torch.get_num_threads() == threads
    return json.loads((tmp / "bench.json").read_text()), tmp


def test_json_structure(run):
    result, _ = run
    for key in (
        "date",
        "command",
        "settings",
        "machine",
        "versions",
        "git",
        "load_before",
        "load_after",
        "recipes",
        "published",
    ):
        assert key in result, key
    assert result["machine"]["cpu"] and result["versions"]["torch"]
    assert result["command"].startswith("python scripts/bench.py --recipes flow_grpo,branchgrpo")
    assert list(result["recipes"]) == ["flow_grpo", "branchgrpo"]
    for r in result["recipes"].values():
        assert "error" not in r, r.get("error")
        assert len(r["iterations"]) == 1 and not r["iterations"][0]["warmup"]
        s = r["summary"]
        assert s["measured_iterations"] == 1
        assert set(s["per_image"]) == {"fwd_nograd", "fwd_grad", "rollout_fwd_nograd", "backward"}
        assert set(s["phases_mean_s"]) == {"rollout", "reward", "reward_wait", "train", "other"}
        assert set(s["model_calls_mean_s"]) == {"fwd_nograd", "fwd_grad", "backward", "decode"}
        assert s["seconds_per_iteration_median"] > 0 and s["phases_mean_s"]["rollout"] > 0
        assert s["model_calls_mean_s"]["fwd_nograd"] > 0 and s["model_calls_mean_s"]["decode"] > 0
        assert 0 <= s["share_outside_model_calls"] <= s["share_outside_fwd_decode"] <= 1
        assert s["reward_calls_per_iteration"] == 2  # 2 rollout batches x 1 scorer
        assert s["decoded_images_per_iteration"] == 16
        assert s["hook_rows_match_counters"] and s["counts_match_closed_form"]


def test_full_sde_counts(run):
    s = run[0]["recipes"]["flow_grpo"]["summary"]
    # T = 6 steps, all SDE; the first floor(6 * 0.99) = 5 trained; no CFG; 16 edges x 5 = 80 in one backward of 48 + 32
    assert s["per_image"]["fwd_nograd"] == 6 == s["closed_form_per_image"]["fwd_nograd"]
    assert s["per_image"]["fwd_grad"] == 5 == s["closed_form_per_image"]["fwd_grad"]
    assert s["hook_rows_per_image"] == {"fwd_nograd": 6, "fwd_grad": 5}
    assert s["per_image"]["backward"] == 2 / 16


def test_tree_counts(run):
    s = run[0]["recipes"]["branchgrpo"]["summary"]
    # splits at steps 0, 2, 4 (branch 2): nodes per depth W = 1, 2, 2, 4, 4, 8, 8; 8 leaves per root
    W = [1, 2, 2, 4, 4, 8, 8]
    assert s["per_image"]["fwd_nograd"] == sum(W[:6]) / 8 == s["closed_form_per_image"]["fwd_nograd"]
    assert s["per_image"]["fwd_grad"] == sum(W[1:]) / 8 == s["closed_form_per_image"]["fwd_grad"]
    assert s["hook_rows_per_image"]["fwd_grad"] == sum(W[1:]) / 8


def test_published_settings(run):
    pub = run[0]["published"]
    assert pub["dance_grpo"]["per_image"]["fwd_nograd"] == 20 and pub["dance_grpo"]["per_image"]["fwd_grad"] == 20
    b = pub["branchgrpo"]  # 20 steps, splits {0, 3, 6, 9}: 218 edges and 203 forwards per 16-leaf tree
    assert b["per_image"]["fwd_grad"] == 218 / 16 and b["per_image"]["fwd_nograd"] == 203 / 16
    assert b["published_per_image"] == [13.68, 13.68] and b["counts_match_closed_form"]


def test_markdown_section(bench, run):
    result, tmp = run
    text = (tmp / "benchmarks.md").read_text()
    assert text.startswith("# Benchmarks") and text.count(bench.SECTION) == 1
    assert "| flow_grpo | full_sde |" in text and "\n- GPU figures: " in text  # where they are, or that none exist
    # re-runs replace only this script's section; another script's section stays as it was
    other = "## Text trainer vs TRL GRPOTrainer\n\nkeep me\n"
    path = tmp / "shared.md"
    path.write_text("# Benchmarks\n\n" + other)
    for _ in range(2):
        bench.write_section(path, bench.markdown(result))
    shared = path.read_text()
    assert shared.count(bench.SECTION) == 1 and other in shared
    path.write_text(f"# Benchmarks\n\n{bench.SECTION}\n\nold\n\n{other}")
    bench.write_section(path, bench.markdown(result))
    shared = path.read_text()
    assert "\nold\n" not in shared and other in shared and shared.count(bench.SECTION) == 1


def test_reward_model_forwards_count_as_model_calls():
    """A reward scorer's torch modules (here Adv-GRPO's tiny DINOv2 discriminator: the backbone's model and the
    head) are found and their forwards timed as model calls, from any thread; removing the probe unhooks them."""
    import sys
    import threading
    from types import SimpleNamespace

    from reward_models import build_scorer

    sys.path.insert(0, str(ROOT / "scripts"))
    from bench_t2i.probes import ModelCallProbe, reward_modules

    scorer = build_scorer({"name": "dino_discriminator", "tiny": True})
    modules = reward_modules(scorer)
    assert scorer.backbone.model in modules and scorer.head in modules
    adapter = SimpleNamespace(denoiser=torch.nn.Linear(2, 2), vae=SimpleNamespace(decode=lambda z: z))
    probe = ModelCallProbe(adapter, (scorer,)).install()
    images = torch.rand(2, 3, 32, 32)
    try:
        worker = threading.Thread(target=lambda: scorer(images, ["a", "b"], {}))
        worker.start()
        worker.join()
        summary = probe.summary(0, 0.0, float("inf"))
    finally:
        probe.remove()
    assert summary["reward_model_calls"] >= 2 and summary["reward_model_s"] > 0  # backbone and head at least
    assert summary["union_all_s"] == pytest.approx(summary["reward_model_s"])  # backbone, then head: no overlap
    mark = len(probe.calls)
    scorer(images, ["a", "b"], {})
    assert len(probe.calls) == mark  # unhooked


def test_text_encoder_forwards_count_as_model_calls():
    """A prompt not seen before runs the pipeline's text encoders: every one of them is timed as a model call; a
    cached prompt runs none; the denoiser and the VAE are not taken for text encoders."""
    import sys

    from pipelines.adapters import build_adapter

    sys.path.insert(0, str(ROOT / "scripts"))
    from bench_t2i.probes import ModelCallProbe, text_encoders

    adapter = build_adapter("sd3", tiny=True)
    encoders = text_encoders(adapter)
    assert len(encoders) == 3 and adapter.denoiser not in encoders and adapter.vae not in encoders
    probe = ModelCallProbe(adapter).install()
    try:
        adapter.encode_prompts(["a red apple"])
        first = probe.summary(0, 0.0, float("inf"))
        mark = len(probe.calls)
        adapter.encode_prompts(["a red apple"])
        again = probe.summary(mark, 0.0, float("inf"))
    finally:
        probe.remove()
    assert first["text_encoder_calls"] >= 3 and first["text_encoder_s"] > 0
    assert first["union_all_s"] == pytest.approx(first["text_encoder_s"])  # one encoder after the other
    assert again["text_encoder_calls"] == 0


def test_merge_replaces_and_adds_rows_and_records_the_rerun(bench):
    """--merge: the rerun's recipes replace or join the recorded ones in RECIPES order, the header and published part
    stay, the rerun is listed as re-measured; other measuring settings are refused."""
    settings = {"recipes": "flow_grpo,refl", "iterations": 3, "warmup": 1, "num_threads": 1, "in_process": False}
    stamp = {"git": {"commit": "abc1234", "dirty": False}, "load_before": [1.0], "load_after": [2.0]}
    base = {"date": "old", "command": "c0", **stamp, "settings": dict(settings), "published": {"p": 1}}
    base["recipes"] = {"flow_grpo": {"v": 0}, "refl": {"v": 0}}
    run = {"date": "new", "command": "c1", **stamp, "settings": dict(settings), "published": {}}
    run["recipes"] = {"refl": {"v": 1}, "draft_lv": {"v": 1}}
    merged = bench.merge_run(json.loads(json.dumps(base)), run, "recipes", list(bench.RECIPES))
    assert merged["recipes"] == {"flow_grpo": {"v": 0}, "draft_lv": {"v": 1}, "refl": {"v": 1}}
    assert merged["settings"]["recipes"] == "flow_grpo,draft_lv,refl" and merged["published"] == {"p": 1}
    assert merged["date"] == "old" and merged["remeasured"][0]["recipes"] == ["refl", "draft_lv"]
    line = bench.remeasured_lines(merged)[0]
    assert line.startswith("- re-measured refl, draft_lv") and "new; git abc1234" in line and "`c1`" in line
    run["settings"]["iterations"] = 1
    with pytest.raises(SystemExit, match="iterations 3.*this run: iterations 1"):
        bench.merge_run(json.loads(json.dumps(base)), run, "recipes", list(bench.RECIPES))
