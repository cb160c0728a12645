"""RolloutTree: the nodes (states) and edges (transitions) of one rollout, shared by every image sampler.

Nodes are stored struct-of-arrays. Node n (n >= number of roots) is reached by exactly one edge, whose
index is also n: `edge_*` arrays are indexed by the child node, and are undefined (NaN / False) for roots.
A flat GRPO group is a forest of chains; BranchGRPO is a tree; a shared deterministic prefix is a tree
that splits at the first stochastic step; TempFlow-GRPO side children are nodes that do not continue.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch import Tensor


@dataclass
class RolloutTree:
    parent: Tensor  # [N] long, -1 for roots
    depth: Tensor  # [N] long: node depth = number of steps from the root
    prompt: Tensor  # [N] long: index into the rollout's prompt list
    continues: Tensor  # [N] bool: False for side children (scored by probe, never advanced)
    states: Tensor  # [N, C, h, w] latents of every node
    edge_step: Tensor  # [N] long: step index of the edge into the node (-1 for roots)
    edge_sde: Tensor  # [N] bool
    edge_trained: Tensor  # [N] bool
    edge_logp: Tensor  # [N] float32: log-prob of the edge under the rollout policy (NaN for roots)
    edge_std: Tensor  # [N] float32: transition std (0 for deterministic edges)
    edge_mean: Optional[Tensor] = None  # [N, C, h, w] rollout-policy mean (GRPO-Guard); None unless kept
    leaves: Tensor = field(
        default_factory=lambda: torch.empty(0, 0, dtype=torch.long)
    )  # [P, L] node ids (-1: a slot a smaller ragged group lacks)
    probe_nodes: Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.long))  # [M] node ids
    probe_latents: Optional[Tensor] = None  # [M, C, h, w] clean latents of each probe completion
    num_steps: int = 0
    counters: dict[str, float] = field(default_factory=dict)
    schedule: Any = None  # the FlowSchedule / DDIMSchedule the rollout ran on (re-scoring needs it)
    leaf_images: Optional[Tensor] = None  # [P, L, C, h, w] latents to decode when not the leaf states

    @property
    def num_nodes(self) -> int:
        return self.parent.shape[0]

    @property
    def num_prompts(self) -> int:
        return self.leaves.shape[0]

    def trained_edges(self) -> Tensor:
        return self.edge_trained.nonzero().squeeze(1)

    def leaf_latents(self) -> Tensor:
        """Latents of the final images laid out [P, L, C, h, w]: the group of prompt p is leaves[p].

        The leaf states, or `leaf_images` when the sampler decodes something else (sampler.decode last_x0).
        """
        return self.states[self.leaves] if self.leaf_images is None else self.leaf_images

    def ancestors(self, nodes: Tensor) -> Tensor:
        """For node ids of shape S, their ancestor at every depth 0..T: [*S, T + 1] (-1 below the node)."""
        flat = nodes.reshape(-1)
        out = torch.full((flat.numel(), self.num_steps + 1), -1, dtype=torch.long)
        rows = torch.arange(flat.numel())
        current = flat.clone()
        while bool((current >= 0).any()):  # one level up per pass, every node at once
            live = current >= 0
            out[rows[live], self.depth[current[live]]] = current[live]
            current = torch.where(live, self.parent[current.clamp_min(0)], current)
        return out.reshape(*nodes.shape, self.num_steps + 1)

    def node_values_along_chains(self, node_values: Tensor) -> Tensor:
        """Gather a per-node value [N] into [P, L, T + 1] along each leaf's chain (TP-GRPO, VGPO)."""
        chain = self.ancestors(self.leaves)
        return torch.where(chain >= 0, node_values[chain.clamp_min(0)], torch.full(chain.shape, float("nan")))

    def side_children(self) -> Tensor:
        """Side children laid out [S, k, T] by spine (S = continuing nodes that branch), -1 where absent."""
        side = (~self.continues).nonzero().squeeze(1)
        if side.numel() == 0:
            return torch.empty(0, 0, self.num_steps, dtype=torch.long)
        spines = self.ancestors(self.parent[side])[:, 0]  # the root of each spine
        spine_ids, spine_of = torch.unique(spines, return_inverse=True)
        steps = self.edge_step[side]
        k = int(torch.bincount(spine_of * self.num_steps + steps).max())
        out = torch.full((spine_ids.numel(), k, self.num_steps), -1, dtype=torch.long)
        slot = torch.zeros(spine_ids.numel(), self.num_steps, dtype=torch.long)
        for n, s, t in zip(side.tolist(), spine_of.tolist(), steps.tolist()):  # bookkeeping only, no tensors math
            out[s, slot[s, t], t] = n
            slot[s, t] += 1
        return out

    def tree_structure(self):
        """Per-prompt node indexing for the tree-depth estimator: a flowgrpo.core TreeStructure."""
        from flowgrpo.core.contracts import TreeStructure

        P = self.num_prompts
        counts = torch.bincount(self.prompt, minlength=P)
        N = int(counts.max())
        order = torch.argsort(self.prompt, stable=True)
        local = torch.empty_like(order)
        starts = torch.cumsum(counts, 0) - counts
        local[order] = torch.arange(order.numel()) - starts[self.prompt[order]]
        parent = torch.full((P, N), -1, dtype=torch.long)
        depth = torch.zeros(P, N, dtype=torch.long)
        valid = torch.zeros(P, N, dtype=torch.bool)
        logp = torch.zeros(P, N)
        has_parent = self.parent >= 0
        parent[self.prompt, local] = torch.where(has_parent, local[self.parent.clamp_min(0)], self.parent)
        depth[self.prompt, local] = self.depth
        valid[self.prompt, local] = True
        logp[self.prompt, local] = torch.nan_to_num(self.edge_logp, nan=0.0)
        return TreeStructure(
            parent=parent, depth=depth, leaf_index=local[self.leaves], node_valid=valid, edge_logp=logp
        ), local


