"""The run loop both trainers share: process setup, when to checkpoint, metrics, progress, evaluation hooks.

A trainer subclasses `RunLoop` and supplies what is its own: `iterate(record)` (roll out, score, update the
policy through `self.optimizer_step`), the tensors and state its checkpoints hold, and optionally evaluation
and the final model. The loop owns the order of everything else:

    __init__   prepare_process (seeds, threads) -> output folder, locked for the run's life (rank 0 holds the
               lock; a second run on the folder is refused in one line naming the holder's pid) -> refuse to
               overwrite an earlier run's checkpoints, or its files when it left none (resume=true starts it again
               and moves them to `earlier_run_<n>/`) -> the non-finite guard (`self.guard`, flowgrpo.guards)
    train()    config.yaml -> [evaluate "before"] -> SIGINT / SIGTERM handlers -> per iteration: train_iteration()
               -> [evaluate] -> metrics.jsonl -> [checkpoint] -> progress bar -> [stop on a signal] ...
               -> [evaluate "after", final model] -> the folder's lock released
    train_iteration() record {iteration, lr} -> iterate(record) -> LR schedule -> iteration += 1
               -> guard.end_update

Both trainers write the same names for the same quantities (docs/architecture.md lists them): the loop writes
`iteration` (1-based, the record's counter on both sides) and `time_iteration_s`. `self.iteration` counts the
completed iterations on both sides (checkpoints call it `step`); `unit` only names one in messages ("iteration" /
"step").

Save points: `save()`, every `checkpoint.every` steps, at the end of the run, and after the step in progress
when SIGINT / SIGTERM arrives (flowgrpo.interrupts: the step finishes, every rank saves the same step, the run
stops with 128 + the signal and a resume hint); nothing else writes a checkpoint. How the ranks save and resume
(shards, ZeRO's gathered moments, verification, the config check) is flowgrpo.checkpoint's `Checkpointer`. A
trainer's `iterate` passes its rewards through `self.guard.rewards` and builds its `OptimizerStep` with
`guard=self.guard`.

Write failures (a full disk, a read-only folder) stop the run in one line naming the file and the OS error, with
nothing already saved lost: a checkpoint is atomic (CheckpointError), config.yaml is replaced atomically, a
metrics line that fails leaves the records before it (`WriteFailed`, flowgrpo.atomic_io), the final model is
exported into a staging folder and moved in once whole (an earlier export stays until then), and any other
write of the run (grids, eval_final.json, reward_curve.png) is reported the same way, with the last checkpoint.
"""

from __future__ import annotations

import errno
import logging
import math
import shutil
import time
import weakref
from pathlib import Path
from typing import Any, Mapping, Optional

import torch

from ..atomic_io import WRITE_ERRNOS, WriteFailed, is_io_error, os_error_text, replace_atomically, replace_folder
from ..checkpoint import (
    Checkpoint,
    CheckpointParts,
    Checkpointer,
    RunFolderLock,
    latest_checkpoint,
    lock_run_folder,
    refuse_earlier_files,
    refuse_earlier_run,
    set_aside,
)
from ..config import ConfigError, dump_config, move_renamed_keys
from ..distributed import Distributed
from ..guards import NonFiniteGuard
from ..interrupts import StopRequest
from ..metrics import COUNTER_KEY, TIME_KEY, MetricsWriter, truncate_metrics
from ..process import prepare_process
from .config import CheckpointConfig
from .optim import OptimizerStep

__all__ = ["CheckpointParts", "RunLoop"]  # CheckpointParts (flowgrpo.checkpoint's): method plug-ins import it from here

log = logging.getLogger(__name__)


