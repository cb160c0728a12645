"""Context (sequence) parallelism for long video sequences: diffusers' own engine, composed with FSDP2.

A Wan 2.1 clip of 81 frames at 720 x 1280 is 75,600 tokens per block; its activations do not fit one GPU
even with block checkpointing (docs/scaling.md, "Context parallelism"). Context parallelism splits the
sequence of one sample over the `ulysses x ring` ranks of a group. flowgrpo does not implement it: it hands the
denoiser to diffusers' `ModelMixin.enable_parallelism(config=ContextParallelConfig(...))`, which splits the
inputs along the sequence by the model's `_cp_plan` (hooks), runs attention with Ulysses all-to-all or ring
attention (diffusers.models.attention_dispatch, `TemplatedUlyssesAttention` / `TemplatedRingAttention`) and
gathers the output of `proj_out` back on every rank.

The ranks form one mesh `(dp_shard, ring, ulysses)`, row-major: the ranks of a context-parallel group are
consecutive (one NVLink island), and `dp_shard = world / (ulysses x ring)` groups see different samples. FSDP2
shards the weights over all ranks (the flattened mesh, `Distributed.shard`'s 1-D mesh over the world): each rank's
backward leaves the gradient of its own tokens, and FSDP2's reduce-scatter sums over every rank, i.e. over the
tokens of a group and the samples of the groups, which is the full gradient (flowgrpo sums, never averages).

What runs where (diffusers 0.42.1, torch 2.13, measured by tests/scaling/test_context_parallel.py): Ulysses with
the native (SDPA) attention backend runs on CPU with gloo (its all-to-all is `funcol.all_to_all_single`, which
gloo has); ring attention needs an attention kernel that returns the log-sum-exp (flash, flash-3, sage,
_native_cudnn, _native_flash: CUDA only): on the native backend diffusers raises "Native attention does not
support return_lse=True", so ring degrees > 1 are a GPU feature, refused in one line on the native backend.
diffusers picks `torch.device(type, rank % torch.accelerator.device_count())` for its config, a division by zero
on a machine without an accelerator; it never uses that device, so a CPU run sees a count of 1 while the
config is built.
"""

from __future__ import annotations

from typing import Any
from unittest import mock

import torch
from pydantic import Field

from ..core import StrictModel

MESH_DIMS = ("dp_shard", "ring", "ulysses")
# the one context-parallel backend of diffusers 0.42 whose kernel returns no log-sum-exp (ring attention merges the
# partial results of its steps with it): "Native attention does not support return_lse=True"
NO_LSE_BACKENDS = ("native",)


def ring_backends() -> list[str]:
    """diffusers' attention backends that can run ring attention (CUDA / NPU kernels: flash, sage, cuDNN, ...)."""
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry

    return sorted(set(_AttentionBackendRegistry._supports_context_parallel) - set(NO_LSE_BACKENDS))


class ContextParallelError(ValueError):
    """A context-parallel setting that cannot run (the message names the value and the valid ones)."""


class ContextParallelSettings(StrictModel):
    """`model.context_parallel`: ranks per sample. `ulysses` heads are exchanged by all-to-all (each rank attends
    over the whole sequence for num_heads / ulysses heads); `ring` passes key / value blocks around (GPU only)."""

    ulysses: int = Field(1, ge=1)
    ring: int = Field(1, ge=1)

    @property
    def degree(self) -> int:
        return self.ulysses * self.ring

    @property
    def enabled(self) -> bool:
        return self.degree > 1


def trainer_problem(cp: ContextParallelSettings, video_family: bool) -> str | None:
    """Why the image trainer cannot run `model.context_parallel` on this model family (None: it can, or degree
    1). The launch's world size is checked with the recipe (`world_problem`, flowgrpo.t2i.config)."""
    if not cp.enabled:
        return None
    if not video_family:
        return (
            f"model.context_parallel: ulysses x ring = {cp.degree} splits a video sequence; it needs a video "
            "family (model.family wan), or ulysses: 1, ring: 1"
        )
    return None


def method_problem(cp: ContextParallelSettings, method: str, adversarial: bool) -> str | None:
    """Why a method cannot run under context parallelism (None: it can). The ranks of a group must run the same
    forwards on the same samples: Diffusion-DPO deals its preference pairs to ranks, not to groups, and Adv-GRPO's
    replicated discriminator would have its gradient summed once per rank of a group."""
    if not cp.enabled:
        return None
    if method == "diffusion_dpo" or adversarial:
        what = "method diffusion_dpo" if method == "diffusion_dpo" else "adversarial.enabled"
        return (
            f"model.context_parallel: ulysses x ring = {cp.degree} does not run with {what} (its work is split "
            "per rank, not per context-parallel group); use another method or ulysses: 1, ring: 1"
        )
    return None


