"""Credit assignment: rewards of a rollout tree -> one advantage per trained edge, via flowgrpo.core.

Every method differs only in which node's reward is used and how it becomes an advantage:
  sample level (grpo, win_rate, ...): the final image's advantage goes to every trained edge of its chain;
  turning_point / value_anchored:     probe rewards along each chain -> one advantage per step;
  sibling (TempFlow):                 side children's completed rewards, z-scored among siblings;
  tree_depth (BranchGRPO):            leaf rewards fused up the tree -> one advantage per node (edge).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import Tensor

from ..core import GroupBatch, compute_advantages
from ..core.advantages import ESTIMATORS, reward_metrics
from .config import T2IConfig


@dataclass
class Credit:
    edges: Tensor  # [E] node ids: the edge into each is trained
    advantages: Tensor  # [E]
    weights: Tensor  # [E] sample weights (> 0)
    metrics: dict[str, float] = field(default_factory=dict)
    node_advantage: Optional[Tensor] = None  # [N] (NaN where none), for logging and pruning


def _scalar(values: Tensor, batch_like: GroupBatch) -> Tensor:
    """Weighted sum of reward heads for arbitrary rows [n, K] -> [n] (the batch's NaN policy)."""
    probe = GroupBatch(
        rewards=values.unsqueeze(0),
        reward_weights=batch_like.reward_weights,
        reward_names=batch_like.reward_names,
        head_nan_policy=batch_like.head_nan_policy,
    )
    return probe.scalar_rewards().squeeze(0)


def assign_credit(
    tree,
    leaf_values: Tensor,
    probe_values: Optional[Tensor],
    preferences: Optional[Tensor],
    cfg: T2IConfig,
    iteration: int,
) -> Credit:
    P, L = tree.leaves.shape
    K = leaf_values.shape[-1]
    needs = ESTIMATORS.get(cfg.advantage.estimator.name)  # which rewards it reads, declared where it is registered
    base = dict(
        rewards=leaf_values.view(P, L, K),
        reward_weights=[r.weight for r in cfg.rewards],
        reward_names=[r.label for r in cfg.rewards],
        head_nan_policy=cfg.advantage.head_nan_policy,
    )
    N = tree.num_nodes
    node_adv = torch.full((N,), float("nan"))
    node_w = torch.zeros(N)

    if "step_rewards" in needs.requires:
        plain = GroupBatch(**base)
        node_r = torch.full((N,), float("nan"))
        if probe_values is not None and tree.probe_nodes.numel():
            node_r[tree.probe_nodes] = _scalar(probe_values, plain)
        if needs.plan == "branch_points":
            side = tree.side_children()  # [S, k, T]
            S, k, T = side.shape
            side = side.view(P, S // P * k, T) if S else side.view(P, 0, T)
            step_r = torch.where(side >= 0, node_r[side.clamp_min(0)], torch.full(side.shape, float("nan")))
            # the groups here are the siblings of each branch point, not the spines' final images
            sib = {k: v for k, v in base.items() if k != "rewards"}
            result = compute_advantages(GroupBatch(**sib, step_rewards=step_r, step_mask=side >= 0), cfg.advantage)
            result.metrics.update(reward_metrics(plain))
            edge_nodes = side
        else:
            chain = tree.ancestors(tree.leaves)  # [P, L, T + 1]
            end = int(tree.depth[tree.probe_nodes].max()) + 1
            along = node_r[chain[..., :end]]
            if needs.final_reward_step:  # R_end: ODE from depth `end` = the final image
                along = torch.cat([along, plain.scalar_rewards().unsqueeze(-1)], -1)
            batch = GroupBatch(**base, step_rewards=along)
            result = compute_advantages(batch, cfg.advantage)
            edge_nodes = chain[..., 1 : end + 1]
        ok = edge_nodes >= 0
        node_adv[edge_nodes[ok]] = result.advantages[ok].float()
        node_w[edge_nodes[ok]] = result.sample_weight[ok].float()
    elif "tree" in needs.requires:
        structure, local = tree.tree_structure()
        result = compute_advantages(GroupBatch(**base, tree=structure), cfg.advantage)
        node_adv = result.advantages[tree.prompt, local].float()
        node_w = result.sample_weight[tree.prompt, local].float()
    else:
        result = compute_advantages(GroupBatch(**base, preferences=preferences), cfg.advantage)
        chain = tree.ancestors(tree.leaves)[..., 1:]  # edges into depth 1..T
        ok = chain >= 0
        adv = result.advantages.unsqueeze(-1).expand_as(chain)
        w = result.sample_weight.unsqueeze(-1).expand_as(chain)
        node_adv[chain[ok]] = adv[ok].float()
        node_w[chain[ok]] = w[ok].float()

    keep = tree.edge_trained & (node_w > 0) & torch.isfinite(node_adv)
    metrics = dict(result.metrics)
    if "tree" in needs.requires:
        from pipelines.edge_selection import depth_pruning, width_pruning

        edges_cfg = cfg.edges
        if edges_cfg.depth_pruning:
            keep &= depth_pruning(tree, edges_cfg.depth_pruning, iteration, edges_cfg.depth_pruning_slide_every)
        if edges_cfg.width_pruning:
            keep &= width_pruning(
                tree, torch.nan_to_num(node_adv), edges_cfg.width_pruning, edges_cfg.width_pruning_mode
            )
    if cfg.edges.per_sample_fraction is not None:
        from pipelines.edge_selection import per_sample_steps

        # the same draw on every rank and after a resume: it depends on (seed, iteration) only
        gen = torch.Generator().manual_seed((cfg.seed * 1_000_003 + iteration) * 7_919 + 17)
        keep &= per_sample_steps(tree, cfg.edges.per_sample_fraction, gen, cfg.edges.exclude_last)
    if cfg.edges.drop_zero_advantage and cfg.loss.kl.coef == 0:
        keep &= node_adv != 0
    edges = keep.nonzero().squeeze(1)
    metrics["edges/trained"] = float(edges.numel())
    metrics["edges/available"] = float(tree.edge_trained.sum())
    return Credit(edges, node_adv[edges], node_w[edges], metrics, node_adv)
