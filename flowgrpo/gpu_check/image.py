"""Image checks: SD3.5-Medium rollout / LoRA step / on-policy ratio / MFU against a plain diffusers
pipeline loop in the same run, then a FLUX.1-dev step with gradient checkpointing.

FLOPs are counted, not estimated: torch.utils.flop_counter.FlopCounterMode over one untimed run of the
very code that is timed. It counts 2 m n k per (m x k)(k x n) matmul / convolution equivalent and
4 b h s_q s_kv d per attention forward (its two matmuls; backward 2x that). MFU = counted FLOPs /
(median wall seconds x the device's dense bf16 peak). Element-wise work (norms, activations,
softmax) is not counted, as in the usual MFU convention; on CPU the SDPA kernel is not counted either.
"""

from __future__ import annotations

import importlib.util
import statistics
from typing import Any, Callable, Optional

import torch
from torch.utils.flop_counter import FlopCounterMode

from flowgrpo.core import LossConfig, LossNormalizer
from flowgrpo.t2i.objectives import EdgeObjective, edge_batch
from pipelines.plans import build_plan
from pipelines.sampler import Sampler, SamplerConfig
from pipelines.speed import CompileConfig, SpeedConfig, apply_speed, compile_blocks, set_attention_backend

from . import models
from .device import DeviceInfo, peak_memory_gib, reset_peak_memory, timed
from .report import Section

PROMPTS = [
    "a photograph of an astronaut riding a horse",
    "a red bicycle leaning on a blue wall",
    "a bowl of ramen, studio lighting",
    "an oil painting of a lighthouse at dusk",
]


def counted_flops(fn: Callable[[], Any]) -> float:
    with FlopCounterMode(display=False) as counter:
        fn()
    return float(counter.get_total_flops())


def median_seconds(fn: Callable[[], Any], device: str, repeats: int) -> float:
    """Median wall time of `repeats` calls after one warm-up call (compilation, caches, allocator)."""
    fn()
    times: list[float] = []
    for _ in range(repeats):
        with timed(device, times):
            fn()
    return statistics.median(times)


def mfu(flops: float, seconds: float, info: DeviceInfo) -> Optional[float]:
    return None if info.peak_tflops is None else flops / seconds / (info.peak_tflops * 1e12)


def _activate_lora(params: list[torch.nn.Parameter], seed: int = 0) -> None:
    """Non-zero LoRA B (it starts at 0), so the fp32 LoRA path is part of every checked output."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in params:
            p.add_(1e-3 * torch.randn(p.shape, generator=g).to(p.device, p.dtype))


def ratio_deviation(sampler: Sampler, adapter, tree, prompts: list[str], micro: int) -> float:
    """max |exp(logp_new - logp_old) - 1| over every trained edge, re-scored (no grad) by the same weights."""
    edges = tree.trained_edges()
    worst = 0.0
    with torch.no_grad():
        for part in edges.split(micro):
            logp = sampler.rescore(adapter, tree, part, prompts).logp.float().cpu()
            worst = max(worst, float((logp - tree.edge_logp[part]).exp().sub(1).abs().max()))
    return worst


class TrainStep:
    """One GRPO micro-batch (re-score -> flowgrpo.core.policy_loss -> backward) and an AdamW step."""

    def __init__(self, sampler: Sampler, adapter, params, tree, prompts: list[str], micro: int):
        self.sampler, self.adapter, self.tree, self.prompts = sampler, adapter, tree, prompts
        self.objective = EdgeObjective(sampler, LossConfig(preset="flow_grpo"))
        self.optimizer = torch.optim.AdamW(params, lr=1e-6)
        edges = tree.trained_edges()[:micro]
        adv = torch.randn(edges.numel(), generator=torch.Generator().manual_seed(0))
        self.batch = edge_batch(tree, edges, adv, torch.ones(edges.numel()))
        self.norm = LossNormalizer.from_inputs(self.batch.inputs())

    def forward_backward(self) -> torch.Tensor:
        edge_loss = self.objective(self.adapter, self.tree, self.batch, self.prompts, self.norm)
        edge_loss.output.loss.backward()
        return edge_loss.logp

    def __call__(self) -> torch.Tensor:
        logp = self.forward_backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return logp

    def first_pass_deviation(self) -> float:
        """The trainer's live check: the first micro-batch (with grad) of a fresh rollout gives ratio 1."""
        logp = self.forward_backward()
        self.optimizer.zero_grad(set_to_none=True)
        return float((logp.float().cpu() - self.batch.logp_old).exp().sub(1).abs().max())


