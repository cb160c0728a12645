"""Training methods of the image trainer as registered plug-ins: the loop never asks which method runs.

A method decides which weights sample the rollout and how one training step turns a scored rollout into
optimizer steps. `method: grpo` (the clipped objective over re-scored edges, flowgrpo/t2i/grpo.py) and
`method: nft` (DiffusionNFT's forward-process objective, flowgrpo/t2i/nft.py) are entries of METHODS;
a config section with `enabled: true` whose name is in WRAPPERS wraps the method (Adv-GRPO's
discriminator alternation, flowgrpo/t2i/adversarial.py). A method's config rules live with it
(`Method.check_config`, `Method.per_sample_steps`); the config checks `method` against METHODS' names.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ContextManager, Optional

from torch import Tensor

from ..core.registry import Registry
from ..run.loop import CheckpointParts

if TYPE_CHECKING:
    from ..checkpoint import Checkpoint
    from .config import T2IConfig
    from .data import PromptSet
    from .trainer import T2ITrainer

METHODS = Registry("method")
WRAPPERS = Registry("method wrapper")


@dataclass
class ScoredRollout:
    """One training step's rollout on this rank, scored, with the global view credit assignment needs."""

    tree: Any  # this rank's rollout batches, concatenated (pipelines.rollout.RolloutTree)
    global_tree: Any  # every rank's batches (structure and log-probs only), in global order
    leaf_values: Tensor  # [P * L, K] rewards of the final samples, every rank, global order
    probe_values: Optional[Tensor]  # rewards of probe / side-branch completions (per-step estimators)
    preferences: Optional[Tensor]  # pairwise preferences (pairwise rewards)
    images: Optional[Tensor]  # this rank's decoded final images, when kept (grids, discriminator)
    prompts: list[str]  # this rank's prompts, in local tree order
    batch_prompts: PromptSet  # every prompt of the step (all ranks)
    nodes_per_chunk: int  # nodes of one rollout batch (global <-> local edge ids)


class Method:
    """The contract of a method plug-in; the defaults are GRPO's (sample with the current policy)."""

    needs_images = False  # the update reads the decoded images
    per_sample_steps = False  # trains edges picked per final sample: `edges.per_sample_fraction` applies

    @staticmethod
    def check_config(cfg: T2IConfig) -> None:
        """This method's own config rules (T2IConfig's cross-checks call them): a ValueError names the problem."""

    def __init__(self, trainer: T2ITrainer) -> None:
        self.trainer = trainer

    @staticmethod
    def prepare_model(adapter: Any, cfg: T2IConfig) -> None:
        """Add what the method keeps inside the denoiser (NFT's old-policy adapter) before it is sharded."""

    @staticmethod
    def needs_reference(cfg: T2IConfig) -> bool:
        """A KL term against the reference (LoRA-disabled / frozen) policy."""
        return False

    def rollout_policy(self) -> ContextManager[Any]:
        """The weights that sample the rollout."""
        return contextlib.nullcontext(self.trainer.adapter)

    def update(self, rollout: ScoredRollout, record: dict[str, Any]) -> None:
        """Turn the scored rollout into optimizer steps (trainer.optimizer_step); metrics into `record`."""
        raise NotImplementedError

    def checkpoint_parts(self, parts: CheckpointParts) -> None:
        """Add this method's own tensors / optimizers / state to a checkpoint."""

    def restore(self, ckpt: Checkpoint) -> None:
        """Load what `checkpoint_parts` saved."""


def build_method(trainer: T2ITrainer) -> Method:
    """The configured method, wrapped by every enabled wrapper section (in name order)."""
    cfg = trainer.cfg
    method: Method = METHODS.get(cfg.method).fn(trainer)
    for name in WRAPPERS.names():
        if getattr(cfg, name).enabled:
            method = WRAPPERS.get(name).fn(trainer, method)
    return method


def method_class(name: str) -> type[Method]:
    return METHODS.get(name).fn
