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


def closed_form(cfg, iteration: int, record: dict[str, Any] | None = None) -> dict[str, Any]:
    """Rows through the denoiser, backward passes, reward calls and images of one iteration, from the plan.

    W_d = nodes at depth d of one root's tree (W_0 = 1, W_{i+1} = W_i * branch_i); L = leaves per root;
    c = 2 rows per state under CFG (sampling: cfg_mode, training: train_cfg_mode), else 1.
      chain (full_sde, window, ode_only): T no-grad per image; K grad (K trained steps)
      tree:          sum_{d<T} W_d / L no-grad (children of a split share their parent's forward);
                     trained edges per leaf sum_{i trained} W_{i+1} / L grad (minus pruned edges)
      branch_points: T + k * sum_p (T - 1 - p) no-grad (spine + each side child ODE-completed); k * |points| grad
      probes:        T + sum_{d in probes} (T - d) no-grad (one-step probes: T); |window| grad
      nft:           + n_t old-policy rows no-grad and n_t grad per image, n_t = max(1, floor(T * timestep_fraction))
    The update of a method that trains on clean samples instead of edges (flowgrpo/t2i/{awm,sft,dpo,
    gardo_methods}.py, closed forms in update_counts below) replaces the edge part. Edges with advantage exactly
    0 are dropped by the trainer; this count assumes there are none (and no tied rewards, no NaN rewards).
    `record` (the iteration's metrics) is read only for GARDO's gated samples, a data-dependent count.
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
    grad, backward, policy_update, extra_calls = 0.0, 0, True, 0
    epochs, minis, micro = cfg.train.inner_epochs, cfg.train.mini_batches, cfg.train.micro_batch_size
    if cfg.adversarial.enabled and (iteration + 1) % cfg.adversarial.d_times != 0:
        policy_update = False  # a discriminator iteration: the policy does not train
        formula += "; discriminator iteration: no policy update"
    elif cfg.method in SAMPLE_METHODS:
        u = update_counts(cfg, T, P, G, record)
        grad, backward, extra_calls = u["grad"], u["backward"], u.get("extra_reward_calls", 0)
        nograd += u["nograd"]
        formula += "; " + u["formula"]
        simple = simple and u["simple"]
    elif cfg.method in ("grpo", "grpo_gardo"):
        grad = c_train * edges * epochs
        if cfg.loss.kl.coef:
            nograd += grad  # the reference re-scores every trained edge
        backward = epochs * sum(math.ceil(m / micro) for m in _chunk_sizes(edges, minis))
        if cfg.method == "grpo_gardo":
            ref, text, ok = _gardo_grpo_reference(cfg, P * G, edges_per_root, record)
            nograd += ref
            formula += "; " + text
            simple = simple and ok
    else:
        grad, backward, simple = math.nan, math.nan, False
        formula += f"; no closed form for method '{cfg.method}'"
    return {
        "plan": plan.name,
        "images": images,
        "nfe_nograd": nograd,
        "nfe_grad": grad,
        "rollout_nfe_nograd": c_roll * P * per_prompt if per_prompt is not None else math.nan,
        "backward_passes": backward,
        "reward_calls": (P // cfg.rollout_prompts) * len(cfg.rewards) + extra_calls,
        "edges_trained": edges if policy_update and cfg.method in ("grpo", "grpo_gardo") else 0,
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


# --- methods that train on clean samples (forward-process terms) instead of re-scored edges ----------------------

SAMPLE_METHODS = ("nft", "nft_gardo", "awm", "sft", "diffusion_dpo", "reward_backprop")


def _micro_batches(n: int, cfg) -> int:
    """Micro-batches of n rows over the mini-batches of one pass (torch.chunk, then split by micro_batch_size)."""
    return sum(math.ceil(m / cfg.train.micro_batch_size) for m in _chunk_sizes(n, cfg.train.mini_batches))


def _gated(cfg, samples: int, record: dict[str, Any] | None) -> int | None:
    """GARDO's gated samples of the iteration (data-dependent: the top uncertainty fraction, ties excluded), read
    from the record's gardo/gated_fraction; every sample without uncertainty rewards; None without a record."""
    if not cfg.gardo.uncertainty_rewards:
        return samples
    if record is None or record.get("gardo/gated_fraction") is None:
        return None
    return round(float(record["gardo/gated_fraction"]) * samples)