def sd35_check(
    sizes: models.Sizes, info: DeviceInfo, dtype: torch.dtype, speed: SpeedConfig, compile_variant: bool
) -> Section:
    device = info.device
    sec = Section(models.stand_in(sizes) + "SD3.5-Medium-size transformer: rollout, LoRA step, MFU, on-policy ratio")
    adapter = models.sd35_medium(sizes, device, dtype)
    params = adapter.add_lora(rank=sizes.lora_rank)
    _activate_lora(params)
    sec.notes.append(f"speed switches: {apply_speed(adapter, speed)}; sampler.inference_mode on")
    n_params = sum(p.numel() for p in adapter.denoiser.parameters())
    res, steps, P, G = sizes.resolution, sizes.steps, sizes.prompts, sizes.group
    prompts = PROMPTS[:P]
    sec.settings = {
        "denoiser parameters (B)": n_params / 1e9,
        "resolution": res,
        "steps": steps,
        "prompts x group": f"{P} x {G}",
        "cfg": "full, 4.5",
        "dtype": str(dtype).removeprefix("torch."),
        "lora rank": sizes.lora_rank,
        "train micro-batch (edges)": sizes.micro_batch,
    }
    sampler = Sampler(
        SamplerConfig(num_steps=steps, height=res, width=res, guidance_scale=4.5, cfg_mode="full", inference_mode=True)
    )
    plan = build_plan("full_sde", steps)

    def ours():
        tree = sampler.run(adapter, prompts, plan, G, torch.Generator().manual_seed(0))
        with torch.no_grad():
            return tree, adapter.decode(tree.leaf_latents().flatten(0, 1), [p for p in prompts for _ in range(G)])

    def diffusers_loop():
        return adapter.pipe(
            prompt=prompts,
            num_images_per_prompt=G,
            num_inference_steps=steps,
            guidance_scale=4.5,
            height=res,
            width=res,
            output_type="pt",
            generator=torch.Generator().manual_seed(0),
            max_sequence_length=adapter.max_sequence_length,
        ).images

    adapter.pipe.set_progress_bar_config(disable=True)  # no terminal output inside the timed loop
    images = P * G
    t_pipe = median_seconds(diffusers_loop, device, sizes.repeats)  # before any compile: the plain pipeline
    t_ours = median_seconds(ours, device, sizes.repeats)
    f_pipe, f_ours = counted_flops(diffusers_loop), counted_flops(ours)
    sec.figures.update(
        {
            "diffusers pipeline images/s": images / t_pipe,
            "ours images/s": images / t_ours,
            "ours / diffusers images/s (ratio)": t_pipe / t_ours,
            "rollout TFLOP (counted, ours)": f_ours / 1e12,
            "rollout TFLOP (counted, diffusers)": f_pipe / 1e12,
            "MFU rollout ours": mfu(f_ours, t_ours, info),
            "MFU rollout diffusers": mfu(f_pipe, t_pipe, info),
        }
    )

    tree, decoded = ours()
    sec.figures["decoded images finite (1 = yes)"] = float(bool(torch.isfinite(decoded).all()))
    sec.figures["ratio |r - 1| max, all trained edges (no grad)"] = ratio_deviation(
        sampler, adapter, tree, prompts, sizes.micro_batch
    )
    step = TrainStep(sampler, adapter, params, tree, prompts, sizes.micro_batch)
    sec.figures["ratio |r - 1| max, first micro-batch (with grad)"] = step.first_pass_deviation()
    f_train = counted_flops(step.forward_backward)
    step.optimizer.zero_grad(set_to_none=True)
    reset_peak_memory(device)
    t_train = median_seconds(step, device, sizes.repeats)
    sec.figures.update(
        {
            "train step s (micro-batch fwd+bwd + AdamW)": t_train,
            "train step TFLOP (counted fwd+bwd)": f_train / 1e12,
            "MFU train step": mfu(f_train, t_train, info),
            "peak memory GiB (train step)": peak_memory_gib(device),
        }
    )

    sec.figures.update(attention_variant(adapter, ours, t_ours, images, info, sizes.repeats, sec.notes))
    if compile_variant:
        backend = speed.compile.backend if speed.compile.enabled else sizes.compile_backend
        cfg = CompileConfig(enabled=True, backend=backend)
        sec.figures["compiled blocks"] = float(compile_blocks(adapter, cfg))
        compile_s: list[float] = []
        with timed(device, compile_s):
            tree_c, _ = ours()  # the first call compiles
        t_ours_c = median_seconds(ours, device, sizes.repeats)
        sec.figures.update(
            {
                "compile s (first compiled rollout)": compile_s[0],
                "ours compiled images/s": images / t_ours_c,
                "compiled / eager images/s (ratio)": t_ours / t_ours_c,
                "compiled / diffusers images/s (ratio)": t_pipe / t_ours_c,
                "MFU rollout ours compiled": mfu(f_ours, t_ours_c, info),
                "ratio |r - 1| max, compiled (no grad)": ratio_deviation(
                    sampler, adapter, tree_c, prompts, sizes.micro_batch
                ),
            }
        )
        step_c = TrainStep(sampler, adapter, params, tree_c, prompts, sizes.micro_batch)
        t_train_c = median_seconds(step_c, device, sizes.repeats)
        sec.figures.update(
            {"train step s, compiled": t_train_c, "compiled / eager train step (speed ratio)": t_train / t_train_c}
        )
        sec.notes.append(f"regional compile: each block compiled on its own, backend {backend}")
    return sec


