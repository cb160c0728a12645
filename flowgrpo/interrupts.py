"""Ctrl-C and SIGTERM (a scheduler's pre-emption) end a run cleanly: the current update finishes, a
checkpoint is saved, the run stops, and `resume=true` continues from there.

    stop = StopRequest.install()                 # before the loop (main thread; elsewhere a no-op)
    while ...:
        ...one update...
        if checkpoint_due or stop.poll(dist): save()
        stop.check(index)                        # raises Interrupted after the save
    finally: stop.restore()

A second signal while the first is being honoured raises KeyboardInterrupt at once (the user insists).
On several ranks `poll` takes the maximum over ranks, so every rank saves and stops at the same update.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType
from typing import Any, Optional

_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(KeyboardInterrupt):
    """The run stopped on a signal after saving a checkpoint; `exit_code` is 128 + the signal number."""

    def __init__(self, signum: int, index: int, unit: str):
        self.signum, self.index = signum, index
        self.exit_code = 128 + signum
        super().__init__(
            f"stopped by {signal.Signals(signum).name} after {unit} {index}; a checkpoint was saved: "
            "run again with resume=true to continue"
        )


class StopRequest:
    def __init__(self, unit: str = "iteration"):
        self.unit = unit
        self.signum: Optional[int] = None
        self._previous: dict[int, Any] = {}

    @classmethod
    def install(cls, unit: str = "iteration") -> "StopRequest":
        stop = cls(unit)
        if threading.current_thread() is threading.main_thread():
            for sig in _SIGNALS:
                stop._previous[sig] = signal.signal(sig, stop._handle)
        return stop

    def _handle(self, signum: int, frame: Optional[FrameType]) -> None:
        if self.signum is not None:  # the second one: stop now
            raise KeyboardInterrupt
        self.signum = signum

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def poll(self, dist: Any = None) -> bool:
        """Whether any rank was asked to stop (a collective when `dist` is active: call it on every rank)."""
        if dist is not None and getattr(dist, "active", False):
            agreed = int(dist.max(float(self.signum or 0)))
            if agreed and self.signum is None:
                self.signum = agreed
        return self.requested

    def check(self, index: int) -> None:
        """Raise Interrupted when a stop was requested (after the caller saved)."""
        if self.signum is not None:
            raise Interrupted(self.signum, index, self.unit)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
