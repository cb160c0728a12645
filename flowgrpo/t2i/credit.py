"""Credit assignment: rewards of a rollout tree -> one advantage per trained edge, via flowgrpo.core.

Every method differs only in which node's reward is used and how it becomes an advantage:
  sample level (grpo, win_rate, ...): the final image's advantage goes to every trained edge of its chain;
  turning_point / value_anchored:     probe rewards along each chain -> one advantage per step;
  sibling (TempFlow):                 side children's completed rewards, z-scored among siblings;
  tree_depth (BranchGRPO):            leaf rewards fused up the tree -> one advantage per node (edge).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Optional

import torch
from torch import Tensor

from ..core import GroupBatch, compute_advantages
from ..core.advantages import ESTIMATORS, reward_metrics
from ..core.group_filter import filter_metrics, group_keep
from ..core.prompt_state import PromptTable
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


def _node_probe_rewards(tree, probe_values: Optional[Tensor], plain: GroupBatch) -> Tensor:
    """[N] the scalar reward of each probed node (NaN elsewhere)."""
    node_r = torch.full((tree.num_nodes,), float("nan"))
    if probe_values is not None and tree.probe_nodes.numel():
        node_r[tree.probe_nodes] = _scalar(probe_values, plain)
    return node_r


def _siblings(tree, base: dict, probe_values: Optional[Tensor], preferences, cfg: T2IConfig):
    """Side children's completed rewards, grouped by branch point (the groups are the siblings, not the spines)."""
    plain = GroupBatch(**base)
    node_r = _node_probe_rewards(tree, probe_values, plain)
    P = tree.leaves.shape[0]
    side = tree.side_children()  # [S, k, T]
    S, k, T = side.shape
    side = side.view(P, S // P * k, T) if S else side.view(P, 0, T)
    step_r = torch.where(side >= 0, node_r[side.clamp_min(0)], torch.full(side.shape, float("nan")))
    # the probe rewards are already one weighted value per node: no per-reward weights or names
    dropped = ("rewards", "prompt_ids", "prompt_state", "reward_weights", "reward_names")
    sib = {key: v for key, v in base.items() if key not in dropped}
    result = compute_advantages(GroupBatch(**sib, step_rewards=step_r, step_mask=side >= 0), cfg.advantage)
    if plain.prompt_state is not None and plain.prompt_ids is not None:  # the prompt samplers' statistics
        r = plain.scalar_rewards()  # of the final images: the sibling batch has none
        plain.prompt_state.observe(plain.prompt_ids, r, plain.usable(r), plain.step or 0)
    result.metrics.update(reward_metrics(plain))
    return result.advantages, result.sample_weight, side, result.metrics


def _along_chains(tree, base: dict, probe_values: Optional[Tensor], preferences, cfg: T2IConfig):
    """Probe rewards along each chain -> one advantage per step (+ the final sample's, where the estimator ends
    with it: R_end is the ODE completion from the deepest probe, i.e. the final image)."""
    plain = GroupBatch(**base)
    node_r = _node_probe_rewards(tree, probe_values, plain)
    chain = tree.ancestors(tree.leaves)  # [P, L, T + 1]
    end = int(tree.depth[tree.probe_nodes].max()) + 1
    along = node_r[chain[..., :end]]
    if ESTIMATORS.get(cfg.advantage.estimator.name).final_reward_step:
        along = torch.cat([along, plain.scalar_rewards().unsqueeze(-1)], -1)
    result = compute_advantages(GroupBatch(**base, step_rewards=along), cfg.advantage)
    return result.advantages, result.sample_weight, chain[..., 1 : end + 1], result.metrics


def _final(tree, base: dict, probe_values: Optional[Tensor], preferences, cfg: T2IConfig):
    """The final sample's advantage goes to every edge of its chain."""
    result = compute_advantages(GroupBatch(**base, preferences=preferences), cfg.advantage)
    chain = tree.ancestors(tree.leaves)[..., 1:]  # edges into depth 1..T
    adv = result.advantages.unsqueeze(-1).expand_as(chain)
    return adv, result.sample_weight.unsqueeze(-1).expand_as(chain), chain, result.metrics


def saturated_group_mask(batch: GroupBatch, cfg: T2IConfig) -> Tensor:
    """[P] bool: the groups `edges.group_filter` keeps in the loss (all of them when it is off)."""
    f = cfg.edges.group_filter
    if f is None:
        return torch.ones(batch.num_groups, dtype=torch.bool)
    return group_keep(batch, f.min_std, f.max_mean, [r.weight for r in cfg.rewards])  # float64 weights, as given


# What the estimator reads (its registered `reads`) -> how its advantages reach the edges
CHAIN_CREDIT = {"final": _final, "preferences": _final, "step_rewards": _along_chains, "siblings": _siblings}


def assign_credit(
    tree,
    leaf_values: Tensor,
    probe_values: Optional[Tensor],
    preferences: Optional[Tensor],
    cfg: T2IConfig,
    iteration: int,
    prompt_ids: Optional[Tensor] = None,
    prompt_state: Optional[PromptTable] = None,
) -> Credit:
    """prompt_ids [P]: each group's dataset row, with the run's per-prompt state (prompt_state.py), where a part
    reads it (estimator spo, a prompt sampler): the estimator reads and updates it, and it records each group."""
    P, L = tree.leaves.shape
    K = leaf_values.shape[-1]
    reads = ESTIMATORS.get(cfg.advantage.estimator.name).reads  # the one dispatch on what the estimator reads
    base = dict(
        rewards=leaf_values.view(P, L, K),
        reward_weights=[r.weight for r in cfg.rewards],
        reward_names=[r.label for r in cfg.rewards],
        head_nan_policy=cfg.advantage.head_nan_policy,
    )
    if prompt_state is not None:  # only then: a run without it builds the batch it always built
        base.update(prompt_ids=prompt_ids, prompt_state=prompt_state, step=iteration + 1)
    real = tree.leaves >= 0  # False: a slot that a smaller ragged group lacks (Knapsack RL, ragged.py)
    ragged = not bool(real.all())
    if ragged:  # its chain is all -1, so no edge takes its advantage; statistics and the prompt table skip it
        base["valid"] = real
    N = tree.num_nodes
    if reads == "tree":  # leaf rewards fused up the tree: one advantage per node
        structure, local = tree.tree_structure()
        result = compute_advantages(GroupBatch(**base, tree=structure), cfg.advantage)
        node_adv = result.advantages[tree.prompt, local].float()
        node_w = result.sample_weight[tree.prompt, local].float()
        adv_metrics = result.metrics
    else:  # one advantage per (chain, step): scatter onto the nodes the edges lead into
        adv, weight, edge_nodes, adv_metrics = CHAIN_CREDIT[reads](tree, base, probe_values, preferences, cfg)
        node_adv = torch.full((N,), float("nan"))
        node_w = torch.zeros(N)
        ok = edge_nodes >= 0
        node_adv[edge_nodes[ok]] = adv[ok].float()
        node_w[edge_nodes[ok]] = weight[ok].float()

    keep = tree.edge_trained & (node_w > 0) & torch.isfinite(node_adv)
    metrics = dict(adv_metrics)
    if reads == "tree":
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
        samples = replace(tree, leaves=tree.leaves[real].unsqueeze(1)) if ragged else tree  # real samples only
        keep &= per_sample_steps(samples, cfg.edges.per_sample_fraction, gen, cfg.edges.exclude_last)
    if cfg.edges.drop_zero_advantage and cfg.loss.kl.coef == 0:
        keep &= node_adv != 0
    if cfg.edges.group_filter is not None:  # Edit-R1's mask: saturated groups' edges leave the loss (group_filter.py)
        groups = saturated_group_mask(GroupBatch(**base), cfg)
        keep &= groups[tree.prompt]
        metrics.update(filter_metrics(groups))
    edges = keep.nonzero().squeeze(1)
    metrics["edges/trained"] = float(edges.numel())
    metrics["edges/available"] = float(tree.edge_trained.sum())
    return Credit(edges, node_adv[edges], node_w[edges], metrics, node_adv)
