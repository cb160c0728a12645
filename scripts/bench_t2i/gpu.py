"""GPU mode: Flow-GRPO's whole trainer iteration on an SD3.5-M-sized random transformer at 512 px (first run on an
H200, 2026-11-27: docs/bench_t2i_gpu.json and its section of docs/benchmarks.md)."""

from __future__ import annotations

import json
import platform
import statistics
from pathlib import Path
from typing import Any

from .recipes import RECIPES_DIR, drive, quiet_overrides, quiet_warnings, summarize


GPU_SECTION = "## Text-to-image on GPU (SD3.5-M-sized transformer, random weights)"


def _register_sd35m_random() -> str:
    """An SD3 adapter whose 'tiny' pipeline is SD3.5-Medium-sized (random weights): the MMDiT of 24 layers,
    24 heads x 64, dual attention in layers 0-12, qk RMS-norm; the SD3 VAE's shape. Text encoders stay
    tiny (CLIP pooled 2 x 1024 and T5 width 4096 to match the transformer's inputs)."""
    from pipelines import adapters
    from pipelines.adapters import tiny_parts
    from pipelines.adapters.sd3 import SD3Adapter

    class SD35MediumRandom(SD3Adapter):
        family = "sd35m_random"

        @classmethod
        def _tiny_pipeline(cls, layers: int = 24, **_: Any) -> Any:
            from diffusers import (
                AutoencoderKL,
                FlowMatchEulerDiscreteScheduler,
                SD3Transformer2DModel,
                StableDiffusion3Pipeline,
            )

            transformer = SD3Transformer2DModel(
                sample_size=128,
                patch_size=2,
                in_channels=16,
                out_channels=16,
                num_layers=layers,
                attention_head_dim=64,
                num_attention_heads=24,
                joint_attention_dim=4096,
                caption_projection_dim=1536,
                pooled_projection_dim=2048,
                pos_embed_max_size=384,
                qk_norm="rms_norm",
                dual_attention_layers=tuple(range(min(13, layers))),
            )
            vae = AutoencoderKL(
                in_channels=3,
                out_channels=3,
                latent_channels=16,
                down_block_types=("DownEncoderBlock2D",) * 4,
                up_block_types=("UpDecoderBlock2D",) * 4,
                block_out_channels=(128, 256, 512, 512),
                layers_per_block=2,
                norm_num_groups=32,
                sample_size=1024,
                scaling_factor=1.5305,
                shift_factor=0.0609,
                use_quant_conv=False,
                use_post_quant_conv=False,
            )
            return StableDiffusion3Pipeline(
                transformer=transformer,
                scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
                vae=vae,
                text_encoder=tiny_parts.clip_text_model(True, projection=1024),
                tokenizer=tiny_parts.clip_tokenizer(),
                text_encoder_2=tiny_parts.clip_text_model(True, projection=1024),
                tokenizer_2=tiny_parts.clip_tokenizer(),
                text_encoder_3=tiny_parts.t5_encoder(4096),
                tokenizer_3=tiny_parts.t5_tokenizer(),
            )

    adapters.ADAPTERS[SD35MediumRandom.family] = SD35MediumRandom
    return SD35MediumRandom.family


PEAK_BF16_TFLOPS = (("H100 PCIe", 756.0), ("H100", 989.4), ("H200", 989.4), ("H800", 989.4), ("A100", 312.0))


