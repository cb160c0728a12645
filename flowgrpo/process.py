"""Process-wide settings every training run applies first: CPU threads, deterministic kernels, seeds."""

from __future__ import annotations

import random
from typing import Optional

import numpy as np
import torch


def prepare_process(seed: int, num_threads: Optional[int] = None, deterministic: bool = False) -> None:
    """Seed python, numpy and torch (all devices); fix torch's CPU threads and deterministic kernels when asked."""
    if num_threads:
        torch.set_num_threads(num_threads)
    if deterministic:
        torch.use_deterministic_algorithms(True)
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
