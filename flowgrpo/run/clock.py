"""Phase timing that counts a phase's device work in that phase.

CUDA runs asynchronously: without a synchronisation a phase's kernels are counted in whichever later phase first
waits for them (an H100 text run reported 1 ms of training per step before this).
"""

from __future__ import annotations

import time
from typing import Union

import torch


def seconds_since(t0: float, device: Union[str, torch.device, None] = None) -> float:
    """Wall seconds since `t0` (time.perf_counter) once `device`'s queued work is done."""
    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0