def world_problem(cp: ContextParallelSettings, world: int, chunks: int | None = None) -> str | None:
    """Why `world` ranks cannot hold context-parallel groups of `cp.degree` (None: they can); with `chunks`
    (rollout batches per iteration), also why those do not split evenly over the world / degree groups."""
    if world % cp.degree:
        valid = [d for d in range(1, world + 1) if world % d == 0]
        return (
            f"model.context_parallel: ulysses x ring = {cp.ulysses} x {cp.ring} = {cp.degree} must divide the "
            f"world size {world}; valid degrees: {valid}"
        )
    if chunks is not None and chunks % (world // cp.degree):
        return (
            f"prompts_per_iteration / rollout_prompts x rollout_split = {chunks} rollout batches must divide "
            f"evenly over the {world // cp.degree} context-parallel groups ({world} processes / ulysses x ring "
            f"{cp.degree})"
        )
    return None


def shape_problem(cp: ContextParallelSettings, tokens: int, heads: int) -> str | None:
    """Why a sequence of `tokens` with `heads` attention heads cannot be split (None: it can). diffusers'
    equal-partition sharder asserts that the sequence divides by the degree; Ulysses scatters the heads."""
    if tokens % cp.degree:
        return (
            f"model.context_parallel: the sequence of {tokens} tokens per sample does not divide by ulysses x ring = "
            f"{cp.degree}; pick a degree that divides {tokens} or another frame count / resolution"
        )
    if heads % cp.ulysses:
        valid = [d for d in range(1, heads + 1) if heads % d == 0]
        return f"model.context_parallel: ulysses {cp.ulysses} must divide the {heads} attention heads; valid: {valid}"
    return None


def wan_tokens(num_frames: int, height: int, width: int, patch: tuple[int, int, int] = (1, 2, 2)) -> int:
    """Tokens of one Wan 2.1 sample in every block: the VAE compresses 4x in time (first frame alone) and 8x in
    space, the transformer patchifies 1 x 2 x 2 (WanTransformer3DModel.patch_size)."""
    latent_frames = (num_frames - 1) // 4 + 1
    return (latent_frames // patch[0]) * (height // 8 // patch[1]) * (width // 8 // patch[2])


def data_parallel_coords(rank: int, world: int, cp: ContextParallelSettings) -> tuple[int, int]:
    """(this rank's data-parallel index, the number of data-parallel groups). Ranks `k * degree ... (k + 1) *
    degree - 1` form group k (row-major mesh, MESH_DIMS): they must get the same samples and the same noise, so
    the batch is split over the groups only (rollout batch c on group c mod (world / degree))."""
    if problem := world_problem(cp, world):
        raise ContextParallelError(problem)
    return rank // cp.degree, world // cp.degree


def build_mesh(cp: ContextParallelSettings, world: int, device_type: str | None = None) -> Any:
    """The `(dp_shard, ring, ulysses)` DeviceMesh of the launch; diffusers takes its (ring, ulysses) part."""
    from torch.distributed.device_mesh import init_device_mesh

    if problem := world_problem(cp, world):
        raise ContextParallelError(problem)
    device_type = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
    return init_device_mesh(device_type, (world // cp.degree, cp.ring, cp.ulysses), mesh_dim_names=MESH_DIMS)


def _attention_backend(model: torch.nn.Module) -> str:
    """The diffusers attention backend the model's processors dispatch to ("native" unless set otherwise)."""
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry

    for m in model.modules():
        backend = getattr(getattr(m, "processor", None), "_attention_backend", None)
        if backend is not None:
            return str(getattr(backend, "value", backend))
    active, _ = _AttentionBackendRegistry.get_active_backend()
    return str(active.value)


def enable_context_parallel(model: torch.nn.Module, cp: ContextParallelSettings, mesh: Any = None) -> Any:
    """Hand `model` (a diffusers denoiser, LoRA attached or not) to diffusers' context parallelism over the
    (ring, ulysses) dimensions of `mesh` (built from the launch when None); returns the mesh. Call it before
    `fully_shard` (FSDP2 then wraps the hooked modules) and build the optimizer after both."""
    import torch.distributed as dist
    from diffusers import ContextParallelConfig

    if not cp.enabled:
        raise ContextParallelError("model.context_parallel: ulysses x ring is 1; nothing to enable")
    if not dist.is_initialized():
        raise ContextParallelError("context parallelism needs torch.distributed initialized (accelerate / torchrun)")
    base = getattr(model, "get_base_model", lambda: model)()
    if getattr(base, "_cp_plan", None) is None:
        raise ContextParallelError(
            f"model.context_parallel: diffusers ships no context-parallel plan (`_cp_plan`) for "
            f"{type(base).__name__}; set ulysses: 1, ring: 1"
        )
    backend = _attention_backend(base)
    if cp.ring > 1 and backend not in ring_backends():
        raise ContextParallelError(
            f"model.context_parallel: ring {cp.ring} needs an attention backend that returns the log-sum-exp, "
            f"one of {ring_backends()} (GPU kernels), not '{backend}' (model.speed.attention_backend); "
            "or use ulysses instead"
        )
    heads = getattr(base.config, "num_attention_heads", None)
    if heads is not None and heads % cp.ulysses:
        valid = [d for d in range(1, heads + 1) if heads % d == 0]
        raise ContextParallelError(
            f"model.context_parallel: ulysses {cp.ulysses} must divide the {heads} attention heads; valid: {valid}"
        )
    mesh = build_mesh(cp, dist.get_world_size()) if mesh is None else mesh
    config = ContextParallelConfig(ulysses_degree=cp.ulysses, ring_degree=cp.ring, mesh=mesh)
    # diffusers computes `rank % torch.accelerator.device_count()` for a device it never reads: 0 on CPU
    count = 1 if torch.accelerator.device_count() == 0 else torch.accelerator.device_count()
    with mock.patch.object(torch.accelerator, "device_count", return_value=count):
        base.enable_parallelism(config=config)
    return mesh
