"""Saving and resuming a training run on all its ranks: which rank writes what, in which order (`Checkpointer`).

The run loop (flowgrpo.run.RunLoop) decides when; this module does the save and the resume:

    save     a data-parallel run: every rank hands its part of a ZeRO optimizer's moments over (a collective),
             then rank 0 writes the checkpoint (every rank holds the same weights). A sharded (FSDP2) run: every
             rank writes its shards into a staging folder (flowgrpo.checkpoint.shards), then rank 0 writes the
             rest and moves the staging folder in before the checkpoint's atomic rename. The other ranks wait.
             A save that fails (a full disk: CheckpointError naming the folder and the OS error, the staging
             folders removed) fails on every rank together: the ranks learn it from one max-reduction.
    resume   rank 0 finds the newest good checkpoint (sizes and hashes verified; damaged ones skipped with a
             warning) and tells the others; every rank refuses a changed setting (flowgrpo.checkpoint.resume_config)
             from the checkpoint's config.json alone, before anything else is read (another model or layer count
             would otherwise end in a torch error while loading the optimizer), then reads the checkpoint (a
             sharded checkpoint's shards on this run's ranks, sharded or not), loads the optimizers and LR
             schedule, and hands the rest to the trainer's restore.

It knows the process group and the optimizer step only by the few methods it calls (`Ranks`, `StepState`).
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Protocol

from ..config import ConfigError
from ..atomic_io import os_error_text
from .format import (
    SHARDED,
    Checkpoint,
    CheckpointError,
    checkpoint_name,
    latest_checkpoint,
    load_checkpoint,
    read_checkpoint_config,
    save_checkpoint,
)
from .parts import CheckpointParts
from .resume_config import check_resume_config
from .shards import all_finite, read_shards, shard_tensors, without_shards, write_shards

log = logging.getLogger(__name__)


class Ranks(Protocol):
    """The process group as a checkpoint uses it (flowgrpo.distributed.Distributed)."""

    @property
    def is_main(self) -> bool: ...

    @property
    def active(self) -> bool: ...

    @property
    def sharded(self) -> bool: ...

    def barrier(self) -> None: ...

    def max(self, value: float) -> float: ...

    def gather_objects(self, local: list[Any]) -> list[Any]: ...


class StepState(Protocol):
    """The optimizer step as a checkpoint uses it (flowgrpo.run.OptimizerStep): a ZeRO engine gathers its AdamW
    moments from the partitions before a save, and takes resumed weights into its fp32 master copy."""

    def gather_state(self) -> None: ...

    def weights_loaded(self) -> None: ...


def refuse_earlier_run(folder: Path) -> None:
    """A run that does not resume must not write into a folder that holds an earlier run's checkpoints."""
    if latest_checkpoint(folder) is not None:
        raise ConfigError(
            f"{folder} holds checkpoints of an earlier run: set resume=true to continue "
            "it, or choose another output_dir (nothing was overwritten)"
        )


