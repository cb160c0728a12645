"""Video check: a Wan 2.1-T2V-14B-size transformer (pipelines.adapters.wan.WAN_SPECS, random weights) at
480 x 832 x 81 frames: rollout frames/s through our sampler against diffusers' own `WanPipeline.__call__` on the
same components, counted FLOPs and MFU of both, and a LoRA train step (time, FLOPs, MFU, peak memory, on-policy
ratio), with gradient checkpointing of the blocks and the uncond CFG branch in its own no-grad forward (what a
14B video step needs to fit one GPU).

Stand-ins (no hub): the text encoder is a 1-layer random UMT5 of the real output width (4096) and token count
(512, zero-padded as WanPipeline feeds them), and the VAE is a narrow random AutoencoderKLWan with Wan 2.1's
scale factors (4x temporal, 8x spatial, 16 latent channels): the denoiser sees real-size inputs. Both rollout
figures time denoising only (the baseline returns latents, ours decodes nothing): the stand-in VAE is not Wan's cost.

The baseline is the same work: its scheduler is the pipeline's own UniPCMultistepScheduler (flow sigmas, shift 3)
at order 1 without the corrector, whose update on that grid is exactly the Euler step (first-order UniPC is DDIM in
x0-space; with alpha = 1 - sigma that is x + (sigma_next - sigma) v). Our ODE plan on the same noise therefore
gives the baseline's latents, which the tiny mode checks (`latent_agreement`); the timed rollout of ours runs the
full_sde plan (its SDE step maths and log-probs are part of our cost).

FLOPs are counted as in the image check (image.counted_flops). At 14B a counted run of each rollout and of the
train step would cost as much as a timed one, so they are counted on the first 1 and 2 blocks and scaled by the
block count (`block_scaled_flops`): every forward runs the same blocks on the same shapes, so the count is linear
in the number of blocks and the scaling is exact.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

import torch

from pipelines.adapters import WanAdapter, tiny_parts
from pipelines.adapters.wan import WAN_SPECS
from pipelines.plans import build_plan
from pipelines.sampler import Sampler, SamplerConfig
from pipelines.speed import SpeedConfig, apply_speed

from . import models
from .device import DeviceInfo, peak_memory_gib, reset_peak_memory
from .image import PROMPTS, TrainStep, _activate_lora, counted_flops, median_seconds, mfu, ratio_deviation
from .report import Section

GUIDANCE = 5.0  # Wan 2.1's default guidance_scale (WanPipeline's)


@dataclass(frozen=True)
class VideoSizes:
    spec: str  # a WAN_SPECS key (tiny: the tiny test model)
    height: int
    width: int
    frames: int
    steps: int
    lora_rank: int
    repeats: int
    check_latents: bool  # run ours (ODE plan) and the baseline on the same noise and compare the latents


FULL = VideoSizes(
    spec="wan2.1-t2v-14b", height=480, width=832, frames=81, steps=4, lora_rank=32, repeats=1, check_latents=False
)
TINY = VideoSizes(spec="tiny", height=32, width=32, frames=5, steps=2, lora_rank=4, repeats=1, check_latents=True)


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


def euler_pipeline(adapter: WanAdapter, steps: int) -> Any:
    """A WanPipeline on the adapter's own components whose scheduler (the same UniPC, same grid) steps by Euler:
    order 1, corrector off at every step (module docstring)."""
    from diffusers import WanPipeline

    scheduler = type(adapter.pipe.scheduler).from_config(
        adapter.pipe.scheduler.config, solver_order=1, disable_corrector=list(range(steps))
    )
    pipe = WanPipeline(**{**adapter.pipe.components, "scheduler": scheduler})
    pipe.set_progress_bar_config(disable=True)  # no terminal output inside the timed loop
    return pipe


@contextlib.contextmanager
def first_blocks(denoiser: Any, n: int) -> Iterator[None]:
    """The denoiser runs only its first `n` transformer blocks inside the block (the others are put back after)."""
    blocks = denoiser.blocks
    denoiser.blocks = torch.nn.ModuleList(list(blocks)[:n])
    try:
        yield
    finally:
        denoiser.blocks = blocks


def block_count(denoiser: Any) -> int:
    return len(denoiser.blocks)


def block_scaled_flops(denoiser: Any, fn: Callable[[], Any]) -> float:
    """Counted FLOPs of `fn` with every block, from counts with 1 and 2 blocks: F(L) = F(1) + (L - 1) (F(2) - F(1))."""
    n = block_count(denoiser)
    with first_blocks(denoiser, 1):
        one = counted_flops(fn)
    with first_blocks(denoiser, 2):
        two = counted_flops(fn)
    return one + (n - 1) * (two - one)


def agreement_tolerance(dtype: torch.dtype) -> float:
    """Bound on max |ours - diffusers| / max |diffusers| of the ODE latents. The pipeline combines CFG in the
    weights' dtype (uncond + w (cond - uncond), bf16 in a bf16 run), ours in float32: a few ulps of the dtype."""
    return max(4 * torch.finfo(dtype).eps, 1e-5)


