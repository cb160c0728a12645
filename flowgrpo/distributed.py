"""Data parallelism over rollout batches, identical in result to one process with the same global batch.

Used by both trainers. Image side: rollout batch c (a fixed set of prompts with its own noise seed) runs on rank c % world_size, so a
sample's noise never depends on the number of processes. Rewards are gathered per batch, so every rank
computes the same advantages over the whole batch (group and batch statistics are global). The trained
edges keep their global order; each rank back-propagates the edges of its own batches with the global
loss normaliser, and gradients are summed over ranks before the optimizer step. Launched by
`accelerate launch` / torchrun (env RANK, WORLD_SIZE, MASTER_ADDR); gloo on CPU, nccl (+ gloo for CPU tensors) on GPU.

Text side: the same scheme with chunks of prompts (each seeded by its chunk), the whole rollout
gathered on every rank, and micro-batch k of every mini-batch on rank k % world_size.

Sharded runs (an `accelerate launch` with configs/accelerate/fsdp2.yaml): the same split of the work, with the
models sharded by FSDP2 (`Distributed.shard`), which sums the gradients in backward; every rank then runs as
many forward / backward passes as the busiest one (`passes_to_pad`), since each pass gathers shards from all.
ZeRO runs (deepspeed_zero2.yaml / deepspeed_zero3.yaml): the same split; the optimizer step goes through a
DeepSpeed engine (flowgrpo.scaling.zero, built by `OptimizerStep`), whose backward reduces gradient buckets, so
every rank runs as many backward passes too (`lockstep`); under ZeRO-3 every forward gathers weights, as under
FSDP2 (`gathers_weights`).

Context-parallel runs (`model.context_parallel`, flowgrpo.scaling.context_parallel): the ranks of a group compute
one sample together, so the split above is over the groups, not the ranks: a group's ranks get the same rollout
batches (hence the same noise), gathers read each batch from the group's first rank, and sums over ranks count each
group once. Every forward then takes every rank of a group, as under FSDP2 (`gathers_weights`, `lockstep`).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Mapping, Optional

import torch
from torch import Tensor

from .checkpoint import is_shard
from .config import ConfigError

if TYPE_CHECKING:
    from .scaling.context_parallel import ContextParallelSettings
    from .scaling.sharding import ShardingConfig
    from .scaling.zero import ZeroConfig


# `accelerate launch` exports these to every rank for an FSDP / DeepSpeed config (accelerate/utils/launch.py)
USE_FSDP, USE_DEEPSPEED = "ACCELERATE_USE_FSDP", "ACCELERATE_USE_DEEPSPEED"


def _env_true(env: Mapping[str, str], var: str) -> bool:
    # accelerate reads these with str_to_bool (it writes both "true" and "True")
    return env.get(var, "").strip().lower() in {"1", "true", "t", "yes", "y", "on"}


def zero_from_launch(environ: Mapping[str, str] | None = None) -> Optional["ZeroConfig"]:
    """The ZeRO stage an `accelerate launch --config_file configs/accelerate/deepspeed_zero2.yaml` asks for (None
    without DeepSpeed); what flowgrpo cannot run (zero3_init_flag, offloading, DeepSpeed's bf16) is refused in one
    line."""
    env = os.environ if environ is None else environ
    if not _env_true(env, USE_DEEPSPEED):
        return None
    from .scaling.zero import ZeroConfig, ZeroError

    try:
        return ZeroConfig.from_accelerate_env(dict(env))
    except ZeroError as err:
        raise ConfigError(f"accelerate DeepSpeed config: {err}") from None


def sharding_from_launch(environ: Mapping[str, str] | None = None) -> Optional["ShardingConfig"]:
    """The FSDP2 settings an `accelerate launch --config_file configs/accelerate/fsdp2.yaml` asks for (None for
    a data-parallel or DeepSpeed launch)."""
    env = os.environ if environ is None else environ
    if not _env_true(env, USE_FSDP):
        return None
    from .scaling.sharding import ShardingConfig, ShardingError

    try:
        return ShardingConfig.from_accelerate_env(dict(env))
    except ShardingError as err:
        raise ConfigError(f"accelerate FSDP config: {err}") from None


def world_size_from_environment() -> int:
    """The launch's process count (WORLD_SIZE; 1 outside a launch), readable before any process group exists."""
    return max(int(os.environ.get("WORLD_SIZE", "1")), 1)


class Distributed:
    """This process's rank and world; `sharding` is set when the run shards its models with FSDP2, `zero` when
    its optimizer step goes through a DeepSpeed ZeRO engine, `context_parallel` when groups of ranks compute one
    sample together (`use_context_parallel`)."""

    def __init__(
        self,
        rank: int = 0,
        world_size: int = 1,
        sharding: Optional["ShardingConfig"] = None,
        zero: Optional["ZeroConfig"] = None,
        context_parallel: Optional["ContextParallelSettings"] = None,
    ):
        self.rank, self.world_size, self.sharding, self.zero = rank, world_size, sharding, zero
        self.context_parallel: Optional["ContextParallelSettings"] = None
        self.data_rank, self.data_world = rank, world_size
        if context_parallel is not None:
            self.use_context_parallel(context_parallel)

    def use_context_parallel(self, cp: "ContextParallelSettings") -> None:
        """Split the work over context-parallel groups of `cp.degree` consecutive ranks (degree 1: per rank)."""
        from .scaling.context_parallel import ContextParallelError, data_parallel_coords

        try:
            self.data_rank, self.data_world = data_parallel_coords(self.rank, self.world_size, cp)
        except ContextParallelError as err:
            raise ConfigError(str(err)) from None
        self.context_parallel = cp if cp.enabled else None

    @property
    def cp_degree(self) -> int:
        """Ranks per sample (1 without context parallelism)."""
        return 1 if self.context_parallel is None else self.context_parallel.degree

    @classmethod
    def from_environment(cls) -> "Distributed":
        import torch.distributed as dist

        sharding, zero = sharding_from_launch(), zero_from_launch()  # before the trainers load any model
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world <= 1 and sharding is None and zero is None:
            return cls()
        if not dist.is_initialized():
            if torch.cuda.is_available():
                # one GPU per process: collectives and `device: auto` use this rank's GPU
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            # on GPUs NCCL moves CUDA tensors (gradients, FSDP shards) and gloo the small CPU ones the trainers
            # gather (rewards, counts, loss normalisers): NCCL alone refuses CPU tensors
            backend = "cuda:nccl,cpu:gloo" if torch.cuda.is_available() else "gloo"
            if world <= 1:  # FSDP2 / ZeRO on one process (e.g. a sharded run resumed on one GPU): a group of one
                dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
            else:
                dist.init_process_group(backend)
        return cls(dist.get_rank(), dist.get_world_size(), sharding, zero)

    @property
    def sharded(self) -> bool:
        return self.sharding is not None

    @property
    def gathers_weights(self) -> bool:
        """Every forward gathers weights from all ranks (FSDP2, ZeRO-3): evaluation, exports and generation run
        on every rank together."""
        return self.sharded or (self.zero is not None and self.zero.stage == 3) or self.cp_degree > 1

    @property
    def lockstep(self) -> bool:
        """Every rank must run as many forward / backward passes: FSDP2 gathers shards in each, a ZeRO engine
        reduces gradient buckets in each backward; under context parallelism a group's ranks exchange activations in
        each forward."""
        return self.sharded or self.zero is not None or self.cp_degree > 1

    def shard(self, module: torch.nn.Module) -> None:
        """FSDP2 on `module`'s transformer blocks and root (flowgrpo.scaling.sharding.shard_model). Gradients are
        summed over ranks, not averaged: each rank's loss already carries the global normaliser."""
        from torch.distributed.fsdp import FSDPModule

        from .scaling.sharding import ShardingError, shard_model

        assert self.sharding is not None
        try:
            shard_model(module, self.sharding)
        except ShardingError as err:  # e.g. a model whose blocks the accelerate config does not list
            raise ConfigError(f"FSDP: {err} (fsdp_config.fsdp_transformer_layer_cls_to_wrap)") from None
        for m in module.modules():
            if isinstance(m, FSDPModule):
                m.set_gradient_divide_factor(1.0)
                m.set_force_sum_reduction_for_comms(True)  # a plain sum (gloo has no pre-multiplied sum)

    def passes_to_pad(self, passes: int) -> int:
        """Sharded and ZeRO runs (`lockstep`): every rank must run as many forward / backward passes as the
        busiest one; the extra passes this rank runs with a zero loss."""
        return self.most(passes) - passes if self.lockstep else 0

    def most(self, count: int) -> int:
        """The largest of every rank's `count` (for steps that every rank must take equally often)."""
        return int(self.max(float(count)))

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def active(self) -> bool:
        return self.world_size > 1

    def my_chunks(self, n_chunks: int) -> list[int]:
        """The rollout batches this rank runs: c mod (data-parallel groups) == its group (its rank without CP)."""
        return [c for c in range(n_chunks) if c % self.data_world == self.data_rank]

    # --- collectives ---------------------------------------------------------------------------

    def _gather_chunks(self, local: Tensor, n_chunks: int) -> Tensor:
        """[n_local, ...] per rank -> [n_chunks, ...] in global batch order."""
        import torch.distributed as dist

        parts = [torch.empty_like(local) for _ in range(self.world_size)]
        dist.all_gather(parts, local.contiguous())
        # batch c lives on every rank of group c mod data_world; its first rank's copy is read
        groups, degree = self.data_world, self.cp_degree
        return torch.stack([parts[c % groups * degree][c // groups] for c in range(n_chunks)])

    def gather_chunks(self, per_chunk: list[Optional[Tensor]], n_chunks: int) -> Optional[Tensor]:
        """Concatenate per-batch tensors of every rank in global order (None stays None)."""
        if per_chunk[0] is None:
            return None
        if not self.active:
            return torch.cat(per_chunk)
        stacked = self._gather_chunks(torch.stack(per_chunk), n_chunks)
        return stacked.flatten(0, 1)

    def all_reduce_grads(self, params: list[torch.nn.Parameter]) -> None:
        """Sum the gradients of replicated parameters over ranks (FSDP2 already reduce-scattered those of
        sharded ones in backward; a replicated module, e.g. Adv-GRPO's discriminator, still needs this). Under
        context parallelism each rank of a group holds the gradient of its own tokens: the plain sum is the
        group's gradient too (a module outside the split sequence would be counted once per rank: none is
        trained under context parallelism, flowgrpo.scaling.context_parallel.trainer_problem)."""
        params = [p for p in params if not is_shard(p)]
        if not self.active or not params:
            return
        import torch.distributed as dist

        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([g.reshape(-1).float() for g in grads])
        dist.all_reduce(flat)
        offset = 0
        for p, g in zip(params, grads):
            n = g.numel()
            p.grad = flat[offset : offset + n].view_as(p).to(p.dtype)
            offset += n

    def reduce_normalizer(self, norm):
        """The loss normaliser's counts summed over the data-parallel groups (each group's once)."""
        if not self.active:
            return norm
        return norm.all_reduce() if self.cp_degree == 1 else norm.all_reduce(self._sum_groups)

    def _sum_groups(self, t: Tensor) -> Tensor:
        """Sum over all ranks, divided by the ranks per group: the ranks of a group hold the same values (float64:
        exact for counts, within an ulp for a sum of stds)."""
        import torch.distributed as dist

        dist.all_reduce(t)
        return t / self.cp_degree if self.cp_degree > 1 else t

    def gather_objects(self, local: list) -> list:
        """Every rank's list of picklable items, concatenated in rank order (the local list alone in one process);
        under context parallelism, the list of each group's first rank (its other ranks hold the same)."""
        if not self.active:
            return list(local)
        import torch.distributed as dist

        parts: list = [None] * self.world_size
        dist.all_gather_object(parts, local)
        return [item for part in parts[:: self.cp_degree] for item in part]

    def max(self, value: float) -> float:
        if not self.active:
            return value
        import torch.distributed as dist

        t = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t)

    def sum(self, value: float) -> float:
        """The sum over the data-parallel groups of a count (each context-parallel group's once)."""
        if not self.active:
            return value
        return float(self._sum_groups(torch.tensor([value], dtype=torch.float64)))

    def barrier(self) -> None:
        if self.active:
            import torch.distributed as dist

            dist.barrier()

    # --- global <-> local edge ids -------------------------------------------------------------

    def localize(self, global_nodes: Tensor, nodes_per_chunk: int) -> tuple[Tensor, Tensor]:
        """(mask of the global ids this rank owns, their ids in this rank's concatenated tree)."""
        chunk = global_nodes // nodes_per_chunk
        mine = chunk % self.data_world == self.data_rank
        local = (chunk // self.data_world) * nodes_per_chunk + global_nodes % nodes_per_chunk
        return mine, local[mine]
