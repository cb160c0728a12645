"""The image trainer's method plug-ins: their registries, what they receive, and the scored rollout they update on.

A method decides which weights sample the rollout and how a scored rollout becomes optimizer steps (the
contract: flowgrpo.run.method.Method). `method: grpo` (the clipped objective over re-scored edges,
flowgrpo/t2i/grpo.py) and `method: nft` (DiffusionNFT's forward-process objective, flowgrpo/t2i/nft.py)
are entries of METHODS; a config section with `enabled: true` whose name is in WRAPPERS wraps the method
(Adv-GRPO's discriminator alternation, flowgrpo/t2i/adversarial.py). A method sees an `ImageContext`, never
the trainer.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Optional

from torch import Tensor

from ..core.contracts import GroupBatch
from ..core.registry import Registry
from ..run.method import Method, MethodContext

METHODS = Registry("method")
WRAPPERS = Registry("method wrapper")


@dataclass(frozen=True)
class ImageContext(MethodContext):
    """What an image method may use besides the shared context."""

    adapter: Any = None  # the model family's adapter (pipelines.adapters): denoiser, encode, decode, LoRA
    sampler: Any = None  # pipelines.sampler.Sampler: rolls out, re-scores edges, counts forwards
    ema: Any = None  # flowgrpo.run.ScheduledEMA or None
    scorer: Optional[Callable[[str], Any]] = None  # a configured scorer by its label (a trained reward)


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
    batch_prompts: Any  # every prompt of the step, all ranks (flowgrpo.t2i.data.PromptSet)
    nodes_per_chunk: int  # nodes of one rollout batch (global <-> local edge ids)
    prompt_ids: Optional[Tensor] = None  # [P] the dataset row of each of batch_prompts (with prompt_state)
    prompt_state: Any = None  # the run's per-prompt state (flowgrpo.core.prompt_state.PromptTable), if a part reads it


def leaf_batch(rollout: ScoredRollout, cfg: Any) -> GroupBatch:
    """Every group's final-sample rewards [P, L, K] (global order) with the run's reward weights, names and NaN
    policy: what a method's advantages or weighted rewards start from."""
    L = rollout.tree.leaves.shape[1]
    return GroupBatch(
        rewards=rollout.leaf_values.view(-1, L, rollout.leaf_values.shape[-1]),
        reward_weights=[r.weight for r in cfg.rewards],
        reward_names=[r.label for r in cfg.rewards],
        head_nan_policy=cfg.advantage.head_nan_policy,
    )


class ImageMethod(Method):
    """An image method: the defaults are GRPO's (sample with the current policy)."""

    ctx: ImageContext
    needs_images = False  # the update reads the decoded images
    per_sample_steps = False  # trains edges picked per final sample: `edges.per_sample_fraction` applies

    @staticmethod
    def prepare_model(adapter: Any, cfg: Any) -> None:
        """Add what the method keeps inside the denoiser (NFT's old-policy adapter) before it is sharded."""

    def rollout_policy(self) -> Any:
        return contextlib.nullcontext(self.ctx.adapter)


def build_method(ctx: ImageContext) -> ImageMethod:
    """The configured method, wrapped by every enabled wrapper section (in name order)."""
    cfg = ctx.cfg
    method: ImageMethod = METHODS.get(cfg.method).fn(ctx)
    for name in WRAPPERS.names():
        if getattr(cfg, name).enabled:
            method = WRAPPERS.get(name).fn(ctx, method)
    return method


def method_class(name: str) -> type[ImageMethod]:
    return METHODS.get(name).fn