def _gardo_grpo_reference(cfg, samples: int, steps: int, record: dict[str, Any] | None) -> tuple[float, str, bool]:
    """grpo_gardo's reference re-scores (no grad): the trained edges of the gated samples (K = `steps` per chain);
    with `ungated: all` a micro-batch without a gated edge re-scores all its edges."""
    g = cfg.gardo
    if not g.kl_coef:
        return 0, "GARDO KL off", True
    n = _gated(cfg, samples, record)
    if n is None:
        return math.nan, "GARDO reference rows need the record's gated fraction", False
    one_micro = cfg.train.mini_batches == 1 and samples * steps <= cfg.train.micro_batch_size
    if g.ungated == "all" and n == 0:
        rows, ok = samples * steps, True
    else:
        rows, ok = n * steps, g.ungated == "none" or one_micro or n == samples
    epochs = cfg.train.inner_epochs
    return epochs * rows, f"GARDO reference: {n} gated samples x {steps} edges no-grad", ok


def update_counts(cfg, T: int, P: int, G: int, record: dict[str, Any] | None = None) -> dict[str, Any]:
    """Denoiser rows without / with grad and backward passes of the update of a method in SAMPLE_METHODS, for P
    prompts x G samples of T steps. E = train.inner_epochs; a term = one micro-batch at one training time (one
    backward); m(n) = micro-batches of n rows over the mini-batches of a pass.
      nft:           n_t = max(1, floor(T * nft.timestep_fraction)) terms per micro-batch; grad n_t E PG; no-grad
                     the old policy's n_t E PG (+ the same again for the base-model KL); backward n_t E m(PG)
      nft_gardo:     nft's, + the gated reference rows n_gated n_t E (every row of a micro-batch without a gated
                     one under `ungated: all`)
      awm / sft:     S kept samples (awm: all PG; sft top_k: P min(k, G), rwr: PG), tau = timesteps per sample:
                     grad tau E S; backward tau E m(S); no-grad (velocity penalties: kl_coef, awm's ema_kl_coef)
                     x grad rows, + awm's old log-probs: every term after the first mini-batch, tau (E S - S_1)
      diffusion_dpo: M pairs (online best_worst: P; margin 0: P G (G - 1) / 2; offline: pairs_per_iteration),
                     tau = dpo.timesteps: grad 2 tau E M, no-grad (reference) 2 tau E M, backward tau E m(M)
      reward_backprop: grad K n E PG (K: draft_k k, refl 1, alignprop drawn per micro-batch; n: draft_lv's noise
                       draws of the last step, K = 1, else 1), backward E m(PG), and n E m(PG) calls of every
                       scorer in the update
    """
    method, E = cfg.method, cfg.train.inner_epochs
    images, simple = P * G, True
    if method in ("nft", "nft_gardo"):
        n_t = max(1, int(T * cfg.nft.timestep_fraction))
        grad = n_t * E * images
        nograd = grad * (2 if cfg.nft.kl_coef else 1)
        backward = n_t * E * _micro_batches(images, cfg)
        formula = f"NFT n_t = {n_t}: + {n_t} old-policy no-grad, {n_t} grad per image"
        if method == "nft_gardo" and cfg.gardo.kl_coef:
            n = _gated(cfg, images, record)
            one_micro = cfg.train.mini_batches == 1 and images <= cfg.train.micro_batch_size
            if n is None:
                ref, simple = math.nan, False
            elif n == 0:
                ref = grad if cfg.gardo.ungated == "all" else 0
            else:
                ref, simple = n * n_t * E, one_micro or n == images
            nograd += ref
            formula += f"; GARDO reference: {n} gated samples x {n_t} times no-grad"
            if n == 0 and cfg.gardo.ungated == "all":
                formula += " (none gated: every row, `ungated: all`)"
        return {"grad": grad, "nograd": nograd, "backward": backward, "formula": formula, "simple": simple}
    if method in ("awm", "sft"):
        s = getattr(cfg, method)
        kept = P * min(s.top_k, G) if method == "sft" and s.mode == "top_k" else images
        tau = s.timesteps
        grad = tau * E * kept
        penalties = int(bool(s.kl_coef)) + int(method == "awm" and bool(cfg.awm.ema_kl_coef))
        nograd = penalties * grad
        formula = f"{kept} kept samples x {tau} times: grad {grad}"
        if penalties:
            formula += f"; {penalties} velocity penalt{'y' if penalties == 1 else 'ies'} no-grad {penalties * grad}"
        if method == "awm":
            first = (_chunk_sizes(kept, cfg.train.mini_batches) or [0])[0]
            old = tau * (E * kept - first)
            nograd += old
            formula += f"; old log-probs after the first mini-batch: {old} no-grad"
        return {
            "grad": grad,
            "nograd": nograd,
            "backward": tau * E * _micro_batches(kept, cfg),
            "formula": formula,
            "simple": True,
        }
    if method == "diffusion_dpo":
        d = cfg.dpo
        if d.data:
            pairs, where = d.pairs_per_iteration, "offline"
        elif d.pairs == "best_worst":
            pairs, where = P, "best vs worst of each group"
        elif d.margin == 0:
            pairs, where = P * G * (G - 1) // 2, "every ordered pair of distinct rewards"
        elif record is not None and record.get("dpo/pairs") is not None:
            pairs, where = int(record["dpo/pairs"]), "pairs above the margin (from the record)"
        else:
            pairs, where, simple = 0, "pairs above the margin need the record", False
        tau = d.timesteps
        rows = 2 * tau * E * pairs
        return {
            "grad": rows,
            "nograd": rows,
            "backward": tau * E * _micro_batches(pairs, cfg),
            "formula": f"DPO {pairs} pairs ({where}) x {tau} times: 2 grad + 2 reference no-grad rows each",
            "simple": simple,
        }
    if method == "reward_backprop":
        return _reward_backprop_counts(cfg, T, images, record)
    raise ValueError(f"update_counts: method {method!r} is not one of {SAMPLE_METHODS}")


