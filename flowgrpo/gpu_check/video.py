"""Video check: a Wan 2.1-T2V-14B-size transformer (pipelines.adapters.wan.WAN_SPECS, random weights) at
480 x 832 x 81 frames: rollout frames/s through our sampler and a LoRA train step (time, peak memory,
on-policy ratio), with gradient checkpointing of the blocks and the uncond CFG branch in its own no-grad
forward (what a 14B video step needs to fit one GPU).

Stand-ins (no hub): the text encoder is a 1-layer random UMT5 of the real output width (4096) and token count
(512, zero-padded as WanPipeline feeds them), and the VAE is a narrow random AutoencoderKLWan with Wan 2.1's
scale factors (4x temporal, 8x spatial, 16 latent channels): the denoiser sees real-size inputs, and the rollout
figure times denoising only (the decode of the stand-in VAE is not timed: it is not Wan's cost).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pipelines.adapters import WanAdapter, tiny_parts
from pipelines.adapters.wan import WAN_SPECS
from pipelines.plans import build_plan
from pipelines.sampler import Sampler, SamplerConfig
from pipelines.speed import SpeedConfig, apply_speed

from . import models
from .device import DeviceInfo, peak_memory_gib, reset_peak_memory
from .image import PROMPTS, TrainStep, _activate_lora, median_seconds, ratio_deviation
from .report import Section


@dataclass(frozen=True)
class VideoSizes:
    spec: str  # a WAN_SPECS key (tiny: the tiny test model)
    height: int
    width: int
    frames: int
    steps: int
    lora_rank: int
    repeats: int


FULL = VideoSizes(spec="wan2.1-t2v-14b", height=480, width=832, frames=81, steps=4, lora_rank=32, repeats=1)
TINY = VideoSizes(spec="tiny", height=32, width=32, frames=5, steps=2, lora_rank=4, repeats=1)


def wan_t2v(sizes: VideoSizes, device: str, dtype: torch.dtype) -> WanAdapter:
    """The spec's transformer with random weights and the stand-in encoder / VAE (module docstring)."""
    if sizes.spec == "tiny":
        return WanAdapter.tiny(dtype=dtype, device=device, num_frames=sizes.frames)
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    spec = WAN_SPECS[sizes.spec]
    tokenizer = tiny_parts.t5_tokenizer()
    with models.built_on(device, dtype):
        transformer = WanTransformer3DModel(**spec)
        text_encoder = UMT5EncoderModel(
            UMT5Config(vocab_size=len(tokenizer), d_model=spec["text_dim"], d_kv=64, d_ff=256, num_layers=1,
                       num_heads=4, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)
        )  # fmt: skip
        vae = AutoencoderKLWan(base_dim=8, z_dim=16, dim_mult=[1, 2, 4, 4], temperal_downsample=[False, True, True])
    scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0)
    pipe = WanPipeline(
        tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, scheduler=scheduler, transformer=transformer
    )
    return WanAdapter(pipe, num_frames=sizes.frames, max_sequence_length=512)


def wan_check(sizes: VideoSizes, info: DeviceInfo, dtype: torch.dtype, speed: SpeedConfig) -> Section:
    device = info.device
    name = {"tiny": "tiny stand-in for Wan2.1-T2V-14B", "wan2.1-t2v-14b": "Wan2.1-T2V-14B"}.get(sizes.spec, sizes.spec)
    sec = Section(f"{name}-size transformer: video rollout frames/s, LoRA step with gradient checkpointing")
    adapter = wan_t2v(sizes, device, dtype)
    params = adapter.add_lora(rank=sizes.lora_rank)
    _activate_lora(params)
    # split CFG: the uncond forward of a training pass keeps no activations (detach_uncond)
    speed = speed.model_copy(update={"gradient_checkpointing": True, "cfg_forward": "split"})
    sec.notes.append(f"speed switches: {apply_speed(adapter, speed)}; sampler.inference_mode on")
    sec.notes.append("rollout figure: denoising only; the stand-in VAE's decode is not timed")
    h, w, f = sizes.height, sizes.width, sizes.frames
    c, lf, lh, lw = adapter.latent_shape(h, w)
    sec.settings = {
        "denoiser parameters (B)": sum(p.numel() for p in adapter.denoiser.parameters()) / 1e9,
        "video": f"{f} frames x {h} x {w}",
        "latent": f"{c} x {lf} x {lh} x {lw} ({adapter.image_seq_len(h, w)} tokens)",
        "steps": sizes.steps,
        "videos": 1,
        "cfg": "full, 5.0 (rollout); detach_uncond, split forward (train)",
        "dtype": str(dtype).removeprefix("torch."),
        "lora rank": sizes.lora_rank,
        "train micro-batch (edges)": 1,
    }
    sampler = Sampler(
        SamplerConfig(num_steps=sizes.steps, height=h, width=w, guidance_scale=5.0, cfg_mode="full",
                      inference_mode=True)
    )  # fmt: skip
    prompts, plan = PROMPTS[:1], build_plan("full_sde", sizes.steps, train_fraction=1.0)

    def rollout():
        return sampler.run(adapter, prompts, plan, 1, torch.Generator().manual_seed(0))

    reset_peak_memory(device)
    t_rollout = median_seconds(rollout, device, sizes.repeats)
    tree = rollout()
    sec.figures.update(
        {
            "rollout s (all steps, 1 video)": t_rollout,
            "rollout frames/s": f / t_rollout,
            "rollout s per step (CFG: 2 forwards)": t_rollout / sizes.steps,
            "peak memory GiB (rollout)": peak_memory_gib(device),
            "ratio |r - 1| max, all trained edges (no grad)": ratio_deviation(sampler, adapter, tree, prompts, 1),
        }
    )
    step = TrainStep(sampler, adapter, params, tree, prompts, 1)
    sec.figures["ratio |r - 1| max, first micro-batch (with grad)"] = step.first_pass_deviation()
    reset_peak_memory(device)
    sec.figures["train step s (1 edge: checkpointed fwd+bwd + AdamW)"] = median_seconds(step, device, sizes.repeats)
    sec.figures["peak memory GiB (train step)"] = peak_memory_gib(device)
    return sec