class RunLoop:
    """The shared loop. Subclasses set `unit` (a step's name in messages), `resume_free` (config keys that
    may change across a resume), `nan_reward_is_missing` (NaN rewards mean "not applicable", not a failed
    score), `optimizer`, `scheduler` and `optimizer_step`."""

    unit = "step"
    progress_label = "train"
    resume_free: frozenset[str] = frozenset()
    renamed_keys: Mapping[str, str] = {}  # config keys renamed since a checkpoint may have been written: old -> new
    nan_reward_is_missing = False
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    optimizer_step: OptimizerStep

    def __init__(self, cfg: Any, total_iterations: int) -> None:
        self.cfg = cfg
        self.total_iterations = total_iterations
        prepare_process(cfg.seed, cfg.num_threads, cfg.deterministic)
        self.dist = Distributed.from_environment()
        self.out = Path(cfg.output_dir)
        try:
            self.out.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise WriteFailed(f"could not create output_dir {self.out}: {os_error_text(err)}") from err
        self.folder_lock = self._lock_folder()
        ckpt: CheckpointConfig = cfg.checkpoint
        self.ckpt_dir = Path(ckpt.dir) if ckpt.dir else self.out / "checkpoints"
        if not cfg.resume:
            refuse_earlier_run(self.ckpt_dir)
            refuse_earlier_files(self.out, self.unit)
        self.iteration = 0  # completed iterations
        self.resumed_from: Optional[Path] = None
        self.guard = NonFiniteGuard(cfg.guards, self.unit, nan_is_missing=self.nan_reward_is_missing)

    def _lock_folder(self) -> Optional[RunFolderLock]:
        """Rank 0 locks the output folder (it alone writes there; the ranks of one launch never refuse each other)
        and tells the others whether it could: a refused launch stops on every rank, at once. Released when the
        run ends (train()), when this object is collected, or when the process dies."""
        lock, problem = None, None
        if self.dist.is_main:
            try:
                lock = lock_run_folder(self.out)
            except (ConfigError, WriteFailed) as err:
                problem = (type(err).__name__, str(err))
        if self.dist.active:
            problem = self.dist.gather_objects([problem])[0]
        if problem is not None:
            raise (WriteFailed if problem[0] == "WriteFailed" else ConfigError)(problem[1])
        if lock is not None:
            weakref.finalize(self, lock.release)
        return lock

    # --- what a trainer supplies ---------------------------------------------------------------------

    def iterate(self, record: dict[str, Any]) -> None:
        """Roll out, score and update the policy for one training step, writing metrics into `record`."""
        raise NotImplementedError

    def checkpoint_parts(self) -> CheckpointParts:
        """Tensors and state to save besides the LR schedule (optimizers: also read on resume)."""
        raise NotImplementedError

    def restore(self, ckpt: Checkpoint) -> None:
        """Load a checkpoint's tensors and state into this trainer (optimizers are loaded already)."""
        raise NotImplementedError

    def evaluate(self, tag: str) -> dict[str, float]:
        """Held-out evaluation: 'before', '<step>' every `eval_every` steps, 'after' (rank 0, or every rank of a
        sharded run; rank 0's result is logged). None by default."""
        return {}

    eval_every = 0

    def log_record(self, record: dict[str, Any], step: int) -> None:
        """Extra trackers (tensorboard, ...) besides metrics.jsonl; rank 0 only."""

    def progress_postfix(self, record: dict[str, Any]) -> dict[str, str]:
        return {"reward": f"{record.get('reward_mean', math.nan):.4f}"}

    def stop_reason(self) -> Optional[str]:
        """After a step: why the run should end now (the same answer on every rank), None to go on. The loop saves
        a checkpoint, logs the reason in one line and returns (no final evaluation: `resume=true` goes on)."""
        return None

    def finish(self, final_eval: dict[str, float]) -> None:
        """Rank 0, after the last step: write what the finished run leaves besides the final model."""

    def save_final_model(self) -> None:
        """After the last step, when `checkpoint.save_final_model`: the trained weights (rank 0; in a sharded
        run every rank gathers, rank 0 writes), written under `self.out`, which points at a staging folder while
        this runs: the loop moves each entry written there into the run folder once all are whole."""

    def close(self) -> None:
        """Release workers, trackers and files; runs last, however the run ends."""

    # --- one step --------------------------------------------------------------------------------------

    def train_iteration(self) -> dict[str, Any]:
        t_step = time.perf_counter()
        record: dict[str, Any] = {COUNTER_KEY: self.iteration + 1, "lr": self.optimizer.param_groups[0]["lr"]}
        self.iterate(record)
        self.scheduler.step()
        self.iteration += 1
        # a NaN weight stops the run before anything saves it; warns, stops after guards.max_bad_updates bad steps
        self.guard.end_update(record, self.iteration, self.optimizer_step.params)
        record[TIME_KEY] = time.perf_counter() - t_step
        return record

    # --- checkpoints -----------------------------------------------------------------------------------

    def checkpointer(self) -> Checkpointer:
        """This run's checkpoints, built when used: a trainer sets its scheduler and optimizer step after
        `RunLoop.__init__`."""
        return Checkpointer(
            self.dist, self.ckpt_dir, parts=self.checkpoint_parts, schedulers={"lr": self.scheduler},
            optimizer_step=self.optimizer_step, config=lambda: self.cfg.model_dump(mode="json"),
            keep_last=self.cfg.checkpoint.keep_last, unit=self.unit,
            migrate_saved_config=lambda saved: move_renamed_keys(saved, self.renamed_keys, warn=False),
            config_defaults=lambda: type(self.cfg)().model_dump(mode="json"),
        )  # fmt: skip

    def save(self) -> Optional[Path]:
        """Every rank calls it; rank 0 writes the checkpoint of the current step and returns its folder."""
        return self.checkpointer().save(self.iteration)

    def resume(self) -> None:
        """Continue from the newest good checkpoint under the checkpoint folder (none: start at step 0). Damaged
        ones (sizes / hashes differ from the save) are skipped with a warning; a changed setting outside
        `resume_free` is refused (the checkpoint's optimizer and schedule would silently win over it)."""
        ckpt = self.checkpointer().resume(self.restore, set(self.resume_free))
        if ckpt is not None:
            self.iteration = ckpt.step
            self.resumed_from = ckpt.path

    # --- the run ---------------------------------------------------------------------------------------

    def train(self) -> list[dict[str, Any]]:
        """Run to `stop_after` (or the end); returns the metrics records of the steps run."""
        try:
            history = self._run_steps()
            if self.iteration >= self.total_iterations and self._all_ranks_or_main():
                final = self.evaluate("after")
                if self.dist.is_main:
                    self.log_record(final, self.iteration)
                    self.finish(final)
                if self.cfg.checkpoint.save_final_model:
                    self._export_final_model()
            return history
        except WriteFailed as err:
            raise WriteFailed(f"{err}; {self._saved_note()}") from err
        except OSError as err:
            if not self._is_write_failure(err):
                raise
            where = f" ({err.filename})" if err.filename else ""
            raise WriteFailed(
                f"a write under {self.out} failed{where}: {os_error_text(err)}; {self._saved_note()}"
            ) from err
        finally:
            try:
                self.close()
            finally:
                if self.folder_lock is not None:
                    self.folder_lock.release()

    def _is_write_failure(self, err: OSError) -> bool:
        """An error only a write gives (a full disk, a read-only file system), or a denied file of this run."""
        if err.errno in WRITE_ERRNOS:
            return True
        if err.errno in (errno.EACCES, errno.EPERM) and err.filename:
            try:
                return Path(str(err.filename)).resolve().is_relative_to(self.out.resolve())
            except (OSError, ValueError):
                return False
        return False

    def _saved_note(self) -> str:
        """What a stopped run kept: its last checkpoint, and how to go on."""
        last = latest_checkpoint(self.ckpt_dir)
        if last is None:
            return f"the run stopped at {self.unit} {self.iteration} with no checkpoint saved yet"
        return (
            f"the run stopped at {self.unit} {self.iteration}; its last checkpoint {last} is intact: free the "
            "space (or fix the folder) and run again with resume=true"
        )

    def _export_final_model(self) -> None:
        """`save_final_model` into a staging folder (`self.out` points there while it runs); rank 0 then moves each
        entry into the run folder, replacing an earlier export only once the new one is whole. A failed write
        leaves the earlier export and the checkpoints as they were."""
        out, staging = self.out, self.out / ".tmp-export"
        main = self.dist.is_main
        try:
            if main:
                shutil.rmtree(staging, ignore_errors=True)  # left by a crashed export
                staging.mkdir()
            self.out = staging
            try:
                self.save_final_model()
            finally:
                self.out = out
            if main:
                for entry in sorted(staging.iterdir()):
                    replace_folder(entry, out / entry.name)
                staging.rmdir()
        except Exception as err:
            if not is_io_error(err):
                raise
            if main:
                shutil.rmtree(staging, ignore_errors=True)
            raise WriteFailed(
                f"could not export the final model under {out}: {os_error_text(err)} (an earlier export is "
                "unchanged; resume=true exports it again)"
            ) from err

    def _run_steps(self) -> list[dict[str, Any]]:
        from tqdm.auto import tqdm

        cfg, main = self.cfg, self.dist.is_main  # rank 0 writes the config, metrics, checkpoints, final model
        metrics_path = self.out / "metrics.jsonl"
        if main:
            if cfg.resume and self.resumed_from is None:  # nothing to resume from: an earlier run's files go aside
                moved = set_aside(self.out)
                if moved is not None:
                    log.warning(
                        "resume: no checkpoint under %s: starting at %s 0; the earlier run's files are kept in %s",
                        self.ckpt_dir, self.unit, moved,
                    )  # fmt: skip
            config_path = self.out / "config.yaml"
            try:  # atomically: a failed write leaves the earlier config.yaml whole
                replace_atomically(config_path, lambda tmp: dump_config(cfg, tmp))
            except OSError as err:
                raise WriteFailed(f"could not write {config_path}: {os_error_text(err)}") from err
            if self.iteration > 0:  # records written after the checkpoint this run resumed from
                truncate_metrics(metrics_path, self.iteration)
        end = self.total_iterations if cfg.stop_after is None else min(self.total_iterations, cfg.stop_after)
        history: list[dict[str, Any]] = []
        if self.iteration == 0 and self._all_ranks_or_main():
            before = self.evaluate("before")
            if main:
                self.log_record(before, 0)
        bar = tqdm(total=self.total_iterations, initial=self.iteration, desc=self.progress_label,
                   disable=not (cfg.progress and main))  # fmt: skip
        writer = MetricsWriter(metrics_path, append=self.iteration > 0) if main else None
        ckpt_seconds: Optional[float] = None
        stop = StopRequest.install(self.unit)  # SIGINT / SIGTERM: finish the step, save, stop (a 2nd: at once)
        try:
            while self.iteration < end:
                record = self.train_iteration()
                every = self.eval_every
                if every and self.iteration % every == 0 and self.iteration < self.total_iterations:
                    record.update(self.evaluate(f"{self.iteration:06d}"))
                if ckpt_seconds is not None:  # the save that followed the previous step
                    record["time_checkpoint_s"], ckpt_seconds = ckpt_seconds, None
                # the record goes out before the checkpoint: a crash in between leaves a record newer than
                # the checkpoint, which a resumed run drops and writes again
                if writer is not None:
                    writer.write(record)
                    self.log_record(record, self.iteration)
                history.append(record)
                # poll first, on every rank: a collective (max over ranks), so all ranks save the same step
                halt = self.stop_reason()
                if stop.poll(self.dist) or self._checkpoint_due(end) or halt:
                    t0 = time.perf_counter()
                    self.save()
                    ckpt_seconds = time.perf_counter() - t0
                bar.update(1)
                bar.set_postfix(**self.progress_postfix(record))
                stop.check(self.iteration)  # raises Interrupted (exit 128 + signal, resume hint) after the save
                if halt:
                    log.warning("stopping after %s %d: %s", self.unit, self.iteration, halt)
                    break
        finally:
            stop.restore()
            bar.close()
            if writer is not None:
                writer.close()
        return history

    def _all_ranks_or_main(self) -> bool:
        """Rank 0 evaluates and exports alone, except in a sharded or ZeRO-3 run: there every rank holds a part
        of the weights, so every rank takes part in each forward and in gathering the weights to export."""
        return self.dist.is_main or self.dist.gathers_weights

    def _checkpoint_due(self, end: int) -> bool:
        every = self.cfg.checkpoint.every
        return bool(every and self.iteration % every == 0) or self.iteration == end