def bench_gpu(args) -> dict[str, Any]:
    """Flow-GRPO on an SD3.5-M-sized random transformer at 512 px: rollout images/s, s/iteration, peak
    memory, MFU (denoiser FLOPs counted by torch's FlopCounterMode on one row; a grad row counts 2x a
    forward under LoRA: activation gradients, no base-weight gradients; 3x under full fine-tuning)."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from flowgrpo.t2i import load_t2i_config

    quiet_warnings()
    family = _register_sd35m_random()
    res = args.gpu_resolution
    overrides = quiet_overrides(Path(args.out_dir) / "gpu", args.num_threads, args.warmup + args.iterations) + [
        f"model.family={family}",
        f"model.device={args.gpu_device}",
        f"model.dtype={args.gpu_dtype}",
        f"model.tiny_options={{layers: {args.gpu_layers}, max_sequence_length: 256}}",
        "model.lora={rank: 32, alpha: 64}",
        f"sampler.height={res}",
        f"sampler.width={res}",
        f"sampler.num_steps={args.gpu_steps}",
        "sampler.guidance_scale=4.5",
        "sampler.cfg_mode=full",
        f"group_size={args.gpu_group}",
        f"prompts_per_iteration={args.gpu_prompts}",
        "rollout_prompts=1",
        f"train.micro_batch_size={args.gpu_micro}",
        "optim.lr=1e-4",
    ]
    cfg = load_t2i_config(RECIPES_DIR / "flow_grpo.yaml", overrides)
    cuda = cfg.model.device.startswith("cuda")

    def reset_peak():
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()

    run = drive(cfg, args.warmup, args.iterations, before_iteration=reset_peak)
    trainer = run["trainer"]
    adapter = trainer.adapter
    x = torch.randn(1, *adapter.latent_shape(res, res), device=adapter.device)
    embeds = adapter.encode_prompts([cfg.data.prompts[0]])  # outside the counter: text encoders are not counted
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        adapter.model_output(x, torch.tensor([0.5]), embeds, 4.5, "none")
    flops_row = counter.get_total_flops()  # on CPU, SDPA attention is not counted (CUDA kernels are)
    name = torch.cuda.get_device_name(0) if cuda else platform.processor()
    peak = args.peak_tflops or next((v for k, v in PEAK_BF16_TFLOPS if k in name), None)
    grad_factor = 2 if cfg.model.finetune == "lora" else 3
    rows = []
    for r in run["iterations"]:
        flops = flops_row * (r["nfe_nograd"] + grad_factor * r["nfe_grad"])
        roll = flops_row * r["rollout_nfe_nograd"]
        rows.append(
            {
                **r,
                "denoiser_tflop": flops / 1e12,
                "rollout_images_per_s": r["images"] / r["time_rollout_s"],
                "mfu": flops / (r["time_iteration_s"] * peak * 1e12) if peak else None,
                "rollout_mfu": roll / (r["time_rollout_s"] * peak * 1e12) if peak else None,
            }
        )
    measured = [r for r in rows if not r["warmup"]]
    mean = lambda k: statistics.fmean(r[k] for r in measured) if measured and measured[0][k] is not None else None
    params = sum(p.numel() for p in adapter.denoiser.parameters())
    return {
        "device": name,
        "peak_bf16_tflops": peak,
        "denoiser_params": params,
        "gflop_per_denoiser_row": flops_row / 1e9,
        "settings": {
            "resolution": res,
            "steps": cfg.sampler.num_steps,
            "group_size": cfg.group_size,
            "prompts_per_iteration": cfg.prompts_per_iteration,
            "cfg": "full (2 rows per state)",
            "dtype": cfg.model.dtype,
            "lora_rank": cfg.model.lora.rank,
            "layers": args.gpu_layers,
            "micro_batch_size": cfg.train.micro_batch_size,
        },
        "overrides": overrides,
        "iterations": rows,
        "summary": {
            "seconds_per_iteration_mean": mean("time_iteration_s"),
            "rollout_images_per_s": mean("rollout_images_per_s"),
            "peak_memory_mb": max((r["peak_memory_mb"] for r in measured), default=None),
            "mfu": mean("mfu"),
            "rollout_mfu": mean("rollout_mfu"),
            "phases_mean_s": summarize(measured)["phases_mean_s"] if measured else None,
        },
    }


def gpu_reading(result: dict) -> list[str]:
    """Where an iteration's time goes, computed from the measured iterations (so a re-run keeps it true): the
    trainer's phase timers (synchronised), the hooks' model-call times inside them (host clock), counted FLOPs."""
    g = result["gpu"]
    rows = [r for r in g["iterations"] if not r["warmup"]]
    if not rows:
        return []
    mean = lambda f: statistics.fmean(f(r) for r in rows)
    it, roll, train = (mean(lambda r, k=k: r[f"time_{k}_s"]) for k in ("iteration", "rollout", "train"))
    reward, wait = mean(lambda r: r["time_reward_s"]), mean(lambda r: r["time_reward_wait_s"])
    call = lambda k: mean(lambda r: r["model"][k])
    fwd0, fwd1, bwd, text = call("fwd_nograd_s"), call("fwd_grad_s"), call("backward_s"), call("text_encoder_s")
    row_tflop = g["gflop_per_denoiser_row"] / 1e3
    # forwards per grad row as bench_gpu counted them (2 under LoRA, 3 full), read back from its FLOP total
    r0 = rows[0]
    grad_factor = round((r0["denoiser_tflop"] / row_tflop - r0["nfe_nograd"]) / r0["nfe_grad"]) if r0["nfe_grad"] else 0
    roll_tflop = row_tflop * mean(lambda r: r["rollout_nfe_nograd"])
    train_tflop = row_tflop * grad_factor * mean(lambda r: r["nfe_grad"])
    total = row_tflop * mean(lambda r: r["nfe_nograd"] + grad_factor * r["nfe_grad"])
    peak = g["peak_bf16_tflops"]
    of_peak = lambda tflop, s: f"{tflop / s:.0f} TFLOP/s" + (f", {tflop / s / peak:.1%} of peak" if peak else "")
    model_train = fwd1 + bwd
    return [
        f"- Iteration {it:.2f} s (mean of the {len(rows)} measured iterations, after "
        f"{len(g['iterations']) - len(rows)} warm-up): rollout {roll:.2f} s ({roll / it:.0%}), "
        f"train {train:.2f} s ({train / it:.0%}), the main thread's wait for the last rewards {wait:.2f} s; scoring "
        f"({reward:.2f} s on the reward worker threads) overlaps the rollout.",
        f"- Rollout: denoiser forwards without grad {fwd0:.2f} s ({fwd0 / roll:.0%} of the phase; "
        f"{call('fwd_nograd_calls'):.0f} calls, {call('fwd_nograd_rows'):.0f} rows); the other {roll - fwd0:.2f} s "
        f"is the sampler's step math (SDE step, log-probs), text encoding ({text:.2f} s) and Python between calls.",
        f"- Train: forwards with grad {fwd1:.2f} s + backward passes {bwd:.2f} s = {model_train:.2f} s "
        f"({model_train / train:.0%} of the phase; {call('fwd_grad_calls'):.0f} calls, "
        f"{call('fwd_grad_rows'):.0f} rows); the other {train - model_train:.2f} s ({1 - model_train / train:.0%}) "
        "is overhead: the AdamW step, the log-prob and loss math, advantages.",
        f"- Outside every model call (forwards, decodes, backward passes): "
        f"{mean(lambda r: 1 - r['model']['union_all_s'] / r['wall_s']):.0%} of the iteration "
        f"({mean(lambda r: r['wall_s'] - r['model']['union_all_s']):.2f} s: the sampler's and "
        "the loss's math, the optimizer step, the reward wait, Python).",
        f"- FLOPs (denoiser only, counted; peak {peak} TFLOP/s dense bf16): {g['gflop_per_denoiser_row']:.0f} GFLOP "
        "per row; an iteration "
        f"{total:.0f} TFLOP ({of_peak(total, it)} over the iteration); the rollout's {roll_tflop:.0f} TFLOP at "
        f"{of_peak(roll_tflop, roll)} over its phase; the train phase's {train_tflop:.0f} TFLOP (a grad row = "
        f"{grad_factor} forwards) at {of_peak(train_tflop, train)}.",
        "- The phase timers synchronise the GPU; the hooks read the host clock without synchronising, so work "
        "still queued when a call returns is counted where the host next waits for it: the split inside a phase "
        "is approximate, the phase totals are not.",
    ]


def gpu_markdown(result: dict) -> str:
    """The GPU section of docs/benchmarks.md from bench.py --gpu's JSON (its optional `notes`: one bullet each)."""
    g, s, git = result["gpu"], result["gpu"]["summary"], result["git"]
    fmt = lambda v, f: "-" if v is None else format(v, f)
    return "\n".join(
        [
            GPU_SECTION,
            "",
            f"`{result['command']}`",
            "",
            f"- date (UTC): {result['date']}; git {git['commit']}{' (uncommitted changes)' if git['dirty'] else ''}; "
            f"device: {g['device']}; versions: " + ", ".join(f"{k} {v}" for k, v in result["versions"].items() if v),
            *(f"- {note}" for note in result.get("notes", [])),
            f"- Flow-GRPO, denoiser {g['denoiser_params'] / 1e9:.2f} B parameters (random), {g['gflop_per_denoiser_row']:.0f} "
            f"GFLOP per row; settings: {json.dumps(g['settings'])}",
            "- not the real model: random weights, tiny text encoders (272 text tokens: CLIP 16 + T5 256, SD3.5-M has "
            "333), brightness as the reward; MFU counts denoiser FLOPs only (FlopCounterMode on one row; a grad row = "
            "2 forwards under LoRA), over the trainer's iteration time",
            "",
            "| rollout images/s | s/iteration | peak memory (MB) | MFU (iteration) | MFU (rollout) |",
            "|---|---|---|---|---|",
            f"| {fmt(s['rollout_images_per_s'], '.2f')} | {fmt(s['seconds_per_iteration_mean'], '.2f')} | "
            f"{fmt(s['peak_memory_mb'], '.0f')} | {fmt(s['mfu'], '.1%')} | {fmt(s['rollout_mfu'], '.1%')} |",
            "",
            *(["Reading:", "", *reading, ""] if (reading := gpu_reading(result)) else []),
        ]
    )
