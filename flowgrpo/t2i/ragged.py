"""Ragged groups in the image trainer: Knapsack RL's per-prompt rollout budgets (`prompt_sampling: knapsack`).

Each step's P prompts get budgets N_i (sum = P x group_size) from the run's prompt table by the text trainer's
allocation (flowgrpo.core.knapsack.knapsack_budgets). The sampler rolls out exactly N_i images of prompt i
(`Sampler.run` with one size per prompt); the tree's `leaves` [P, max N_i] hold -1 in the slots the smaller groups
lack. Those slots have no node: nothing is denoised, decoded or scored for them. Their rewards are NaN and their
`GroupBatch.valid` is False (credit.assign_credit), so every group statistic and the prompt table read the real
rows only, and an edge is trained only if a real sample's chain leads through it.

Several processes (`layout`): every rank computes the same budgets from the same table (each rank observes the
gathered global batch, so the tables stay identical; `check_same_budgets` compares them anyway), rolls out its own
rollout batches with their own budgets, and pads each batch's tree with unused roots to the largest batch's node
count and its groups to the widest group, so batch c owns nodes [c x M, (c + 1) x M) as the plain layout has it
(`Distributed.localize`). Each batch's structure, log-probs and rewards are gathered: the global tree and rewards
hold the one-process run's real rows in the same order, so credit and advantages are the one-process run's.

What cannot take ragged groups is refused when the config loads (`ragged_problem`): methods other than grpo,
wrappers, estimators that read more than the final images, plans with branches or probes, pairwise rewards, split
groups, shared noise and group_filter.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Optional, Sequence

import torch
from torch import Tensor

from ..core.advantages import ESTIMATORS
from ..core.knapsack import check_budget_settings, knapsack_budgets
from ..core.prompt_state import BUDGET_SAMPLERS, PROMPT_SAMPLERS, PromptTable
from .methods import WRAPPERS


def budget_settings(cfg: Any) -> Optional[dict[str, Any]]:
    """The budget sampler's settings (low, high, unknown), or None when the prompt sampler sets no budgets."""
    sampling = cfg.prompt_sampling
    if sampling.name not in BUDGET_SAMPLERS:
        return None
    return {**PROMPT_SAMPLERS.get(sampling.name).settings, **sampling.settings}  # the sampler's defaults filled in


def ragged_problem(cfg: Any) -> Optional[str]:
    """Why this recipe cannot run with a budget sampler (None: it can, or no budget sampler is set)."""
    settings = budget_settings(cfg)
    if settings is None:
        return None
    try:
        check_budget_settings(cfg.group_size, **settings)
    except ValueError as err:
        return str(err)
    if problem := _combination_problem(cfg):
        return (
            f"prompt_sampling '{cfg.prompt_sampling.name}' with method '{cfg.method}': ragged groups (each prompt "
            f"its own number of images) cannot take {problem}"
        )
    return None


def _combination_problem(cfg: Any) -> Optional[str]:
    if cfg.method != "grpo":
        return f"method '{cfg.method}' (method grpo takes them)"
    if wrappers := [w for w in WRAPPERS.names() if getattr(cfg, w).enabled]:
        return f"{wrappers[0]}.enabled (it reads whole groups)"
    est = cfg.advantage.estimator.name
    needs = ESTIMATORS.get(est)
    if needs.reads != "final" or needs.plan:
        return f"advantage estimator '{est}' (it reads more than each group's final images)"
    if problem := _plan_problem(cfg):
        return problem
    if cfg.rollout_split > 1:
        return f"rollout_split {cfg.rollout_split} (set 1)"
    if cfg.sampler.share_noise:
        return "sampler.share_noise (noise blocks of a fixed group; set it false)"
    if cfg.edges.group_filter is not None:
        return "edges.group_filter (Edit-R1's mask)"
    if "pairwise" in _reward_kinds(cfg):
        return "a pairwise reward (it compares a fixed group's images; use pointwise rewards)"
    return None


def _plan_problem(cfg: Any) -> Optional[str]:
    from pipelines.plans import build_plan

    try:
        plan = build_plan(cfg.plan.name, cfg.sampler.num_steps, 0, cfg.seed, **cfg.plan.settings)
    except (ValueError, TypeError):
        return None  # the plan's own check names the problem
    if plan.leaves_per_root != 1 or plan.probe_depths or any(s.side_branches for s in plan.steps):
        return f"plan '{cfg.plan.name}' (it branches or probes chains; use full_sde or window)"
    return None


def _reward_kinds(cfg: Any) -> list[str]:
    from reward_models import get_entry

    try:
        return [get_entry(r.name).kind for r in cfg.rewards]
    except KeyError:
        return []  # the config's own check names the unknown scorer


def step_budgets(
    table: PromptTable, rows: Sequence[int], cfg: Any, settings: dict[str, Any], record: dict[str, Any], dist: Any
) -> list[int]:
    """The step's budget of each prompt row (the same on a resume and on every rank: a pure function of the
    checkpointed table, which every rank updates from the same gathered rewards)."""
    budgets = knapsack_budgets(table, rows, cfg.prompts_per_iteration * cfg.group_size, **settings)
    check_same_budgets(budgets, dist)
    record.update({"knapsack/budget_min": min(budgets), "knapsack/budget_max": max(budgets)})
    return budgets


def real_leaves(tree: Any) -> Tensor:
    """[P, L] bool: the slots of `tree.leaves` that hold a sample (False: padding of a ragged group)."""
    return tree.leaves >= 0


