"""What a recipe's iteration should cost, worked out from its plan: denoiser rows, backward passes, reward calls."""

from __future__ import annotations

import math
from typing import Any


def _chunk_sizes(n: int, chunks: int) -> list[int]:
    """Sizes of torch.arange(n).chunk(chunks)."""
    if n == 0:
        return []
    size = math.ceil(n / chunks)
    return [min(size, n - s) for s in range(0, n, size)]


def closed_form(cfg, iteration: int) -> dict[str, Any]:
    """Rows through the denoiser, backward passes, reward calls and images of one iteration, from the plan.

    W_d = nodes at depth d of one root's tree (W_0 = 1, W_{i+1} = W_i * branch_i); L = leaves per root;
    c = 2 rows per state under CFG (sampling: cfg_mode, training: train_cfg_mode), else 1.
      chain (full_sde, window, ode_only): T no-grad per image; K grad (K trained steps)
      tree:          sum_{d<T} W_d / L no-grad (children of a split share their parent's forward);
                     trained edges per leaf sum_{i trained} W_{i+1} / L grad (minus pruned edges)
      branch_points: T + k * sum_p (T - 1 - p) no-grad (spine + each side child ODE-completed); k * |points| grad
      probes:        T + sum_{d in probes} (T - d) no-grad (one-step probes: T); |window| grad
      nft:           + n_t old-policy rows no-grad and n_t grad per image, n_t = max(1, floor(T * timestep_fraction))
    Edges with advantage exactly 0 are dropped by the trainer; this count assumes there are none.
    """
    from pipelines.plans import build_plan

    plan = build_plan(cfg.plan.name, cfg.sampler.num_steps, iteration, cfg.seed, **cfg.plan.settings)
    s, T = cfg.sampler, plan.num_steps
    P, G = cfg.prompts_per_iteration, cfg.group_size
    c_roll = 1 if s.cfg_mode == "none" else 2
    c_train = 1 if s.cfg_mode == "none" or s.train_cfg_mode == "none" else 2
    L = plan.leaves_per_root
    roots = G // L
    W = [1]
    for st in plan.steps:
        W.append(W[-1] * st.branch)
    trained_steps = [i for i, st in enumerate(plan.steps) if st.trained]
    simple = True

    if plan.name == "tree":
        per_root = sum(W[:T])
        edges_per_root = sum(W[i + 1] for i in trained_steps)
        formula = (
            f"no-grad sum_(d<T) W_d / L = {per_root}/{L}; grad trained edges per leaf "
            f"sum_(i trained) W_(i+1) / L = {edges_per_root}/{L}"
        )
    elif plan.name == "branch_points":
        per_root = T + sum(st.side_branches * (T - 1 - i) for i, st in enumerate(plan.steps))
        edges_per_root = sum(plan.steps[i].side_branches for i in trained_steps)
        points = [i for i, st in enumerate(plan.steps) if st.side_branches]
        k = max((st.side_branches for st in plan.steps), default=0)
        formula = f"no-grad T + k * sum_p (T-1-p) = {T} + {k}*{sum(T - 1 - p for p in points)}; grad k*|points| = {edges_per_root}"
    elif plan.name == "probes":
        probe_rows = 0 if plan.one_step_probes else sum(T - d for d in plan.probe_depths)
        per_root = T + probe_rows
        edges_per_root = len(trained_steps)
        formula = (
            f"no-grad T + sum_d (T-d) = {T} + {probe_rows}"
            if not plan.one_step_probes
            else f"no-grad T = {T} (one-step probes reuse the step's output)"
        ) + f"; grad |window| = {edges_per_root}"
    else:  # a chain: full_sde, window, ode_only
        per_root = T
        edges_per_root = len(trained_steps)
        formula = f"no-grad T = {T}; grad trained steps = {edges_per_root}"

    per_prompt = roots * per_root
    first = plan.first_stochastic_step
    if plan.shared_prefix and s.share_noise and roots > 1 and first is not None and plan.steps[first].sde:
        # steps 0..first run once per prompt, then the group fans out (a split at the first SDE step)
        per_prompt = (first + 1) + roots * (T - first - 1) if L == 1 else None
        formula += f"; shared prefix: steps 0..{first} once per prompt"
        simple = per_prompt is not None
    nograd = c_roll * P * per_prompt if per_prompt is not None else math.nan

    edges = P * roots * edges_per_root
    e = cfg.edges
    pruned = None
    if plan.name == "tree" and (e.depth_pruning or e.width_pruning):
        pruned = _pruned_edges(cfg, plan, W, iteration)
        if pruned is None:
            simple = False
        else:
            edges -= P * roots * pruned
            formula += f" minus {pruned}/{L} pruned"
            if e.width_pruning and not e.depth_pruning:
                n = T - 1 - max(i for i, st in enumerate(plan.steps) if st.branch > 1)
                formula += (
                    f" (width pruning keeps ceil({e.width_pruning:g} x {n}) = {math.ceil(n * e.width_pruning)} "
                    f"of the {n} last-layer edges of each leaf chain)"
                )

    images = P * G
    grad, backward, policy_update = 0.0, 0, True
    epochs, minis, micro = cfg.train.inner_epochs, cfg.train.mini_batches, cfg.train.micro_batch_size
    if cfg.adversarial.enabled and (iteration + 1) % cfg.adversarial.d_times != 0:
        policy_update = False  # a discriminator iteration: the policy does not train
        formula += "; discriminator iteration: no policy update"
    elif cfg.method == "nft":
        n_t = max(1, int(T * cfg.nft.timestep_fraction))
        grad = n_t * epochs * images
        nograd += grad * (2 if cfg.nft.kl_coef else 1)
        backward = epochs * sum(math.ceil(m / micro) for m in _chunk_sizes(images, minis)) * n_t
        formula += f"; NFT n_t = {n_t}: + {n_t} old-policy no-grad, {n_t} grad per image"
    else:
        grad = c_train * edges * epochs
        if cfg.loss.kl.coef:
            nograd += grad  # the reference re-scores every trained edge
        backward = epochs * sum(math.ceil(m / micro) for m in _chunk_sizes(edges, minis))
    return {
        "plan": plan.name,
        "images": images,
        "nfe_nograd": nograd,
        "nfe_grad": grad,
        "rollout_nfe_nograd": c_roll * P * per_prompt if per_prompt is not None else math.nan,
        "backward_passes": backward,
        "reward_calls": (P // cfg.rollout_prompts) * len(cfg.rewards),
        "edges_trained": edges if policy_update and cfg.method != "nft" else 0,
        "simple": simple,
        "formula": formula,
        "pruned_edges_per_root": pruned,
    }


def _pruned_edges(cfg, plan, W: list[int], iteration: int) -> int | None:
    """BranchGRPO pruning, per root; None where the closed form is not simple (both kinds at once,
    width pruning over untrained last-layer steps, mode 2 across roots)."""
    e = cfg.edges
    trained = {i for i, st in enumerate(plan.steps) if st.trained}
    if e.depth_pruning and e.width_pruning:
        return None
    if e.depth_pruning:
        shift = 0
        if e.depth_pruning_slide_every:
            shift = max(min(iteration // e.depth_pruning_slide_every, min(e.depth_pruning)), 0)
        return sum(W[d] for d in {d - shift for d in e.depth_pruning} if 1 <= d <= plan.num_steps and d - 1 in trained)
    split = max((i for i, st in enumerate(plan.steps) if st.branch > 1), default=-1)
    after = list(range(split + 1, plan.num_steps))
    if split < 0 or any(i not in trained for i in after) or e.width_pruning_mode != 1:
        return None
    n = len(after)  # last-layer edges of one leaf chain; the top ceil(n * ratio) by advantage are kept
    return W[-1] * (n - math.ceil(n * e.width_pruning))