class Checkpointer:
    """A run's checkpoints under `folder`. `parts` gives the trainer's tensors, optimizers and state (asked at
    each save and resume), `schedulers` the LR schedule, `config` the resolved run config (saved, and compared on
    resume); `keep_last` checkpoints are kept; `unit` names a step in log lines."""

    def __init__(
        self,
        dist: Ranks,
        folder: Path,
        *,
        parts: Callable[[], CheckpointParts],
        schedulers: Mapping[str, Any],
        optimizer_step: StepState,
        config: Callable[[], Mapping[str, Any]],
        keep_last: Optional[int] = None,
        unit: str = "step",
        migrate_saved_config: Optional[Callable[[Mapping[str, Any]], Mapping[str, Any]]] = None,
        config_defaults: Optional[Callable[[], Mapping[str, Any]]] = None,
    ) -> None:
        """`migrate_saved_config`: a checkpoint's config as the current keys name it (keys renamed since it was
        written), so that the resume check compares like with like. `config_defaults`: every setting's default,
        so that a setting added since the checkpoint was written, left at its default, is no change."""
        self.dist, self.folder = dist, folder
        self.parts, self.schedulers, self.optimizer_step = parts, schedulers, optimizer_step
        self.config, self.keep_last, self.unit = config, keep_last, unit
        self.migrate_saved_config = migrate_saved_config or (lambda saved: saved)
        self.config_defaults = config_defaults

    # --- save ------------------------------------------------------------------------------------------

    def save(self, step: int) -> Optional[Path]:
        """Every rank calls it; rank 0 returns the checkpoint's folder, the others None once it is written. A save
        that fails on any rank raises CheckpointError on every rank (none waits for the others forever)."""
        path: Optional[Path] = None
        if self.dist.sharded:
            path = self._write_sharded(step)
        else:
            self.optimizer_step.gather_state()  # a ZeRO run: every rank gives its partitions of the moments first
            error = None
            if self.dist.is_main:
                try:
                    path = self._write(step, self.parts())
                except CheckpointError as err:
                    error = err
            self._raise_on_every_rank(error, step)  # a collective: also the barrier after rank 0's write
        return path

    def _raise_on_every_rank(self, error: Optional[CheckpointError], step: int) -> None:
        """Every rank calls it: when any rank's `error` is set, every rank raises (its own error, or one naming
        the checkpoint another rank could not write)."""
        if self.dist.max(0.0 if error is None else 1.0):
            raise error or CheckpointError(
                f"could not save checkpoint {self.folder / checkpoint_name(step)}: another rank failed to write "
                "it (its own line says why); the earlier checkpoints are intact"
            )

    def _write(self, step: int, parts: CheckpointParts, folders: Optional[dict[str, Path]] = None) -> Path:
        return save_checkpoint(
            self.folder, step, tensors=parts.tensors, optimizers=parts.optimizers, schedulers=self.schedulers,
            state=parts.state, config=self.config(), keep_last=self.keep_last, folders=folders,
        )  # fmt: skip

    def _write_sharded(self, step: int) -> Optional[Path]:
        """Every rank writes its shards into a staging folder; rank 0 then writes the rest and moves the
        staging folder into the checkpoint before its atomic rename. A failed write removes the staging folder."""
        parts = self.parts()
        shards = shard_tensors(parts)
        if self.dist.max(0.0 if all_finite(shards) else 1.0):  # every rank refuses together
            raise CheckpointError(f"refusing to save step {step}: sharded tensors hold NaN / inf")
        staging = self.folder / f".tmp-shards-{checkpoint_name(step)}"
        error: Optional[CheckpointError] = None

        def failed(err: BaseException) -> CheckpointError:
            failures = getattr(err, "failures", None)  # a CheckpointException: {rank: (error, traceback)}
            if isinstance(failures, dict) and failures:
                rank, (err, _) = sorted(failures.items())[0]
                err_text = f"rank {rank}: {os_error_text(err)}"
            else:
                err_text = os_error_text(err)
            return CheckpointError(
                f"could not save checkpoint {self.folder / checkpoint_name(step)}: {err_text}; the earlier "
                "checkpoints are intact"
            )

        if self.dist.is_main:
            try:
                shutil.rmtree(staging, ignore_errors=True)  # left by a crashed save
                staging.mkdir(parents=True)
            except OSError as err:
                error = failed(err)
        self._raise_on_every_rank(error, step)  # also the barrier before the shards
        try:
            write_shards(staging, shards)
        except BaseException as err:  # torch.distributed.checkpoint's CheckpointException is a BaseException
            if not isinstance(err, Exception) and type(err).__name__ != "CheckpointException":
                raise
            error = failed(err)
        path = None
        try:
            self._raise_on_every_rank(error, step)  # every rank's shards are written
            if self.dist.is_main:
                try:
                    path = self._write(step, without_shards(parts), folders={SHARDED: staging})
                except CheckpointError as err:
                    error = err
            self._raise_on_every_rank(error, step)  # the barrier after rank 0's write
        except CheckpointError:
            if self.dist.is_main:
                shutil.rmtree(staging, ignore_errors=True)
            raise
        return path

    # --- resume ----------------------------------------------------------------------------------------

    def resume(self, restore: Callable[[Checkpoint], None], free: set[str]) -> Optional[Checkpoint]:
        """Load the newest good checkpoint (None when there is none: the run starts at step 0) on every rank:
        optimizers and LR schedule in place, then `restore` takes the tensors and state. A changed setting
        outside the top-level keys in `free` is refused."""
        # rank 0 reads every file's hash (a sharded checkpoint holds all ranks' shards) and tells the others
        path = latest_checkpoint(self.folder, verify=True) if self.dist.is_main else None
        if self.dist.active:
            path = self.dist.gather_objects([path])[0]
        if path is None:
            log.info("resume: no checkpoint under %s; starting at %s 0", self.folder, self.unit)
            return None
        # the settings first, from config.json alone: another model, recipe or layer count is refused in one line
        # naming the keys before the optimizer state (which would not fit) is read
        defaults = None if self.config_defaults is None else self.config_defaults()
        check_resume_config(self.config(), self._saved_config(path), free, defaults)
        parts = self.parts()
        shards = None
        if (path / SHARDED).is_dir():  # saved sharded: read on this run's ranks, sharded or not
            shards = read_shards(path / SHARDED, parts)
        elif self.dist.sharded:
            raise ConfigError(
                f"resume: {path} was saved by a run that does not shard; resume it without an FSDP launch "
                "(configs/accelerate/ddp.yaml)"
            )
        ckpt = load_checkpoint(path, optimizers=parts.optimizers, schedulers=self.schedulers, shards=shards)
        restore(ckpt)
        self.optimizer_step.weights_loaded()
        log.info("resumed from %s (%s %d)", path, self.unit, ckpt.step)
        return ckpt

    def _saved_config(self, path: Path) -> Optional[Mapping[str, Any]]:
        saved = read_checkpoint_config(path)
        return None if saved is None else self.migrate_saved_config(saved)
