"""Run a rollout plan on a model adapter; re-score edges under new weights.

States at the same step are advanced in one batched forward whatever the plan's shape (chains, trees,
side branches), so no per-node Python loop runs in the hot path. Every denoiser forward is counted,
split by grad / no grad, in rows that actually went through the network (CFG doubles them).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any, Literal, Optional, Sequence

import torch
from pydantic import Field
from torch import Tensor

from flowgrpo.core.config import NON_NEGATIVE, POSITIVE, PROBABILITY, PartSpec, StrictModel, bound_settings

from .plans import RolloutPlan
from .rollout import RolloutTree
from .schedules import SIGMA_GRIDS, compress_tail, ddim_schedule, flow_schedule
from .steps import KERNELS, StepOutput, rescore, step

# The kernels' and grids' settings, checked when the config loads (the functions check them only at the first step)
bound_settings(KERNELS, "flow_sde", a=NON_NEGATIVE)
bound_settings(KERNELS, "dance_sde", eta=NON_NEGATIVE)
bound_settings(KERNELS, "cps", a=PROBABILITY)
bound_settings(KERNELS, "ddim", eta=PROBABILITY)
bound_settings(SIGMA_GRIDS, "time_shift", shift=POSITIVE)


class SamplerConfig(StrictModel):
    num_steps: int = Field(10, ge=1)
    sde_kernel: PartSpec = Field(default_factory=lambda: PartSpec(name="flow_sde"))
    guidance_scale: float = Field(4.5, ge=0)  # CFG: uncond + scale (cond - uncond); 1 = the conditional alone
    negative_prompt: str = ""  # the unconditional branch of CFG
    cfg_mode: Literal["full", "none"] = "full"  # sampling; training re-scores with `train_cfg_mode`
    train_cfg_mode: Literal["full", "detach_uncond", "none"] = "detach_uncond"
    shift: Optional[float] = Field(None, gt=0)  # None: the adapter's scheduler config decides
    # Sigma grid by name: "scheduler" (the model's diffusers scheduler) or {name: time_shift, shift: 3}
    # (DanceGRPO's sd3_time_shift over linspace(1, 0, n+1), which the FLUX GRPO papers use).
    schedule: PartSpec = Field(default_factory=lambda: PartSpec(name="scheduler"))
    height: int = Field(32, ge=8)  # pixels; the adapter checks its own multiple and maximum
    width: int = Field(32, ge=8)
    share_noise: bool = False  # same initial noise for every root of a prompt
    # With share_noise: the roots of a prompt share one noise in blocks of this many (None = all of them). The
    # Flow-GRPO-Fast pipeline draws one noise per call and repeats it to a mini-group (mini_num_image_per_prompt);
    # a group is num_image_per_prompt // mini of those calls, each with its own noise.
    share_noise_size: Optional[int] = Field(None, ge=1)
    keep_means: bool = False  # store the rollout mean of each edge (GRPO-Guard)
    # What the images are decoded from: "final" = the last state; "last_x0" = the last step's clean
    # estimate x_{T-1} - sigma_{T-1} v, without that step's noise (DanceGRPO, Pref-GRPO, BranchGRPO,
    # MixGRPO's drop_last_sample decode pred_original). Edges and log-probs are unchanged.
    decode: Literal["final", "last_x0"] = "final"
    # Rollouts under torch.inference_mode (no autograd bookkeeping at all, a little faster than no_grad);
    # prompts and the schedule are prepared outside it and the returned tree is copied out of it, so
    # re-scoring with grad works on it unchanged.
    inference_mode: bool = False

    def model_post_init(self, __context: Any) -> None:
        self.sde_kernel.check(KERNELS, "sde_kernel")
        self.schedule.check(SIGMA_GRIDS, "schedule")
        if self.share_noise_size is not None and not self.share_noise:
            raise ValueError("sampler: share_noise_size sets the blocks that share a noise; it needs share_noise: true")
        if self.schedule.name != "scheduler" and self.shift is not None:
            raise ValueError(
                f"sampler: shift applies to the 'scheduler' grid; schedule '{self.schedule.name}' "
                "sets its own (e.g. schedule: {name: time_shift, shift: 3.0})"
            )


Sizes = int | Sequence[int]  # final states per prompt: one number, or one per prompt (ragged groups)


@dataclass
class Counters:
    nfe_nograd: float = 0.0
    nfe_grad: float = 0.0

    def as_dict(self) -> dict[str, float]:
        return {"nfe_nograd": self.nfe_nograd, "nfe_grad": self.nfe_grad}


@dataclass
class _Nodes:
    """Growing node storage, appended one batch (one step) at a time."""

    parent: list = field(default_factory=list)
    prompt: list = field(default_factory=list)
    states: list = field(default_factory=list)
    logp: list = field(default_factory=list)
    std: list = field(default_factory=list)
    mean: list = field(default_factory=list)
    # per batch: (rows, depth, continues, step index, sde, trained), one value for all its rows; the columns
    # are filled once in `column` (a torch.full per batch and column costs more than the step's maths)
    batches: list = field(default_factory=list)
    count: int = 0

    def add(
        self,
        parent: Tensor,
        depth: int,
        prompt: Tensor,
        states: Tensor,
        *,
        continues: bool = True,
        step_index: int = -1,
        sde: bool = False,
        trained: bool = False,
        out: Optional[StepOutput] = None,
        keep_mean: bool = False,
    ) -> Tensor:
        n = states.shape[0]
        ids = torch.arange(self.count, self.count + n)
        self.count += n
        self.parent.append(parent)
        self.prompt.append(prompt)
        self.states.append(states.detach())
        self.batches.append((n, depth, continues, step_index, sde, trained))
        self.logp.append(out.logp.detach().cpu() if out is not None else torch.full((n,), float("nan")))
        std = torch.zeros(n) if out is None else out.std.detach().float().reshape(-1).expand(n).cpu()
        self.std.append(std)
        if keep_mean:
            self.mean.append(out.mean.detach() if out is not None else torch.zeros_like(states, dtype=torch.float32))
        return ids

    def column(self, k: int, dtype: torch.dtype) -> Tensor:
        """Column k of `batches` (1 depth, 2 continues, 3 step index, 4 sde, 5 trained), one value per node."""
        rows = torch.tensor([b[0] for b in self.batches], dtype=torch.long)
        return torch.tensor([b[k] for b in self.batches], dtype=dtype).repeat_interleave(rows)


class Sampler:
    """Runs plans for one sampler config and counts the denoiser's work."""

    def __init__(self, config: Optional[SamplerConfig] = None):
        self.config = config or SamplerConfig()
        self.counters = Counters()
        # Grids already built, by everything they depend on: diffusers' scheduler is slow to construct and
        # every rollout of a run walks the same grid. Schedules are frozen; nothing writes into their tensors.
        self._schedules: dict[tuple, Any] = {}
        self._rows: Optional[tuple[Any, Tensor, Any]] = None  # (embeds, prompt ids, embeds.index(ids)) last used

    # --- kernels and schedule ------------------------------------------------------------------

    def schedule(self, adapter, plan: Optional[RolloutPlan] = None):
        """The sigma (or DDIM) grid of `num_steps`; with a plan that compresses its tail, the rebuilt grid."""
        cfg = self.config
        tail = None if plan is None or plan.tail is None else (plan.tail.start, plan.tail.points)
        sc = adapter.scheduler_config
        dynamic = (
            adapter.prediction != "epsilon" and cfg.schedule.name == "scheduler" and sc.get("use_dynamic_shifting")
        )
        key = (
            adapter.prediction,
            repr(sorted(sc.items())),
            adapter.image_seq_len(cfg.height, cfg.width) if dynamic else None,
            cfg.num_steps,
            cfg.schedule.name,
            repr(sorted(cfg.schedule.settings.items())),
            cfg.shift,
            tail,
        )
        if key not in self._schedules:
            if len(self._schedules) >= 32:
                self._schedules.clear()
            self._schedules[key] = self._build_schedule(adapter, plan)
        return self._schedules[key]

    def _build_schedule(self, adapter, plan: Optional[RolloutPlan]):
        base = self._grid(adapter)
        if plan is None or plan.tail is None:
            return base
        if self.config.schedule.name != "time_shift":
            raise ValueError(
                f"plan '{plan.name}' rebuilds its tail on the time_shift grid: set sampler.schedule "
                "{name: time_shift, shift: ...} (MixGRPO's sd3_time_shift grid)"
            )
        settings = {"shift": 3.0, "integer_timesteps": False, **self.config.schedule.settings}
        return compress_tail(base, plan.tail.start, plan.tail.points, **settings)

    def _grid(self, adapter):
        cfg = self.config
        grid = cfg.schedule.name
        if adapter.prediction == "epsilon":
            if grid != "scheduler":
                raise ValueError(
                    f"sampler.schedule '{grid}' is a flow-matching grid; {adapter.family} is an "
                    "epsilon-prediction model (use schedule: scheduler)"
                )
            return ddim_schedule(cfg.num_steps, config=adapter.scheduler_config)
        if grid != "scheduler":
            return SIGMA_GRIDS.get(grid).fn(cfg.num_steps, **cfg.schedule.settings)
        own = getattr(adapter, "flow_grid", None)  # a family whose pipeline walks its own grid (FLUX.2, Z-Image)
        if own is not None and (schedule := own(cfg.num_steps, cfg.height, cfg.width, cfg.shift)) is not None:
            return schedule
        if adapter.scheduler_config.get("use_dynamic_shifting"):  # FLUX, Kontext: shift from the token count
            return flow_schedule(  # the pipelines' own sigmas linspace(1, 1/n, n), not set_timesteps(n)'s spacing
                cfg.num_steps,
                image_seq_len=adapter.image_seq_len(cfg.height, cfg.width),
                spacing="uniform",
                config=adapter.scheduler_config,
            )
        return flow_schedule(cfg.num_steps, shift=cfg.shift, config=adapter.scheduler_config)

    def _kernel(self, adapter, sde: bool, solver: str) -> tuple[str, dict]:
        if adapter.prediction == "epsilon":
            if solver == "dpm2m" and not sde:
                raise ValueError("solver 'dpm2m' is for flow-matching models; epsilon models use ddim (eta 0)")
            if sde:
                if self.config.sde_kernel.name != "ddim":
                    raise ValueError(
                        f"sde_kernel '{self.config.sde_kernel.name}' is a flow-matching kernel; "
                        f"epsilon-prediction models ({adapter.family}) need 'ddim'"
                    )
                return "ddim", self.config.sde_kernel.settings
            return "ddim", {"eta": 0.0}
        if sde:
            if self.config.sde_kernel.name == "ddim":
                raise ValueError(f"sde_kernel 'ddim' needs an epsilon-prediction model, not {adapter.family}")
            return self.config.sde_kernel.name, self.config.sde_kernel.settings
        return solver if solver == "dpm2m" else "ode", {}

    def _time(self, adapter, schedule, steps: int | Tensor) -> Tensor:
        """What the adapter takes as time: sigma (flow matching) or the integer timestep (DDIM). An int step (every
        row of a rollout batch at the same step) gives one value (no per-step index tensor)."""
        if adapter.prediction == "epsilon":
            return schedule.timesteps[steps]
        return schedule.sigmas[steps] if schedule.model_sigmas is None else schedule.model_sigmas[steps]

    def _forward(
        self, adapter, x: Tensor, steps: int | Tensor, schedule, embeds, prompt: Tensor, cfg_mode: str, grad: bool
    ) -> Tensor:
        rows = x.shape[0] * (1 if cfg_mode == "none" else 2)
        if grad:
            self.counters.nfe_grad += rows
        else:
            self.counters.nfe_nograd += rows
        t = self._time(adapter, schedule, steps).to(x.device).expand(x.shape[0])  # one value per row, as a view
        return adapter.model_output(x, t, self._index(embeds, prompt), self.config.guidance_scale, cfg_mode)

    def _index(self, embeds, prompt: Tensor):
        """embeds.index(prompt), reused while a rollout keeps the same rows (every step between branchings)."""
        last = self._rows
        if last is not None and last[0] is embeds and last[1] is prompt:
            return last[2]
        rows = embeds.index(prompt)
        self._rows = (embeds, prompt, rows)
        return rows

    # --- rollout ---------------------------------------------------------------------------------

    @torch.no_grad()
    def run(
        self,
        adapter,
        prompts: list[str],
        plan: RolloutPlan,
        group_size: Sizes,
        generator: Optional[torch.Generator] = None,
    ) -> RolloutTree:
        """Sample `group_size` final states per prompt by `plan`; returns every node and edge.

        A list gives each prompt its own number (ragged groups, Knapsack RL): only those states are sampled, and
        the tree's `leaves` [P, largest] hold -1 in the slots of the smaller groups (no node, never denoised)."""
        if not self.config.inference_mode:
            return self._run(adapter, prompts, plan, group_size, generator)
        adapter.encode_prompts(
            prompts, self.config.negative_prompt
        )  # cached outside inference mode: training reuses these rows
        with torch.inference_mode():
            tree = self._run(adapter, prompts, plan, group_size, generator)
        return _out_of_inference_mode(tree)

    def _noise_blocks(self, plan: RolloutPlan, group_size: int) -> tuple[RolloutPlan, int, int]:
        """(the plan, roots per prompt, roots per initial noise) of groups of `group_size`."""
        cfg = self.config
        leaves = plan.leaves_per_root
        if group_size % leaves:
            raise ValueError(
                f"plan '{plan.name}' gives {leaves} final states per root; group_size {group_size} "
                f"must be a multiple of it"
            )
        roots = group_size // leaves
        block = 1  # roots per initial noise
        if cfg.share_noise:
            block = min(cfg.share_noise_size or roots, roots)  # fewer roots than a block (eval): one noise
            if roots % block:
                raise ValueError(
                    f"share_noise_size {block} must divide the {roots} roots per prompt (group_size "
                    f"{group_size} / {leaves} final states per root)"
                )
        if plan.shared_prefix and block > 1:
            first = plan.first_stochastic_step
            if first is not None and plan.steps[first].sde:  # a shared prefix is a tree split at the first SDE step
                steps = list(plan.steps)
                steps[first] = replace(steps[first], branch=steps[first].branch * block)
                plan, roots, block = replace(plan, steps=tuple(steps)), roots // block, 1
        return plan, roots, block

    def _run(self, adapter, prompts: list[str], plan: RolloutPlan, group_size: Sizes, generator) -> RolloutTree:
        cfg = self.config
        if plan.grid_steps != cfg.num_steps:
            raise ValueError(f"plan has {plan.grid_steps} steps but the sampler is set to num_steps={cfg.num_steps}")
        if isinstance(group_size, int):
            plan, roots, block = self._noise_blocks(plan, group_size)
        else:  # ragged groups (Knapsack RL): each prompt its own number of roots, one noise each
            roots, block = _ragged_roots([int(n) for n in group_size], len(prompts), plan, cfg.share_noise), 1
        before = self.counters.as_dict()
        with torch.inference_mode(False):  # the schedule is stored on the tree and used with grad later
            schedule = self.schedule(adapter, plan)
        embeds = adapter.encode_prompts(prompts, self.config.negative_prompt)
        device = next(adapter.denoiser.parameters()).device
        shape = adapter.latent_shape(cfg.height, cfg.width)
        P = len(prompts)
        draw = lambda n: torch.randn((n, *shape), generator=generator).to(device)  # noqa: E731
        n_roots = P * roots if isinstance(roots, int) else int(roots.sum())
        x = draw(n_roots // block).repeat_interleave(block, 0)
        frontier_prompt = torch.arange(P).repeat_interleave(roots)
        nodes = _Nodes()
        frontier = nodes.add(
            torch.full((x.shape[0],), -1, dtype=torch.long), 0, frontier_prompt, x, keep_mean=cfg.keep_means
        )
        probe_ids, probe_latents = [], []
        state, last_x0 = None, None
        for i, sp in enumerate(plan.steps):
            v = self._forward(adapter, x, i, schedule, embeds, frontier_prompt, cfg.cfg_mode, grad=False)
            if i in plan.probe_depths:
                probe_ids.append(frontier)
                probe_latents.append(self._probe(adapter, x, v, i, schedule, embeds, frontier_prompt, plan))
            if sp.side_branches:
                k = sp.side_branches
                name, settings = self._kernel(adapter, True, "euler")
                xs, vs = x.repeat_interleave(k, 0), v.repeat_interleave(k, 0)
                out = step(name, xs, vs, schedule, i, generator=generator, **settings)
                side_prompt = frontier_prompt.repeat_interleave(k)
                side = nodes.add(
                    frontier.repeat_interleave(k),
                    i + 1,
                    side_prompt,
                    out.x_next,
                    continues=False,
                    step_index=i,
                    sde=True,
                    trained=sp.trained,
                    out=out,
                    keep_mean=cfg.keep_means,
                )
                probe_ids.append(side)
                probe_latents.append(
                    self.complete(adapter, out.x_next, i + 1, schedule, embeds, side_prompt, plan.probe_solver)
                )
            name, settings = self._kernel(adapter, sp.sde, sp.solver)
            if sp.branch > 1:
                x, v = x.repeat_interleave(sp.branch, 0), v.repeat_interleave(sp.branch, 0)
                frontier = frontier.repeat_interleave(sp.branch)
                frontier_prompt = frontier_prompt.repeat_interleave(sp.branch)
                state = None
            if sp.sde:
                out = step(name, x, v, schedule, i, generator=generator, noise_scale=sp.noise_scale, **settings)
            else:
                out = self._deterministic_step(name, settings, x, v, schedule, i, state)
            x, state = out.x_next, out.state
            frontier = nodes.add(
                frontier,
                i + 1,
                frontier_prompt,
                x,
                step_index=i,
                sde=sp.sde,
                trained=sp.trained and sp.sde,
                out=out,
                keep_mean=cfg.keep_means,
            )
            if cfg.decode == "last_x0" and i == plan.num_steps - 1:
                last_x0 = out.x0_hat.to(x.dtype)
        self._rows = None
        tree = self._assemble(nodes, frontier, frontier_prompt, P, plan.num_steps, probe_ids, probe_latents)
        if last_x0 is not None:
            order = torch.argsort(frontier_prompt, stable=True)  # the leaves' layout (_assemble)
            tree.leaf_images = _by_prompt(last_x0[order], frontier_prompt[order], P)
        tree.schedule = schedule
        after = self.counters.as_dict()
        tree.counters = {k: after[k] - before[k] for k in after}
        return tree

    def complete(
        self, adapter, x: Tensor, start: int, schedule, embeds, prompt: Tensor, solver: str = "euler"
    ) -> Tensor:
        """Deterministic completion from step `start` to x0, batched over every row."""
        state = None
        for i in range(start, schedule.num_steps):
            v = self._forward(
                adapter,
                x,
                i,
                schedule,
                embeds,
                prompt,
                self.config.cfg_mode,
                grad=False,
            )
            name, settings = self._kernel(adapter, False, solver)
            out = self._deterministic_step(name, settings, x, v, schedule, i, state)
            x, state = out.x_next, out.state
        return x

    @staticmethod
    def _deterministic_step(name: str, settings: dict, x, v, schedule, i: int, state) -> StepOutput:
        """An ODE step; only the multistep solver takes (and returns) history."""
        if name == "dpm2m":
            return step(name, x, v, schedule, i, state=state)
        return step(name, x, v, schedule, i, **settings)

    def _probe(self, adapter, x, v, i, schedule, embeds, prompt, plan: RolloutPlan) -> Tensor:
        if plan.one_step_probes:  # VGPO: one Euler jump, from the model output already computed
            name, settings = self._kernel(adapter, False, "euler")
            return step(name, x, v, schedule, i, **settings).x0_hat.to(x.dtype)
        return self.complete(adapter, x, i, schedule, embeds, prompt, plan.probe_solver)

    @staticmethod
    def _assemble(
        nodes: _Nodes, frontier: Tensor, frontier_prompt: Tensor, P: int, T: int, probe_ids: list, probe_latents: list
    ) -> RolloutTree:
        cat = torch.cat
        order = torch.argsort(frontier_prompt, stable=True)
        leaves = _by_prompt(frontier[order], frontier_prompt[order], P)
        return RolloutTree(
            parent=cat(nodes.parent),
            depth=nodes.column(1, torch.long),
            prompt=cat(nodes.prompt),
            continues=nodes.column(2, torch.bool),
            states=cat(nodes.states),
            edge_step=nodes.column(3, torch.long),
            edge_sde=nodes.column(4, torch.bool),
            edge_trained=nodes.column(5, torch.bool),
            edge_logp=cat(nodes.logp),
            edge_std=cat(nodes.std),
            edge_mean=cat(nodes.mean) if nodes.mean else None,
            leaves=leaves,
            probe_nodes=cat(probe_ids) if probe_ids else torch.empty(0, dtype=torch.long),
            probe_latents=cat(probe_latents) if probe_latents else None,
            num_steps=T,
        )

    # --- training-time re-scoring ----------------------------------------------------------------

    def rescore(
        self, adapter, tree: RolloutTree, edges: Tensor, prompts: list[str], cfg_mode: Optional[str] = None
    ) -> StepOutput:
        """Log-prob and mean of the stored transitions `edges` under the adapter's current weights.

        Runs with grad (call it inside torch.no_grad() for the reference or old policy). Edges of
        different steps are re-scored in one batch.
        """
        if not bool(tree.edge_sde[edges].all()):
            raise ValueError("only stochastic edges have a log-prob; select edges with tree.edge_sde")
        steps = tree.edge_step[edges]
        x = tree.states[tree.parent[edges]]
        x_next = tree.states[edges]
        embeds = adapter.encode_prompts(prompts, self.config.negative_prompt)
        mode = cfg_mode or self.config.train_cfg_mode
        if self.config.cfg_mode == "none":
            mode = "none"
        v = self._forward(
            adapter, x, steps, tree.schedule, embeds, tree.prompt[edges], mode, grad=torch.is_grad_enabled()
        )
        name, settings = self._kernel(adapter, True, "euler")
        return rescore(name, x, x_next, v, tree.schedule, steps.to(x.device), **settings)


def _ragged_roots(sizes: list[int], num_prompts: int, plan: RolloutPlan, share_noise: bool) -> Tensor:
    leaves = plan.leaves_per_root  # roots per prompt of ragged groups of `sizes` final states
    if len(sizes) != num_prompts or any(n < 1 or n % leaves for n in sizes):
        raise ValueError(
            f"ragged groups: one size per prompt ({num_prompts}), each >= 1 and a multiple of plan "
            f"'{plan.name}''s {leaves} final states per root, got {sizes}"
        )
    if share_noise:
        raise ValueError("ragged groups draw one noise per root: they go without sampler.share_noise")
    return torch.tensor(sizes) // leaves


def _by_prompt(rows: Tensor, prompt: Tensor, P: int) -> Tensor:
    """Rows sorted by prompt as [P, L, ...]; smaller groups of ragged ones pad with -1 (node ids) or 0 (latents)."""
    counts = torch.bincount(prompt, minlength=P)
    if bool((counts == counts[0]).all()):
        return rows.view(P, -1, *rows.shape[1:])
    slot = torch.arange(prompt.numel()) - (torch.cumsum(counts, 0) - counts)[prompt]
    out = rows.new_full((P, int(counts.max()), *rows.shape[1:]), -1 if rows.dtype == torch.long else 0)
    out[prompt.to(out.device), slot.to(out.device)] = rows
    return out


def _out_of_inference_mode(tree: RolloutTree) -> RolloutTree:
    """A copy of `tree` whose tensors are ordinary tensors (inference tensors cannot enter autograd)."""
    copy = lambda t: t.clone() if isinstance(t, Tensor) else t  # noqa: E731
    return replace(tree, **{f.name: copy(getattr(tree, f.name)) for f in fields(tree)})
