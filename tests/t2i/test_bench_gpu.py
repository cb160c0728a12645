"""scripts/bench.py's GPU record without a GPU: the reading of the phases computed from an iteration record (numbers
worked out by hand here), the committed H200 record rendered as its section, --gpu-render, the CPU section's pointer
to the GPU figures, and machine() naming the GPU when the run uses CUDA."""

from __future__ import annotations

import copy
import importlib.util
import json
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
RECORD = ROOT / "docs" / "bench_t2i_gpu.json"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_t2i_script_gpu", ROOT / "scripts" / "bench.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # puts the repository root on sys.path: scripts.bench_t2i imports below
    return module


def _iteration(warmup: bool) -> dict:
    # 10 s: rollout 4 (forwards 3), train 5 (forwards 2 + backward 1.5), model calls 8 s in all; 10 no-grad rows,
    # 4 grad rows counted at 2 forwards each: (10 + 2 x 4) rows x 1 TFLOP = 18 TFLOP
    return {
        "warmup": warmup,
        "wall_s": 10.0,
        "time_iteration_s": 10.0,
        "time_rollout_s": 4.0,
        "time_train_s": 5.0,
        "time_reward_s": 0.5,
        "time_reward_wait_s": 1.0,
        "nfe_nograd": 10,
        "nfe_grad": 4,
        "rollout_nfe_nograd": 10,
        "denoiser_tflop": 18.0,
        "model": {
            "fwd_nograd_s": 3.0,
            "fwd_nograd_calls": 2,
            "fwd_nograd_rows": 10,
            "fwd_grad_s": 2.0,
            "fwd_grad_calls": 2,
            "fwd_grad_rows": 4,
            "backward_s": 1.5,
            "text_encoder_s": 0.25,
            "union_all_s": 8.0,
        },
    }


def test_gpu_reading_by_hand(bench):
    from scripts.bench_t2i.gpu import gpu_reading

    slow = _iteration(False)
    slow.update(wall_s=1e3, time_iteration_s=1e3)  # the warm-up is left out of every mean
    result = {"gpu": {"gflop_per_denoiser_row": 1000.0, "peak_bf16_tflops": 9.0}}
    result["gpu"]["iterations"] = [slow | {"warmup": True}, _iteration(False), _iteration(False)]
    text = "\n".join(gpu_reading(result))
    assert "Iteration 10.00 s (mean of the 2 measured iterations, after 1 warm-up): rollout 4.00 s (40%)" in text
    assert "train 5.00 s (50%)" in text and "rewards 1.00 s" in text
    assert "without grad 3.00 s (75% of the phase; 2 calls, 10 rows); the other 1.00 s" in text
    assert "text encoding (0.25 s)" in text
    assert "2.00 s + backward passes 1.50 s = 3.50 s (70% of the phase" in text and "other 1.50 s (30%)" in text
    assert "20% of the iteration (2.00 s" in text
    # 18 TFLOP / 10 s = 1.8 TFLOP/s = 20% of 9; rollout 10 TFLOP / 4 s; train 8 TFLOP / 5 s (a grad row = 2)
    assert "an iteration 18 TFLOP (2 TFLOP/s, 20.0% of peak" in text
    assert "rollout's 10 TFLOP at 2 TFLOP/s, 27.8% of peak" in text
    assert "train phase's 8 TFLOP (a grad row = 2 forwards) at 2 TFLOP/s, 17.8% of peak" in text
    result["gpu"]["iterations"] = [slow | {"warmup": True}]
    assert gpu_reading(result) == []


def test_committed_record_renders(bench, tmp_path):
    from scripts.bench_t2i.gpu import GPU_SECTION, gpu_markdown

    record = json.loads(RECORD.read_text())
    assert record["git"]["commit"] == "cda410b" and record["machine"]["gpu"] == record["gpu"]["device"]
    section = gpu_markdown(record)
    assert section.startswith(GPU_SECTION) and "git cda410b" in section and "stale git metadata" in section
    assert "| 3.50 | 14.52 | 52971 | 14.8% | 16.8% |" in section  # the run's own table
    assert "- Iteration 14.52 s (mean of the 3 measured iterations, after 1 warm-up)" in section
    # --gpu-render writes the same section into --markdown, keeping the other sections
    md = tmp_path / "benchmarks.md"
    md.write_text("# Benchmarks\n\n## Other\n\nkeep me\n")
    bench.main(["--gpu-render", str(RECORD), "--markdown", str(md)])
    text = md.read_text()
    assert "keep me" in text and text.count(GPU_SECTION) == 1 and section.strip() in text
    bad = tmp_path / "cpu.json"
    bad.write_text(json.dumps({"recipes": {}}))
    with pytest.raises(SystemExit):
        bench.main(["--gpu-render", str(bad), "--markdown", str(md)])


def test_cpu_section_points_to_the_gpu_record(bench):
    from scripts.bench_t2i.report import gpu_pointer, load_gpu, reading

    record = load_gpu()
    assert record is not None and load_gpu(ROOT / "docs" / "no_such.json") is None
    assert "none recorded" in gpu_pointer(None) and "not been run" not in gpu_pointer(None)
    line = gpu_pointer(record)
    assert "NVIDIA H200" in line and "14.52 s per Flow-GRPO iteration" in line
    cpu = json.loads((ROOT / "docs" / "bench_t2i.json").read_text())
    outside = [s for s in reading(cpu, record) if s.startswith("- Outside")][0]
    assert "On the GPU run" in outside and "22% outside forwards, decodes and backward passes" in outside
    without = [s for s in reading(cpu, None) if s.startswith("- Outside")][0]
    assert "no GPU run is recorded" in without
    # the share follows the record: no time outside model calls gives 0%
    full = copy.deepcopy(record)
    for r in full["gpu"]["iterations"]:
        r["model"]["union_all_s"] = r["wall_s"]
    assert "0% outside forwards, decodes and backward passes" in [s for s in reading(cpu, full) if "Outside" in s][0]


def test_machine_names_the_gpu(bench, monkeypatch):
    from scripts.bench_t2i.report import machine

    assert machine(1)["gpu"] is None and machine(1, "cpu")["gpu"] is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: f"NVIDIA H200 ({device})")
    assert machine(1, "cuda")["gpu"] == "NVIDIA H200 (cuda)"
    assert machine(1, "cuda:1")["gpu"] == "NVIDIA H200 (cuda:1)"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert machine(1, "cuda")["gpu"] is None
