"""Edge selection: which edges of a rollout tree enter the backward pass.

BranchGRPO's depth / width pruning, and DanceGRPO's per-sample random timestep subsets. Selection
never changes sampling or rewards; it only removes edges from training. Each function returns a bool
mask over the tree's nodes (the edge into node n is kept where the mask is True); combine them with
`tree.edge_trained` by `&`.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch
from torch import Tensor

from .rollout import RolloutTree


def depth_pruning(
    tree: RolloutTree,
    depths: Sequence[int],
    iteration: int = 0,
    slide_interval: Optional[int] = None,
    stop_depth: Optional[int] = None,
) -> Tensor:
    """Drop edges whose child depth is in `depths`.

    With `slide_interval`, the pruned depths move one level shallower every `slide_interval` iterations,
    never above `stop_depth` (default: 0).
    """
    if not depths:
        return torch.ones(tree.num_nodes, dtype=torch.bool)
    shift = 0
    if slide_interval:
        shift = min(iteration // slide_interval, min(depths) - (stop_depth or 0))
    active = torch.tensor([d - max(shift, 0) for d in depths])
    return ~torch.isin(tree.depth, active)


def last_split_step(tree: RolloutTree) -> int:
    """The last step at which some node has more than one continuing child (-1 for chains)."""
    keep = (tree.parent >= 0) & tree.continues
    children = torch.bincount(tree.parent[keep], minlength=tree.num_nodes)
    branching = (children > 1).nonzero().squeeze(1)
    return int(tree.depth[branching].max()) if branching.numel() else -1


def width_pruning(tree: RolloutTree, node_advantage: Tensor, keep_ratio: float = 0.5, mode: int = 1) -> Tensor:
    """Keep a fraction of the "last layer" edges (those after the last split) by advantage.

    mode 1: within each group of edges that descend from the same child of the last split, keep the
            top `keep_ratio` by advantage; mode 2: keep the best and the worst keep_ratio / 2 of all
            last-layer edges of the batch. Other edges are kept.
    """
    if mode not in (1, 2):
        raise ValueError(f"mode: expected 1 (per last-split child) or 2 (best and worst globally), got {mode}")
    if not 0 < keep_ratio <= 1:
        raise ValueError(f"keep_ratio must be in (0, 1], got {keep_ratio}")
    split = last_split_step(tree)
    last = (tree.edge_step > split) & tree.continues & (tree.parent >= 0)
    keep = ~last
    ids = last.nonzero().squeeze(1)
    if ids.numel() == 0:
        return keep
    adv = node_advantage[ids].float()
    if mode == 2:
        n = math.ceil(ids.numel() * keep_ratio / 2)
        order = torch.argsort(adv, descending=True, stable=True)
        keep[ids[order[:n]]] = True
        keep[ids[order[-n:]]] = True
        return keep
    group = tree.ancestors(ids)[:, split + 1]  # the last-split child each edge descends from
    # Every group at once: by advantage (descending, ties in node order), then stably by group, so each
    # group's edges are contiguous in its own ranking; keep the first ceil(size * keep_ratio) of each.
    order = torch.argsort(adv, descending=True, stable=True)
    order = order[torch.argsort(group[order], stable=True)]
    _, sizes = torch.unique_consecutive(group[order], return_counts=True)
    starts = torch.cumsum(sizes, 0) - sizes
    quota = torch.tensor([math.ceil(n * keep_ratio) for n in sizes.tolist()], dtype=torch.long)
    rank = torch.arange(ids.numel()) - starts.repeat_interleave(sizes)
    keep[ids[order[rank < quota.repeat_interleave(sizes)]]] = True
    return keep


def per_sample_steps(
    tree: RolloutTree, fraction: float, generator: torch.Generator, exclude_last: bool = False
) -> Tensor:
    """Each final sample trains its own random int(fraction * n) of its n trainable steps.

    DanceGRPO / Pref-GRPO: drop the last step (exclude_last), draw an independent random permutation
    of the remaining steps per sample, train the first int(timestep_fraction * n) of it. The n steps
    are those the plan marks trained. Chains must not share trained edges (a tree would need one
    choice per shared edge): use it with chain plans (full_sde, window without a shared prefix).
    """
    if not 0 < fraction <= 1:
        raise ValueError(f"per_sample_fraction must be in (0, 1], got {fraction}")
    chains = tree.ancestors(tree.leaves).flatten(0, 1)[:, 1:]  # [S, T] edge into depth 1..T of each sample
    T = chains.shape[1]
    edge_ok = chains >= 0
    ids = chains.clamp_min(0)
    planned = edge_ok & tree.edge_trained[ids]
    trainable = planned.clone()
    if exclude_last:
        trainable[:, T - 1] = False
    used = ids[trainable]
    if used.unique().numel() != used.numel():
        raise ValueError(
            "per-sample step subsets need chains that share no trained edge (a chain plan, "
            "no shared prefix); this rollout tree shares edges between samples"
        )
    n = trainable.sum(1)
    if bool((n != n[0]).any()):
        raise ValueError("per-sample step subsets need the same trainable steps in every sample")
    k = int(fraction * int(n[0]))
    # an independent uniform permutation per sample over its trainable steps: sort uniform keys
    keys = torch.rand(chains.shape, generator=generator, dtype=torch.float64)
    keys = torch.where(trainable, keys, torch.full_like(keys, 2.0))  # untrainable steps sort last
    chosen = torch.zeros_like(trainable)
    chosen.scatter_(1, torch.argsort(keys, dim=1, stable=True)[:, :k], True)
    keep = torch.ones(tree.num_nodes, dtype=torch.bool)
    keep[ids[planned]] = False  # every planned step of a chain is dropped ...
    keep[ids[chosen & trainable]] = True  # ... but the ones this sample drew
    return keep