def concat_trees(trees: list[RolloutTree]) -> RolloutTree:
    """One tree of several rollouts of disjoint prompt batches (prompt indices are offset in order)."""
    if len(trees) == 1:
        return trees[0]
    node_off, prompt_off = 0, 0
    parts: dict[str, list] = {k: [] for k in ("parent", "prompt", "leaves", "probe_nodes")}
    for t in trees:
        parts["parent"].append(torch.where(t.parent >= 0, t.parent + node_off, t.parent))
        parts["prompt"].append(t.prompt + prompt_off)
        parts["leaves"].append(torch.where(t.leaves >= 0, t.leaves + node_off, t.leaves))  # -1: a ragged slot
        parts["probe_nodes"].append(t.probe_nodes + node_off)
        node_off += t.num_nodes
        prompt_off += t.num_prompts
    cat = lambda name: torch.cat([getattr(t, name) for t in trees])  # noqa: E731
    probes = [t.probe_latents for t in trees if t.probe_latents is not None]
    images = [t.leaf_images for t in trees if t.leaf_images is not None]
    counters = {k: sum(t.counters.get(k, 0.0) for t in trees) for k in trees[0].counters}
    return RolloutTree(
        parent=torch.cat(parts["parent"]),
        depth=cat("depth"),
        prompt=torch.cat(parts["prompt"]),
        continues=cat("continues"),
        states=cat("states"),
        edge_step=cat("edge_step"),
        edge_sde=cat("edge_sde"),
        edge_trained=cat("edge_trained"),
        edge_logp=cat("edge_logp"),
        edge_std=cat("edge_std"),
        edge_mean=cat("edge_mean") if trees[0].edge_mean is not None else None,
        leaves=torch.cat(parts["leaves"]),
        probe_nodes=torch.cat(parts["probe_nodes"]),
        probe_latents=torch.cat(probes) if probes else None,
        num_steps=trees[0].num_steps,
        counters=counters,
        schedule=trees[0].schedule,
        leaf_images=torch.cat(images) if len(images) == len(trees) else None,
    )
