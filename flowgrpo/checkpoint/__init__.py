"""Checkpoints: atomic and verified on disk, exact on resume, with no pickle.

format          a step's folder: save (atomic, manifest of sizes and hashes, keep_last), list, verify, load;
                `load_into` copies saved tensors into a module
rng             the global RNG states a checkpoint saves and restores
parts           CheckpointParts (what a trainer adds to a checkpoint); which tensors FSDP2 shards
shards          a sharded run's `sharded/` folder: every rank's shards (torch.distributed.checkpoint)
resume_config   a resume with a changed setting is refused
checkpointer    Checkpointer: a run's save and resume on all its ranks (the run loop calls it)
sharded_model   save_sharded / load_sharded: a sharded model's checkpoint by parameter name, for users' own loops
run_folder      a run's output folder: locked for the run's life; an earlier run's files are never overwritten
"""

from .checkpointer import Checkpointer, refuse_earlier_run
from .format import (
    FORMAT_VERSION,
    SHARDED,
    Checkpoint,
    CheckpointError,
    checkpoint_name,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    load_into,
    read_checkpoint_config,
    save_checkpoint,
    verify_checkpoint,
)
from .parts import CheckpointParts, is_shard, local_part
from .resume_config import check_resume_config
from .rng import rng_state, set_rng_state
from .run_folder import RunFolderLock, earlier_run, lock_run_folder, refuse_earlier_files, set_aside
from .sharded_model import load_sharded, save_sharded, save_sharded_atomic

__all__ = [
    "FORMAT_VERSION", "SHARDED", "Checkpoint", "CheckpointError", "CheckpointParts", "Checkpointer",
    "check_resume_config", "checkpoint_name", "is_shard", "latest_checkpoint", "list_checkpoints", "load_checkpoint",
    "load_into", "load_sharded", "local_part", "read_checkpoint_config", "refuse_earlier_files", "refuse_earlier_run",
    "rng_state", "RunFolderLock", "earlier_run", "lock_run_folder", "save_checkpoint", "save_sharded",
    "save_sharded_atomic", "set_aside", "set_rng_state", "verify_checkpoint",
]  # fmt: skip
