"""Non-finite guards for a training loop: no update from a non-finite number, a warning with counts, a clear
stop when it keeps happening.

Where the run loop (`flowgrpo.run`) uses its `NonFiniteGuard` (`RunLoop.guard`):
    values = guard.rewards(record, values)      # each trainer, after collecting: +-inf -> NaN (excluded like an
                                                # unscored sample); counts; no finite reward at all is a bad update
    if guard.step_ok(grad_norm): optimizer.step()   # OptimizerStep: a NaN / inf gradient is never stepped
    guard.end_update(record, index, params)     # RunLoop.train_iteration: a non-finite weight stops the run at once;
                                                # warns; stops after `max_bad_updates` bad updates in a row

NaN / inf rewards and huge ones (1e38: finite, but its square overflows in the advantage statistics)
both end up as non-finite gradients, so the gradient check is the one that keeps the weights clean; the
reward check gives the early, specific message. Checkpoints refuse non-finite tensors on their own
(`flowgrpo.checkpoint`), so a bad state is never saved and never rotates good checkpoints away.
"""

from __future__ import annotations

import math
import warnings
from typing import Any, Iterable

import torch
from pydantic import Field

from .checkpoint import local_part
from .core import StrictModel


class NonFiniteError(RuntimeError):
    """Training stopped: non-finite rewards, gradients or weights. The message says which and where."""


class NonFiniteWarning(UserWarning):
    """An update saw non-finite rewards or gradients and left them out."""


class GuardConfig(StrictModel):
    max_bad_updates: int = Field(3, ge=1)  # stop after this many bad iterations / steps in a row


class NonFiniteGuard:
    """Counts per update (iteration or step); `unit` names it in messages. `nan_is_missing`: NaN rewards are
    "not applicable" (the text trainer's None, counted per reward already), so only +-inf is reported; the
    image trainer's NaN is a failed score and is reported too."""

    def __init__(self, config: GuardConfig, unit: str = "iteration", nan_is_missing: bool = False) -> None:
        self.config, self.unit, self.nan_is_missing = config, unit, nan_is_missing
        self.streak = 0
        self._reset()

    def _reset(self) -> None:
        self.nonfinite_rewards = 0
        self.rewards_seen = 0
        self.no_finite_reward = False
        self.skipped_steps = 0

    def rewards(self, record: dict[str, Any], *values: torch.Tensor | None) -> Any:
        """The reward tensors with +-inf made NaN (NaN means "not scored" to the core). Returns one tensor
        for one argument, else a tuple (None passes through)."""
        out, finite_any = [], False
        for v in values:
            if v is None:
                out.append(v)
                continue
            bad = ~torch.isfinite(v)
            self.rewards_seen += v.numel()
            self.nonfinite_rewards += int((torch.isinf(v) if self.nan_is_missing else bad).sum())
            finite_any = finite_any or bool((~bad).any())
            out.append(torch.where(bad, torch.full_like(v, math.nan), v) if v.is_floating_point() else v)
        self.no_finite_reward = self.rewards_seen > 0 and not finite_any
        record["guard/nonfinite_rewards"] = self.nonfinite_rewards
        return out[0] if len(out) == 1 else tuple(out)

    def step_ok(self, grad_norm: float) -> bool:
        """False (skip this optimizer step) when the gradient norm is NaN / inf (`OptimizerStep` asks)."""
        if math.isfinite(grad_norm):
            return True
        self.skipped_steps += 1
        return False

    def weights(self, params: Iterable[torch.Tensor], index: int) -> None:
        """Raise when a weight is non-finite after a step (finite gradients can still overflow a weight)."""
        # one multi-tensor max |w| over this rank's parts (a sharded weight: its shard; an empty shard has no max)
        parts = [t for t in (local_part(p).detach() for p in params) if t.numel()]
        if parts and not bool(torch.nn.utils.get_total_norm(parts, norm_type=math.inf).isfinite()):
            raise NonFiniteError(
                f"{self.unit} {index}: a weight became NaN / inf after an optimizer step; "
                "stopped before saving it (the last checkpoint holds finite weights). Lower "
                "optim.lr or set optim.max_grad_norm"
            )

    def end_update(self, record: dict[str, Any], index: int, params: Iterable[torch.Tensor] = ()) -> None:
        """Check the weights; warn about this update's non-finite values; raise after `max_bad_updates` bad
        updates in a row."""
        self.weights(params, index)
        problems = []
        if self.no_finite_reward:
            problems.append(f"no finite reward among {self.rewards_seen} (all NaN / None / inf)")
        elif self.nonfinite_rewards:
            what = "inf" if self.nan_is_missing else "NaN / inf"
            problems.append(f"{self.nonfinite_rewards} of {self.rewards_seen} rewards {what} (left out)")
        if self.skipped_steps:
            record["guard/skipped_steps"] = self.skipped_steps
            problems.append(f"{self.skipped_steps} optimizer step(s) skipped: non-finite gradients")
        bad = self.no_finite_reward or self.skipped_steps > 0
        self.streak = self.streak + 1 if bad else 0
        record["guard/bad_streak"] = self.streak
        if problems:
            # one channel: a warning (filters, pytest.warns); `flowgrpo train-*` shows it as one log line
            # (cli._configure_logging). Logging it as well printed every such warning twice.
            msg = f"{self.unit} {index}: " + "; ".join(problems)
            warnings.warn(msg, NonFiniteWarning, stacklevel=2)
        self._reset()
        if self.streak >= self.config.max_bad_updates:
            raise NonFiniteError(
                f"stopped at {self.unit} {index}: {self.streak} {self.unit}s in a row without a usable update "
                f"({'; '.join(problems)}). Check the reward functions / server; the last checkpoint is intact "
                f"(guards.max_bad_updates={self.config.max_bad_updates})"
            )