def join(trees: list[Any], width: int) -> Any:
    """concat_trees of ragged rollouts: every tree's leaves (and leaf images) padded to `width` slots, padding -1."""
    from pipelines.rollout import concat_trees

    return concat_trees(
        [
            replace(
                t,
                leaves=_pad_slots(t.leaves, width, -1),
                leaf_images=None if t.leaf_images is None else _pad_slots(t.leaf_images, width, 0),
            )
            for t in trees
        ]
    )


def _pad_slots(t: Tensor, width: int, fill: float) -> Tensor:
    """[P, L, ...] -> [P, width, ...], `fill` in the added slots."""
    extra = width - t.shape[1]
    return torch.cat([t, t.new_full((t.shape[0], extra, *t.shape[2:]), fill)], 1) if extra else t


def spread(values: Tensor, real: Tensor, fill: float = float("nan")) -> Tensor:
    """Rows of the real samples [n, ...] laid out on the slots [P * L, ...], `fill` in the padding (rewards: NaN,
    never scored; the rollout grid's images: 0, black)."""
    out = values.new_full((real.numel(), *values.shape[1:]), fill)
    out[real.reshape(-1)] = values
    return out


def check_same_budgets(budgets: list[int], dist: Any) -> None:
    """Every rank must roll out the same global layout: a rank whose table drifted would pair other rewards with
    other chains. One small all-reduce per step (each budget's largest and smallest over the ranks); a mismatch
    stops the run here rather than mistraining it."""
    if not dist.active:
        return
    import torch.distributed as tdist

    mine = torch.tensor(budgets, dtype=torch.float64)
    both = torch.cat([mine, -mine])
    tdist.all_reduce(both, op=tdist.ReduceOp.MAX)
    if not (torch.equal(both[: len(budgets)], mine) and torch.equal(-both[len(budgets) :], mine)):
        raise RuntimeError(
            f"knapsack budgets differ between ranks (rank {dist.rank}: {budgets}): their prompt tables drifted"
        )


def layout(
    trees: list[Any], values: list[Tensor], width: int, dist: Any, n_chunks: int
) -> tuple[Any, Any, Tensor, int]:
    """This rank's ragged rollout batches and their real samples' rewards ([n_c, K] each) -> (this rank's tree, the
    global tree of every rank's batches, the global rewards [P x width, K] (NaN: padding), nodes per batch).

    One process: the batches joined. Several: each batch padded to the largest batch's node count (unused roots,
    never trained) so that local and global node ids map as `Distributed.localize` maps them, and gathered."""
    if not dist.active:
        local = join(trees, width)
        return local, local, spread(torch.cat(values), real_leaves(local)), local.num_nodes // len(trees)
    nodes = dist.most(max(t.num_nodes for t in trees))  # the largest batch of the step, on any rank
    padded = [_pad_nodes(t, nodes) for t in trees]
    local = join(padded, width)
    leaves = [_pad_slots(t.leaves, width, -1) for t in padded]  # each batch's, node ids its own
    ints = [torch.stack([getattr(t, k).long() for k in _INT_FIELDS], 1).cpu() for t in padded]
    floats = [torch.stack([t.edge_logp.float(), t.edge_std.float()], 1).cpu() for t in padded]
    rewards = [spread(v, leaf >= 0) for v, leaf in zip(values, leaves)]
    g_ints, g_floats, g_leaves = (
        dist.gather_chunks(x, n_chunks).view(n_chunks, -1, *x[0].shape[1:]) for x in (ints, floats, leaves)
    )
    empty = torch.empty(nodes, 0)
    skeletons = [
        replace(
            trees[0],
            **{k: g_ints[c, :, i].to(getattr(trees[0], k).dtype) for i, k in enumerate(_INT_FIELDS)},
            states=empty, edge_logp=g_floats[c, :, 0], edge_std=g_floats[c, :, 1], edge_mean=None,
            leaves=g_leaves[c], probe_nodes=g_ints.new_empty(0), probe_latents=None, leaf_images=None,
        )
        for c in range(n_chunks)
    ]  # fmt: skip
    return local, join(skeletons, width), dist.gather_chunks(rewards, n_chunks), nodes


# a tree's per-node structure, gathered as one long tensor per batch (gloo gathers no bool)
_INT_FIELDS = ("parent", "depth", "prompt", "continues", "edge_step", "edge_sde", "edge_trained")


def _pad_nodes(tree: Any, nodes: int) -> Any:
    """`tree` with unused roots appended up to `nodes` nodes: no leaf, no trained edge, zero states (their memory is
    the price of the fixed layout: at most the largest batch's chains less this batch's)."""
    extra = nodes - tree.num_nodes
    if extra == 0:
        return tree

    def pad(t: Tensor, fill: Any) -> Tensor:
        return torch.cat([t, t.new_full((extra, *t.shape[1:]), fill)])

    return replace(
        tree,
        parent=pad(tree.parent, -1), depth=pad(tree.depth, 0), prompt=pad(tree.prompt, 0),
        continues=pad(tree.continues, True), states=pad(tree.states, 0), edge_step=pad(tree.edge_step, -1),
        edge_sde=pad(tree.edge_sde, False), edge_trained=pad(tree.edge_trained, False),
        edge_logp=pad(tree.edge_logp, float("nan")), edge_std=pad(tree.edge_std, 0),
        edge_mean=None if tree.edge_mean is None else pad(tree.edge_mean, 0),
    )  # fmt: skip
