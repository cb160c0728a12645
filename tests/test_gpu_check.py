"""`scripts/gpu_check.py --tiny` runs every check end to end on CPU and writes a report whose figures are
real numbers; it never touches docs/gpu_validation.md when told to write elsewhere."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs" / "gpu_validation.md"
NOT_ON_CPU = {
    "peak memory GiB",
    "peak memory GiB (train step)",
    "peak memory GiB (rollout)",
    "1-edge peak memory GiB, checkpointed",
    "1-edge peak memory GiB, not checkpointed",
}  # no allocator statistics on CPU


def test_tiny_gpu_check_end_to_end(tmp_path):
    before = DOCS.read_bytes() if DOCS.exists() else None
    out = tmp_path / "report.md"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "gpu_check.py"),
            "--tiny",
            "--device",
            "cpu",
            "--out",
            str(out),
            "--peak-tflops",
            "1.0",
            "--threads",
            "1",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.with_suffix(".json").read_text())
    assert (DOCS.read_bytes() if DOCS.exists() else None) == before  # the committed report is left alone

    assert report["mode"] == "tiny" and report["info"]["peak_tflops"] == 1.0
    assert report["info"]["versions"]["torch"] and report["info"]["date"]
    # SD3.5, FLUX, Wan, text LoRA with transformers, with vLLM (or its skip), text full fine-tune (fp32 + autocast)
    assert len(report["sections"]) == 6
    full = report["sections"][-1]
    assert "full fine-tune" in full["title"] and full["settings"]["dtype"].startswith("float32 weights")
    ran = [s for s in report["sections"] if not s["skipped"]]
    assert len(ran) >= 4 and not any(s["error"] for s in ran)
    for sec in ran:
        assert sec["figures"], sec["title"]
        for name, value in sec["figures"].items():
            if name in NOT_ON_CPU:
                assert value is None
                continue
            assert isinstance(value, float) and math.isfinite(value), (sec["title"], name, value)
            if name.startswith("ratio |r - 1|"):
                assert value <= 1e-4, (sec["title"], name, value)  # on-policy ratio 1 in bf16
    sd35 = next(s for s in ran if "SD3.5" in s["title"])["figures"]
    for key in (
        "diffusers pipeline images/s",
        "ours images/s",
        "ours / diffusers images/s (ratio)",
        "MFU rollout ours",
        "MFU train step",
        "compiled / eager images/s (ratio)",
    ):
        assert sd35[key] > 0, key
    assert sd35["rollout TFLOP (counted, ours)"] > 0 and sd35["decoded images finite (1 = yes)"] == 1.0
    wan = next(s for s in ran if "Wan2.1-T2V-14B" in s["title"])
    assert (
        wan["figures"]["rollout frames/s"] > 0
        and wan["figures"]["train step s (1 edge: checkpointed fwd+bwd + AdamW)"] > 0
    )
    assert wan["settings"]["video"] == "5 frames x 32 x 32"
    wf = wan["figures"]
    for key in (
        "diffusers WanPipeline frames/s",
        "ours / diffusers frames/s (ratio)",
        "rollout TFLOP (counted, ours)",
        "rollout TFLOP (counted, diffusers)",
        "train step TFLOP (counted fwd+bwd, recompute included)",
        "MFU rollout ours",
        "MFU rollout diffusers",
        "MFU train step",
    ):
        assert wf[key] > 0, key
    # the baseline is the same work: from the same noise our ODE plan gives its latents (bf16 run: CFG rounding)
    assert wf["latents same shape, ours (ODE plan) and diffusers (1 = yes)"] == 1.0
    assert wf["latents max |ours - diffusers| / max |diffusers| (ODE plan)"] <= 2**-5
    for sec in ran:
        if "text GRPO" in sec["title"] or "full fine-tune" in sec["title"]:
            assert sec["figures"]["backward passes per step"] >= 1, sec["title"]  # a step that trains
    vllm = next(s for s in report["sections"] if s["title"].endswith("vllm"))
    assert vllm["skipped"] or not vllm["error"]
    text = out.read_text()
    assert "ratio \\|r - 1\\| max" in text  # table cells escape the bar
    assert "ours / diffusers images/s" in text and "FlopCounterMode" in text and "Tiny mode" in text


def test_real_size_models_fit_together_on_the_meta_device():
    """The real-size builders (published configs, stand-in encoders) give the transformer the inputs it
    expects at 512 px: one forward each on the meta device (no memory, no GPU)."""
    import torch

    from flowgrpo.gpu_check import models

    for build, n_text, params, cfg_mode in (
        (models.sd35_medium, 333, 2.2, "full"),
        (models.flux_dev, 512, 11.9, "none"),
    ):
        adapter = build(models.FULL, "meta", torch.bfloat16)
        assert abs(sum(p.numel() for p in adapter.denoiser.parameters()) / 1e9 - params) < 0.1
        adapter.add_lora(rank=32)
        embeds = adapter.encode_prompts(["a cat"])
        assert embeds.cond.shape[1] == n_text  # CLIP 77 + T5 256 (SD3.5), T5 512 (FLUX-dev)
        x = torch.randn(1, *adapter.latent_shape(512, 512), device="meta")
        with torch.no_grad():
            out = adapter.model_output(x, torch.tensor([0.5], device="meta"), embeds, 4.5, cfg_mode)
        assert out.shape == x.shape and out.dtype == torch.float32


def test_flowgrpo_gpu_check_command(capsys, monkeypatch):
    """`flowgrpo gpu-check` is the script's command: its options, and without CUDA and --tiny a one-line refusal
    (exit 2) before any model is built; from a checkout the report goes to the committed docs page."""
    import pytest
    import torch

    from flowgrpo.cli import main
    from flowgrpo.gpu_check.runner import DEFAULT_OUT

    assert DEFAULT_OUT == DOCS
    with pytest.raises(SystemExit) as exit_:
        main(["gpu-check", "--help"])
    assert exit_.value.code == 0 and "usage: flowgrpo gpu-check" in capsys.readouterr().out
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["gpu-check", "--skip", "vllm"]) == 2
    assert "no CUDA device here" in capsys.readouterr().err


def test_wan_real_size_model_on_the_meta_device():
    """The Wan check's real-size model: Wan2.1-T2V-14B's published transformer (14.3 B), 81 frames at 480 x 832 ->
    21 x 60 x 104 latents (32,760 tokens), 512 text rows of width 4096 from the stand-in encoder; one forward."""
    import torch

    from flowgrpo.gpu_check import video
    from pipelines.adapters import PromptEmbeds

    adapter = video.wan_t2v(video.FULL, "meta", torch.bfloat16)
    assert abs(sum(p.numel() for p in adapter.denoiser.parameters()) / 1e9 - 14.29) < 0.01
    assert adapter.latent_shape(480, 832) == (16, 21, 60, 104) and adapter.image_seq_len(480, 832) == 32760
    assert adapter.pipe.text_encoder.config.d_model == 4096 and adapter.max_sequence_length == 512
    adapter.add_lora(rank=32)
    rows = torch.zeros(1, 512, 4096, device="meta", dtype=torch.bfloat16)
    x = torch.randn(1, *adapter.latent_shape(480, 832), device="meta")
    with torch.no_grad():
        out = adapter.model_output(x, torch.tensor([0.5], device="meta"), PromptEmbeds(rows, rows), 5.0, "full")
    assert out.shape == x.shape and out.dtype == torch.float32


def test_wan_baseline_is_the_same_work_and_its_flops_scale_by_blocks():
    """In float32 at the real check's 4 steps, our ODE plan and WanPipeline with its UniPC at order 1 without
    corrector give the same latents from the same noise (float rounding), while the published UniPC (order 2,
    corrector) does not: the agreement figure tells them apart. FLOPs counted on 1 and 2 blocks and scaled by the
    block count equal the direct count of a 3-block model."""
    import copy
    import dataclasses

    import torch
    from diffusers import WanPipeline

    from flowgrpo.gpu_check import image, video
    from pipelines.plans import build_plan
    from pipelines.sampler import Sampler, SamplerConfig

    sizes = dataclasses.replace(video.TINY, steps=video.FULL.steps)
    adapter = video.wan_t2v(sizes, "cpu", torch.float32)
    image._activate_lora(adapter.add_lora(rank=4))
    sampler = Sampler(
        SamplerConfig(num_steps=sizes.steps, height=sizes.height, width=sizes.width, guidance_scale=video.GUIDANCE)
    )
    gap = "latents max |ours - diffusers| / max |diffusers| (ODE plan)"
    same = video.latent_agreement(adapter, sampler, video.euler_pipeline(adapter, sizes.steps), sizes, ["a cat"])
    published = WanPipeline(**adapter.pipe.components)
    published.set_progress_bar_config(disable=True)
    other = video.latent_agreement(adapter, sampler, published, sizes, ["a cat"])
    assert same["latents same shape, ours (ODE plan) and diffusers (1 = yes)"] == 1.0
    assert same[gap] <= video.agreement_tolerance(torch.float32) == 1e-5 < 1e-3 < other[gap]

    adapter.denoiser.blocks.append(copy.deepcopy(adapter.denoiser.blocks[0]))
    plan = build_plan("full_sde", sizes.steps)

    def rollout():
        return sampler.run(adapter, ["a cat"], plan, 1, torch.Generator().manual_seed(0))

    counted = image.counted_flops(rollout)
    assert video.block_scaled_flops(adapter.denoiser, rollout) == counted > 0
    assert len(adapter.denoiser.blocks) == 3  # the full model is back after the counts