def attention_variant(
    adapter, rollout: Callable[[], Any], t_native: float, images: int, info: DeviceInfo, repeats: int, notes: list[str]
) -> dict[str, Optional[float]]:
    """Our rollout with xformers attention against PyTorch SDPA, when xformers is installed (CUDA)."""
    if importlib.util.find_spec("xformers") is None or not info.device.startswith("cuda"):
        notes.append(
            "attention: PyTorch SDPA only (xformers variant skipped: "
            + ("not installed)" if importlib.util.find_spec("xformers") is None else "needs CUDA)")
        )
        return {}
    before = adapter.denoiser.attn_processors
    try:
        set_attention_backend(adapter, "xformers")
        t = median_seconds(rollout, info.device, repeats)
    finally:
        adapter.denoiser.set_attn_processor(before)  # back to the processors the other figures used
    return {"ours images/s, xformers attention": images / t, "xformers / SDPA images/s (ratio)": t_native / t}


def flux_check(sizes: models.Sizes, info: DeviceInfo, dtype: torch.dtype, speed: SpeedConfig) -> Section:
    """FLUX.1-dev-size LoRA step with gradient checkpointing of the blocks: time and peak memory."""
    device = info.device
    sec = Section(models.stand_in(sizes) + "FLUX.1-dev-size transformer: LoRA step with gradient checkpointing")
    adapter = models.flux_dev(sizes, device, dtype)
    params = adapter.add_lora(rank=sizes.lora_rank)
    _activate_lora(params)
    speed = speed.model_copy(update={"gradient_checkpointing": True, "compile": CompileConfig()})
    sec.notes.append(f"speed switches: {apply_speed(adapter, speed)}")
    res, micro = sizes.flux_resolution, sizes.flux_micro_batch
    sec.settings = {
        "denoiser parameters (B)": sum(p.numel() for p in adapter.denoiser.parameters()) / 1e9,
        "resolution": res,
        "steps": sizes.flux_steps,
        "cfg": "none (guidance embedding 3.5)",
        "lora rank": sizes.lora_rank,
        "train micro-batch (edges)": micro,
    }
    sampler = Sampler(
        SamplerConfig(
            num_steps=sizes.flux_steps, height=res, width=res, guidance_scale=3.5, cfg_mode="none", inference_mode=True
        )
    )
    prompts = PROMPTS[:1]
    tree = sampler.run(
        adapter,
        prompts,
        build_plan("full_sde", sizes.flux_steps),
        max(2, micro // sizes.flux_steps),
        torch.Generator().manual_seed(0),
    )
    step = TrainStep(sampler, adapter, params, tree, prompts, micro)
    sec.figures["ratio |r - 1| max, first micro-batch (with grad)"] = step.first_pass_deviation()
    reset_peak_memory(device)
    sec.figures["train step s (checkpointed fwd+bwd + AdamW)"] = median_seconds(step, device, sizes.repeats)
    sec.figures["peak memory GiB (train step)"] = peak_memory_gib(device)
    # what checkpointing buys: one edge per micro-batch, with and without it (without fits at 1 edge)
    single = {}
    for on in (True, False):
        (adapter.denoiser.enable_gradient_checkpointing if on else adapter.denoiser.disable_gradient_checkpointing)()
        reset_peak_memory(device)
        single[on] = (
            median_seconds(TrainStep(sampler, adapter, params, tree, prompts, 1), device, 1),
            peak_memory_gib(device),
        )
    sec.figures.update(
        {
            "1-edge step s, checkpointed": single[True][0],
            "1-edge step s, not checkpointed": single[False][0],
            "1-edge peak memory GiB, checkpointed": single[True][1],
            "1-edge peak memory GiB, not checkpointed": single[False][1],
            "checkpointed / not step time (ratio)": single[True][0] / single[False][0],
        }
    )
    return sec