def _reward_backprop_counts(cfg, T: int, images: int, record: dict[str, Any] | None) -> dict[str, Any]:
    """reward_backprop (flowgrpo/t2i/reward_backprop.py): per micro-batch of B samples, K steps with grad from the
    stored state before the window (draft_k: K = k; refl: 1; alignprop: K drawn per micro-batch, the random input
    read from the method's seeded draw; draft_lv: K = 1 from the re-noised final sample, n = lv_samples times),
    then one call of each scorer on each decoded result. Grad B K n (x2 under
    CFG; checkpointing recomputes them in backward, which the hooks see and the counters do not), no no-grad rows
    beyond the rollout, one backward per micro-batch."""
    s, E = cfg.reward_backprop, cfg.train.inner_epochs
    c = 1 if cfg.sampler.cfg_mode == "none" else 2
    micros = _micro_batches(images, cfg) * E
    n = s.lv_samples if s.form == "draft_lv" else 1  # draft_lv: the last step once per noise draw, each scored
    if s.form in ("draft_k", "refl", "draft_lv"):
        K = s.k if s.form == "draft_k" else 1
        grad, text = c * K * n * E * images, f"{s.form}: K = {K} grad steps per sample"
        if s.form == "draft_lv":
            text += f" x n = {n} noise draws of the last step"
    else:
        from flowgrpo.t2i.reward_backprop import grad_rows

        grad = grad_rows(cfg, record["iteration"] - 1, images) if record else math.nan
        text = "alignprop: K drawn per micro-batch (the method's seeded draw): grad sum_micro B K"
    return {
        "grad": grad,
        "nograd": 0,
        "backward": micros,
        "formula": f"{text}; + {micros * n} x {len(cfg.rewards)} scorer calls in the update",
        "simple": not math.isnan(grad),
        "extra_reward_calls": micros * n * len(cfg.rewards),
    }
