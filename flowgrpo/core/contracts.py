"""Data contracts of the advantage stage.

`GroupBatch` goes in, `AdvantageResult` comes out. Shapes use P prompts (groups), G samples per group
(the largest group; smaller groups are padded and masked by `valid`), K reward heads, T steps and
N tree nodes. A NaN reward means "could not score": the sample is left out of every statistic and
gets advantage 0; the count is reported in the metrics.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, Optional, Sequence, TypeVar

import torch
from torch import Tensor

if TYPE_CHECKING:
    from .prompt_state import PromptTable

T = TypeVar("T")


def given(value: Optional[T], what: str) -> T:
    """`value`, which the caller's contract guarantees (a registry entry's `requires`, a `__post_init__`);
    a clear error instead of an AttributeError on None if it is missing after all."""
    if value is None:
        raise ValueError(f"{what} is missing")
    return value


def _require(cond: bool, name: str, message: str) -> None:
    if not cond:
        raise ValueError(f"{name}: {message}")


def _check_shape(t: Tensor, name: str, shape: Sequence[Optional[int]]) -> None:
    _require(isinstance(t, Tensor), name, f"expected a torch.Tensor, got {type(t).__name__}")
    ok = t.dim() == len(shape) and all(s is None or s == d for s, d in zip(shape, t.shape))
    want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
    _require(ok, name, f"expected shape {want}, got {list(t.shape)}")


@dataclass
class TreeStructure:
    """One rollout tree per group (BranchGRPO). Nodes are indexed 0..N-1 within each tree.

    parent:     [P, N] long, index of the parent node, -1 for a root.
    depth:      [P, N] long, steps from the root (the denoising-step index of the node).
    leaf_index: [P, G] long, the node that is sample g's final state (its reward is rewards[p, g]).
    node_valid: [P, N] bool, padding for trees with fewer than N nodes.
    edge_logp:  [P, N] float, old log-prob of the edge into each node (for softmax fusion).
    """

    parent: Tensor
    depth: Tensor
    leaf_index: Tensor
    node_valid: Optional[Tensor] = None
    edge_logp: Optional[Tensor] = None

    def validate(self, P: int, G: int) -> None:
        _check_shape(self.parent, "tree.parent", [P, None])
        N = self.parent.shape[1]
        _check_shape(self.depth, "tree.depth", [P, N])
        _check_shape(self.leaf_index, "tree.leaf_index", [P, G])
        if self.node_valid is None:
            self.node_valid = torch.ones(P, N, dtype=torch.bool, device=self.parent.device)
        _check_shape(self.node_valid, "tree.node_valid", [P, N])
        if self.edge_logp is not None:
            _check_shape(self.edge_logp, "tree.edge_logp", [P, N])
        _require(
            bool((self.parent < N).all()) and bool((self.parent >= -1).all()),
            "tree.parent",
            f"indices must lie in [-1, {N - 1}]",
        )
        _require(
            bool((self.leaf_index >= 0).all()) and bool((self.leaf_index < N).all()),
            "tree.leaf_index",
            f"indices must lie in [0, {N - 1}]",
        )
        has_parent = self.parent >= 0
        parent_depth = self.depth.gather(1, self.parent.clamp_min(0))
        _require(
            bool((parent_depth[has_parent] + 1 == self.depth[has_parent]).all()),
            "tree.depth",
            "a child's depth must be its parent's depth + 1",
        )

    @property
    def num_nodes(self) -> int:
        return self.parent.shape[1]


@dataclass
class GroupBatch:
    """Input of every advantage estimator.

    rewards:        [P, G] or [P, G, K] float; NaN = could not score.
    valid:          [P, G] bool; False = padding of a ragged group (or a sample dropped upstream).
    reward_weights: [K] weights of the reward heads (default: all 1).
    reward_names:   K names, used in the metrics.
    step_rewards:   [P, G, T] per-step rewards (process rewards, probe rewards); NaN = not scored.
    step_mask:      [P, G, T] bool, which steps exist.
    tree:           rollout-tree structure for node-level estimators.
    preferences:    [P, G, G] P(sample i beats sample j) from a pairwise judge; NaN = unreadable.
    lengths:        [P, G] action counts (tokens or steps), for length-aware statistics.
    entropy:        [P, G] mean per-action entropy of each sample (CANON's entropy split).
    step:           the training step, counted from 1 (scheduled estimators: CANON's annealed weights).
    prompt_ids:     [P] long, each group's dataset row (stateful parts: the SPO tracker, prompt samplers).
    prompt_state:   the run's per-prompt state (flowgrpo.core.prompt_state.PromptTable), updated in place.
    confidence:     [P, G] sequence log-prob of each sample under the policy minus under the reference (ACE).
    drift:          [P] each group's prompt's mean |stored - current| token log-prob over its last stored
                    response, 0 at a prompt's first sight (SPO's KL-adaptive forgetting, rho_type 'kl').
    head_nan_policy: how a NaN head enters the weighted sum (see `scalar_rewards`).
    """

    rewards: Optional[Tensor] = None
    valid: Optional[Tensor] = None
    reward_weights: Optional[Tensor] = None
    reward_names: Optional[Sequence[str]] = None
    step_rewards: Optional[Tensor] = None
    step_mask: Optional[Tensor] = None
    tree: Optional[TreeStructure] = None
    preferences: Optional[Tensor] = None
    lengths: Optional[Tensor] = None
    entropy: Optional[Tensor] = None
    step: Optional[int] = None
    prompt_ids: Optional[Tensor] = None
    prompt_state: Optional["PromptTable"] = None
    confidence: Optional[Tensor] = None
    drift: Optional[Tensor] = None
    head_nan_policy: Literal["propagate", "ignore_head"] = "propagate"

    def __post_init__(self) -> None:
        source = next((t for t in (self.rewards, self.step_rewards, self.preferences) if t is not None), None)
        _require(source is not None, "rewards", "a GroupBatch needs rewards, step_rewards or preferences")
        _require(
            isinstance(source, Tensor) and source.dim() >= 2, "rewards", "expected a tensor with a [P, G, ...] shape"
        )
        source = given(source, "rewards")
        P, G = source.shape[:2]
        if self.rewards is not None:
            _require(
                self.rewards.dim() in (2, 3),
                "rewards",
                f"expected shape [P, G] or [P, G, K], got {list(self.rewards.shape)}",
            )
            _check_shape(self.rewards, "rewards", [P, G] + ([None] if self.rewards.dim() == 3 else []))
            _require(self.rewards.is_floating_point(), "rewards", "expected a floating-point tensor")
        device = source.device
        if self.valid is None:
            self.valid = torch.ones(P, G, dtype=torch.bool, device=device)
        _check_shape(self.valid, "valid", [P, G])
        _require(self.valid.dtype == torch.bool, "valid", f"expected a bool tensor, got {self.valid.dtype}")
        K = self.num_heads
        if self.reward_weights is None:
            self.reward_weights = torch.ones(K, device=device)
        self.reward_weights = torch.as_tensor(self.reward_weights, dtype=torch.float32, device=device)
        _check_shape(self.reward_weights, "reward_weights", [K])
        if self.reward_names is None:
            self.reward_names = [f"reward_{k}" for k in range(K)] if K > 1 else ["reward"]
        _require(len(self.reward_names) == K, "reward_names", f"expected {K} names, got {len(self.reward_names)}")
        if self.step_rewards is not None:
            _check_shape(self.step_rewards, "step_rewards", [P, G, None])
            if self.step_mask is None:
                self.step_mask = torch.ones_like(self.step_rewards, dtype=torch.bool)
            _check_shape(self.step_mask, "step_mask", list(self.step_rewards.shape))
            _require(self.step_mask.dtype == torch.bool, "step_mask", "expected a bool tensor")
        elif self.step_mask is not None:
            raise ValueError("step_mask: given without step_rewards")
        if self.preferences is not None:
            _check_shape(self.preferences, "preferences", [P, G, G])
        if self.lengths is not None:
            _check_shape(self.lengths, "lengths", [P, G])
        if self.entropy is not None:
            _check_shape(self.entropy, "entropy", [P, G])
        if self.prompt_ids is not None:
            _check_shape(self.prompt_ids, "prompt_ids", [P])
        if self.confidence is not None:
            _check_shape(self.confidence, "confidence", [P, G])
        if self.drift is not None:
            _check_shape(self.drift, "drift", [P])
        if self.tree is not None:
            self.tree.validate(P, G)

    @property
    def mask(self) -> Tensor:
        """`valid` [P, G], always set after construction."""
        return given(self.valid, "GroupBatch.valid")

    @property
    def weights(self) -> Tensor:
        """`reward_weights` [K], always set after construction."""
        return given(self.reward_weights, "GroupBatch.reward_weights")

    @property
    def num_groups(self) -> int:
        return self.mask.shape[0]

    @property
    def group_size(self) -> int:
        return self.mask.shape[1]

    @property
    def num_heads(self) -> int:
        return 1 if self.rewards is None or self.rewards.dim() == 2 else self.rewards.shape[2]

    def head_rewards(self) -> Tensor:
        """Rewards as [P, G, K]."""
        if self.rewards is None:
            raise ValueError("rewards: this estimator needs scalar rewards per sample")
        return self.rewards if self.rewards.dim() == 3 else self.rewards.unsqueeze(-1)

    def scalar_rewards(self, nan_policy: Optional[str] = None) -> Tensor:
        """Weighted sum of the heads, [P, G].

        propagate:   a sample is NaN if any head is NaN (it could not be fully scored).
        ignore_head: NaN heads are left out of the sum (TRL's "not applicable" reward functions);
                     a sample is NaN only if every head is NaN.
        """
        nan_policy = nan_policy or self.head_nan_policy
        r = self.head_rewards().float()
        w = self.weights
        if nan_policy == "propagate":
            return (r * w).sum(-1)
        if nan_policy == "ignore_head":
            nan = torch.isnan(r)
            total = torch.where(nan, torch.zeros_like(r), r * w).sum(-1)
            return torch.where(nan.all(-1), torch.full_like(total, float("nan")), total)
        raise ValueError(f"nan_policy: expected 'propagate' or 'ignore_head', got {nan_policy!r}")

    def usable(self, rewards: Tensor) -> Tensor:
        """Valid samples whose reward is a finite number, same shape as `rewards`."""
        valid = self.mask
        while valid.dim() < rewards.dim():
            valid = valid.unsqueeze(-1)
        return valid & torch.isfinite(rewards)


@dataclass
class AdvantageResult:
    """Output of the advantage stage.

    advantages:    [P, G] (per sample), [P, G, T] (per step) or [P, N] (per tree node; the edge into
                   node n trains with advantages[p, n]).
    sample_weight: same shape as `advantages`; 0 removes that action from the loss (padding, a
                   filtered group, MC-GRPO's pivot), other values scale it.
    level:         "sample", "step" or "node".
    metrics:       floats for logging.
    """

    advantages: Tensor
    sample_weight: Tensor
    level: Literal["sample", "step", "node"] = "sample"
    metrics: dict[str, float] = field(default_factory=dict)
