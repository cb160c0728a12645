"""What a trainer hands a checkpoint (`CheckpointParts`), and which of it FSDP2 shards over the ranks.

A sharded tensor (a DTensor) is written by every rank into the checkpoint's `sharded/` folder
(flowgrpo.checkpoint.shards); everything else is written by rank 0 (flowgrpo.checkpoint.format).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class CheckpointParts:
    """What a trainer adds to a checkpoint: named tensor groups, optimizers (besides the LR schedule), state."""

    tensors: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    optimizers: dict[str, torch.optim.Optimizer] = field(default_factory=dict)
    state: dict[str, Any] = field(default_factory=dict)


def is_shard(t: Any) -> bool:
    """A tensor FSDP2 shards over the ranks (a DTensor): written by every rank, not by rank 0's files."""
    return type(t).__name__ == "DTensor"


def local_part(t: Any) -> Any:
    """This rank's shard of a sharded tensor; a plain tensor as it is."""
    return t.to_local() if is_shard(t) else t
