"""Text check: GRPO steps of the text trainer on a Qwen2.5-0.5B-size random model (LoRA, bf16), with
transformers `generate` and, when vLLM is installed on a CUDA machine, with the colocated vLLM engine.

The model is written to a temporary folder first (random weights, byte-level tokenizer), so both
backends load it the way they load a real local model. The trainer is driven through its public entry
(`train_text`), so this is the code a user's first GPU run executes.
"""

from __future__ import annotations

import importlib.util
import statistics
import tempfile
from pathlib import Path

import torch

from . import models
from .device import DeviceInfo, peak_memory_gib, reset_peak_memory
from .report import Section

TIME_KEYS = {
    "time_iteration_s": "step s",
    "time_rollout_s": "generate s",
    "time_logprob_s": "log-prob s",
    "time_train_s": "train s",
    "tokens/per_second_generate": "generated tokens/s",
}


def id_parity(prompts, completions, completion_ids, **kwargs) -> list[float]:
    """The check's reward: parity of the completion's token-id sum. A random model's completions get no reward
    from a real task (all equal: zero advantages, no gradient pass); this one splits every group about evenly."""
    return [float(sum(int(i) for i in ids) % 2) for ids in completion_ids]


def vllm_unavailable(device: str) -> str | None:
    """Why the vLLM variant cannot run here, or None."""
    if importlib.util.find_spec("vllm") is None:
        return "vllm is not installed (pip install -e '.[vllm]' on a CUDA machine)"
    if not device.startswith("cuda"):
        return "vLLM needs a CUDA GPU"
    return None


def text_check(sizes: models.Sizes, info: DeviceInfo, dtype: torch.dtype, backend: str, full: bool = False) -> Section:
    """LoRA on a `dtype` base; `full`: a full fine-tune on fp32 master weights with `dtype` autocast and
    gradient checkpointing (the real text recipe's precision)."""
    from flowgrpo.text import load_text_config, train_text

    what = "full fine-tune, fp32 master weights, autocast, gradient checkpointing" if full else "LoRA"
    sec = Section(models.stand_in(sizes) + f"Qwen2.5-0.5B-size text GRPO step ({what}), generation backend {backend}")
    if backend == "vllm":
        sec.skipped = vllm_unavailable(info.device)
        if sec.skipped:
            return sec
    name = str(dtype).removeprefix("torch.")
    steps = 1 + sizes.repeats  # the first step warms up (allocator, kernels, the vLLM engine's graphs)
    with tempfile.TemporaryDirectory(prefix="flowgrpo_gpu_check_") as tmp:
        folder = models.save_qwen(sizes, str(Path(tmp) / "model"), dtype)
        if full:
            precision = ["model.dtype=float32", f"model.autocast={name}", "train.gradient_checkpointing=true"]
        else:
            precision = [f"model.dtype={name}", "model.lora.enabled=true", "model.lora.rank=16", "model.lora.alpha=32"]
        overrides = [
            f"model.name_or_path={folder}",
            *precision,
            f"model.device={info.device}",
            f"generation.backend={backend}",
            f"prompts_per_iteration={sizes.text_prompts}",
            f"group_size={sizes.text_group}",
            f"generation.max_new_tokens={sizes.text_new_tokens}",
            "generation.vllm.gpu_memory_utilization=0.3",
            f"iterations={steps}",
            "progress=false",
            f"output_dir={Path(tmp) / 'run'}",
            "checkpoint.save_final_model=false",
            f"rewards=[{{name: '{__name__}:id_parity'}}]",
            "seed=0",
        ]
        cfg = load_text_config(None, overrides)
        sec.settings = {
            "layers x hidden": f"{'tiny' if sizes.tiny else '24 x 896'}",
            "vocabulary": "151936" if not sizes.tiny else "259",
            "prompts x group": f"{sizes.text_prompts} x {sizes.text_group}",
            "max new tokens": sizes.text_new_tokens,
            "dtype": f"float32 weights, {name} autocast" if full else name,
            "trained": "every weight, gradient checkpointing" if full else "LoRA r16 q/k/v/o",
            "loss": cfg.loss.preset,
        }
        reset_peak_memory(info.device)
        records = train_text(cfg)
    timed_records = records[1:]
    if not all(r.get("backward_passes", 0) > 0 for r in timed_records):
        raise RuntimeError(
            f"a timed step ran no gradient pass (backward passes {[r.get('backward_passes') for r in records]})"
        )
    for key, label in TIME_KEYS.items():
        values = [float(r[key]) for r in timed_records if key in r]
        sec.figures[label] = statistics.median(values) if values else None
    sec.figures["backward passes per step"] = statistics.median(float(r["backward_passes"]) for r in timed_records)
    step_s = sec.figures["step s"]
    sec.figures["sequences/s"] = sizes.text_prompts * sizes.text_group / step_s if step_s else None
    sec.figures["ratio |r - 1| max, first pass (trainer's check)"] = max(
        (float(r["check/first_pass_ratio_dev"]) for r in records if "check/first_pass_ratio_dev" in r), default=None
    )
    sec.figures["peak memory GiB"] = peak_memory_gib(info.device)
    sec.notes.append(f"{len(records)} trainer steps; figures are medians of the {len(timed_records)} after the first")
    return sec