def latent_agreement(
    adapter: WanAdapter, sampler: Sampler, pipe: Any, sizes: VideoSizes, prompts: list[str]
) -> dict[str, Optional[float]]:
    """Ours on the ODE plan and the baseline pipeline from the same initial noise: same shape, and how far apart."""
    plan = build_plan("ode_only", sizes.steps)
    tree = sampler.run(adapter, prompts, plan, 1, torch.Generator().manual_seed(0))
    ours = tree.leaf_latents().flatten(0, 1).float()
    theirs = pipe(**_call_args(adapter, sizes, prompts), latents=tree.states[tree.depth == 0].clone()).frames.float()
    same = ours.shape == theirs.shape
    gap = float((ours - theirs).abs().max() / theirs.abs().max()) if same else None
    return {
        "latents same shape, ours (ODE plan) and diffusers (1 = yes)": float(same),
        "latents max |ours - diffusers| / max |diffusers| (ODE plan)": gap,
    }


def _call_args(adapter: WanAdapter, sizes: VideoSizes, prompts: list[str]) -> dict[str, Any]:
    return dict(
        prompt=prompts, num_inference_steps=sizes.steps, guidance_scale=GUIDANCE, height=sizes.height,
        width=sizes.width, num_frames=sizes.frames, output_type="latent",
        max_sequence_length=adapter.max_sequence_length,
    )  # fmt: skip


