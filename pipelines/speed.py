"""GPU speed switches of an image adapter, each off by default and each numerically neutral.

    speed = SpeedConfig(compile={"enabled": True}, gradient_checkpointing=True, autocast="bfloat16")
    apply_speed(adapter, speed)   # after LoRA is attached (compiled blocks then include the LoRA layers)

What each switch may change: speed and memory only. Regional compile, chunked VAE decode, gradient
checkpointing and the attention backend give the same outputs to float tolerance; autocast changes
the precision of every denoiser forward alike (rollout and re-scoring), so the on-policy ratio stays 1.
The rollout-side switch (`torch.inference_mode`) lives in SamplerConfig.inference_mode.
"""

from __future__ import annotations

import importlib.util
from typing import Any, Literal, Optional

import torch
from pydantic import Field, model_validator

from flowgrpo.core.config import StrictModel

COMPILE_MODES = (None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
AUTOCAST_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}


class CompileConfig(StrictModel):
    """Regional torch.compile: every transformer block is compiled on its own (`nn.Module.compile`, in
    place, so parameter names and LoRA saving are unchanged). Blocks repeat, so one compiled graph is
    reused by all of them: compile time is that of one block, not of the whole model."""

    enabled: bool = False
    backend: str = "inductor"  # any torch.compiler.list_backends() name ("aot_eager" for CPU tests)
    mode: Optional[str] = None  # None | default | reduce-overhead | max-autotune | max-autotune-no-cudagraphs
    dynamic: Optional[bool] = None  # None: torch decides (rollout and micro-batch sizes differ)
    fullgraph: bool = False

    @model_validator(mode="after")
    def _known(self) -> "CompileConfig":
        if self.mode not in COMPILE_MODES:
            raise ValueError(f"compile.mode must be one of {COMPILE_MODES}, got '{self.mode}'")
        if self.enabled:
            backends = set(torch.compiler.list_backends(exclude_tags=())) | {"inductor"}
            if self.backend not in backends:
                raise ValueError(
                    f"compile.backend '{self.backend}' is not a torch.compile backend; valid: {sorted(backends)}"
                )
        return self


class SpeedConfig(StrictModel):
    # diffusers attention backend: "native" = PyTorch SDPA (default); "xformers" (needs the package);
    # any other name of diffusers' AttentionBackendName (flash, _native_flash, sage, ...) for model
    # families whose attention processors use diffusers' dispatcher (FLUX, Qwen-Image; not SD3 / SD1.5).
    attention_backend: str = "native"
    compile: CompileConfig = Field(default_factory=CompileConfig)
    gradient_checkpointing: bool = False  # recompute each block's activations in backward (memory for time)
    # Mixed precision of every denoiser forward (rollout and training alike, so the ratio stays 1): the
    # weights keep their dtype (fp32 master weights for full fine-tuning, fp32 LoRA), matmuls run in this one.
    autocast: Optional[Literal["bfloat16", "float16"]] = None
    # "batched": CFG's uncond and cond rows in one forward of 2B rows (fastest); "split": two forwards, the
    # uncond one without grad under cfg_mode detach_uncond (halves training activations for that branch).
    cfg_forward: Literal["batched", "split"] = "batched"
    decode_batch_size: Optional[int] = Field(None, ge=1)  # VAE decode in chunks of this many images (peak memory)
    # PyTorch's cuDNN SDPA kernel (process-wide). Off by default: on an H100 (torch 2.11, CUDA 13) it failed in a
    # FLUX.1-size backward with gradient checkpointing (illegal memory access in mha_graph.execute); the same
    # step runs with it off, on the flash / memory-efficient kernels (docs/gpu_validation.md).
    cudnn_attention: bool = False
    # TF32 matmuls and convolutions for fp32 weights (process-wide). Off: fp32 stays fp32 (torch turns cuDNN's
    # TF32 convolutions on by default, and a tiny SD1.5-style UNet's first-pass ratio left 1 by 1.7e-4 on an H100).
    tf32: bool = False

    @model_validator(mode="after")
    def _backend(self) -> "SpeedConfig":
        if self.attention_backend == "native":
            return self
        from diffusers.models.attention_dispatch import AttentionBackendName

        names = sorted(b.value for b in AttentionBackendName)
        if self.attention_backend not in names:
            raise ValueError(
                f"speed.attention_backend '{self.attention_backend}' is not a diffusers attention "
                f"backend; valid: {names}"
            )
        if self.attention_backend == "xformers" and importlib.util.find_spec("xformers") is None:
            raise ValueError(
                "speed.attention_backend xformers needs the xformers package (pip install xformers); "
                "or use native (PyTorch SDPA)"
            )
        return self


def denoiser_blocks(adapter: Any) -> list[torch.nn.Module]:
    """The repeated blocks of the adapter's denoiser, in the family's `block_names` order."""
    out: list[torch.nn.Module] = []
    for name in adapter.block_names:
        module = getattr(adapter.denoiser, name, None)
        if module is None:
            raise ValueError(f"{adapter.family}: the denoiser has no '{name}' (block_names {adapter.block_names})")
        out.extend(module if isinstance(module, torch.nn.ModuleList) else [module])
    return out


def compile_blocks(adapter: Any, cfg: CompileConfig) -> int:
    """Compile each block in place; returns how many were compiled."""
    blocks = denoiser_blocks(adapter)
    for block in blocks:
        block.compile(backend=cfg.backend, mode=cfg.mode, dynamic=cfg.dynamic, fullgraph=cfg.fullgraph)
    return len(blocks)


def set_attention_backend(adapter: Any, backend: str) -> str:
    """Route the denoiser's attention to `backend`; returns how ("dispatcher", "processors" or "native")."""
    if backend == "native":
        return "native"
    denoiser = adapter.denoiser
    dispatched = any(hasattr(getattr(m, "processor", None), "_attention_backend") for m in denoiser.modules())
    if dispatched:
        denoiser.set_attention_backend(backend)  # note: diffusers also makes it the process-wide active backend
        return "dispatcher"
    if backend == "xformers":  # SD3 / SD1.5 processors predate the dispatcher: swap in the xformers processors
        denoiser.enable_xformers_memory_efficient_attention()
        return "processors"
    raise ValueError(
        f"{adapter.family}: attention backend '{backend}' needs diffusers' attention dispatcher, which "
        f"this family's processors do not use; choose native or xformers"
    )


def apply_speed(adapter: Any, cfg: SpeedConfig) -> dict[str, Any]:
    """Apply every switch of `cfg` to `adapter` (call once, after LoRA is attached); what was done."""
    done: dict[str, Any] = {"attention": set_attention_backend(adapter, cfg.attention_backend)}
    torch.backends.cuda.enable_cudnn_sdp(cfg.cudnn_attention)
    torch.backends.cuda.matmul.allow_tf32 = cfg.tf32
    torch.backends.cudnn.allow_tf32 = cfg.tf32
    done.update(cudnn_attention=cfg.cudnn_attention, tf32=cfg.tf32)
    if cfg.gradient_checkpointing:
        adapter.denoiser.enable_gradient_checkpointing()
    done["gradient_checkpointing"] = cfg.gradient_checkpointing
    adapter.autocast_dtype = AUTOCAST_DTYPES[cfg.autocast] if cfg.autocast else None
    adapter.cfg_forward = cfg.cfg_forward
    adapter.decode_batch_size = cfg.decode_batch_size
    done["compiled_blocks"] = compile_blocks(adapter, cfg.compile) if cfg.compile.enabled else 0
    return done