def wan_check(sizes: VideoSizes, info: DeviceInfo, dtype: torch.dtype, speed: SpeedConfig) -> Section:
    device = info.device
    name = {"tiny": "tiny stand-in for Wan2.1-T2V-14B", "wan2.1-t2v-14b": "Wan2.1-T2V-14B"}.get(sizes.spec, sizes.spec)
    sec = Section(f"{name}-size transformer: video rollout frames/s against WanPipeline, MFU, LoRA step with "
                  "gradient checkpointing")  # fmt: skip
    adapter = wan_t2v(sizes, device, dtype)
    params = adapter.add_lora(rank=sizes.lora_rank)
    _activate_lora(params)
    # split CFG: the uncond forward of a training pass keeps no activations (detach_uncond)
    speed = speed.model_copy(update={"gradient_checkpointing": True, "cfg_forward": "split"})
    sec.notes.append(f"speed switches: {apply_speed(adapter, speed)}; sampler.inference_mode on")
    sec.notes.append("rollout figures: denoising only (the baseline returns latents); no VAE decode is timed")
    h, w, f = sizes.height, sizes.width, sizes.frames
    c, lf, lh, lw = adapter.latent_shape(h, w)
    sec.settings = {
        "denoiser parameters (B)": sum(p.numel() for p in adapter.denoiser.parameters()) / 1e9,
        "video": f"{f} frames x {h} x {w}",
        "latent": f"{c} x {lf} x {lh} x {lw} ({adapter.image_seq_len(h, w)} tokens)",
        "steps": sizes.steps,
        "videos": 1,
        "cfg": f"full, {GUIDANCE:g} (rollout, both: 2 forwards per step); detach_uncond, split forward (train)",
        "baseline": "WanPipeline.__call__, same components, its UniPC at order 1 without corrector (Euler)",
        "dtype": str(dtype).removeprefix("torch."),
        "lora rank": sizes.lora_rank,
        "train micro-batch (edges)": 1,
    }
    sampler = Sampler(
        SamplerConfig(num_steps=sizes.steps, height=h, width=w, guidance_scale=GUIDANCE, cfg_mode="full",
                      inference_mode=True)
    )  # fmt: skip
    prompts, plan = PROMPTS[:1], build_plan("full_sde", sizes.steps, train_fraction=1.0)
    pipe = euler_pipeline(adapter, sizes.steps)
    last: list[Any] = []  # the timed rollout's tree: the ratio and train figures use it (no extra 14B rollout)

    def rollout() -> None:
        last[:] = [sampler.run(adapter, prompts, plan, 1, torch.Generator().manual_seed(0))]

    def diffusers_rollout() -> Any:
        return pipe(**_call_args(adapter, sizes, prompts), generator=torch.Generator().manual_seed(0)).frames

    t_pipe = median_seconds(diffusers_rollout, device, sizes.repeats)
    reset_peak_memory(device)
    t_rollout = median_seconds(rollout, device, sizes.repeats)
    tree = last[0]
    sec.figures.update(
        {
            "rollout s (all steps, 1 video)": t_rollout,
            "rollout frames/s": f / t_rollout,
            "rollout s per step (CFG: 2 forwards)": t_rollout / sizes.steps,
            "peak memory GiB (rollout)": peak_memory_gib(device),
            "diffusers WanPipeline rollout s (latents out)": t_pipe,
            "diffusers WanPipeline frames/s": f / t_pipe,
            "ours / diffusers frames/s (ratio)": t_pipe / t_rollout,
        }
    )
    f_ours = block_scaled_flops(adapter.denoiser, rollout)
    f_pipe = block_scaled_flops(adapter.denoiser, diffusers_rollout)
    sec.figures.update(
        {
            "rollout TFLOP (counted, ours)": f_ours / 1e12,
            "rollout TFLOP (counted, diffusers)": f_pipe / 1e12,
            "MFU rollout ours": mfu(f_ours, t_rollout, info),
            "MFU rollout diffusers": mfu(f_pipe, t_pipe, info),
            "ratio |r - 1| max, all trained edges (no grad)": ratio_deviation(sampler, adapter, tree, prompts, 1),
        }
    )
    step = TrainStep(sampler, adapter, params, tree, prompts, 1)
    sec.figures["ratio |r - 1| max, first micro-batch (with grad)"] = step.first_pass_deviation()
    f_train = block_scaled_flops(adapter.denoiser, step.forward_backward)
    step.optimizer.zero_grad(set_to_none=True)
    reset_peak_memory(device)
    t_train = median_seconds(step, device, sizes.repeats)
    sec.figures.update(
        {
            "train step s (1 edge: checkpointed fwd+bwd + AdamW)": t_train,
            "train step TFLOP (counted fwd+bwd, recompute included)": f_train / 1e12,
            "MFU train step": mfu(f_train, t_train, info),
            "peak memory GiB (train step)": peak_memory_gib(device),
        }
    )
    sec.notes.append(
        f"FLOPs counted with the first 1 and 2 of the {block_count(adapter.denoiser)} blocks and scaled by the block "
        "count (exact: the count is linear in it); the train step's count holds the checkpointed blocks' recompute "
        "(work the device does); the baseline's holds its per-call prompt encoding (ours caches it)"
    )
    if sizes.check_latents:
        sec.figures.update(latent_agreement(adapter, sampler, pipe, sizes, prompts))
        sec.notes.append(
            "same work: from the same noise, our ODE plan and the baseline give latents within "
            f"{agreement_tolerance(dtype):.3g} of max |latent| (tolerance for {str(dtype).removeprefix('torch.')}: "
            "the pipeline combines CFG in the weights' dtype, ours in float32)"
        )
    else:
        sec.notes.append("latent agreement with the baseline: checked in tiny mode (the same code), not at this size")
    return sec
