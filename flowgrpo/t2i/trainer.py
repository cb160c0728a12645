"""The text-to-image trainer: rollout and scoring. Every recipe in configs/ is a config over this one trainer.

One training step (the shared loop, flowgrpo/run/loop.py, runs it and owns checkpoints, metrics, progress):

    P prompts -> rollout batches of `rollout_prompts` prompts, each by the step's plan, sampled by the
                 method's rollout policy
              -> (worker threads) decode final images + probe completions -> scorers -> rewards
                 (scoring batch b overlaps the rollout of batch b + 1)
              -> the method plug-in (flowgrpo/t2i/methods.py) turns the scored rollout into optimizer steps:
                 grpo (grpo.py), nft (nft.py), wrapped by Adv-GRPO's discriminator alternation (adversarial.py)
              -> metrics, grids; the loop then steps the LR schedule, writes metrics.jsonl / tensorboard,
                 evaluates (ODE, EMA weights) and checkpoints
"""

from __future__ import annotations

import functools
import math
import resource
import time
from dataclasses import replace
from typing import Any

import torch

from ..checkpoint import Checkpoint, load_into
from ..config import ConfigError
from ..core.prompt_state import build_prompt_state, prompt_policy
from ..scaling.sharding import full_state
from ..run.clock import seconds_since
from ..run import CheckpointParts, OptimizerStep, PromptSampler, RunLoop, build_ema, build_optimizer
from . import adversarial, awm, dpo, gardo_methods, grpo, nft, reward_backprop, sft  # noqa: F401  (register the methods)
from . import artifacts, edit_data, ragged
from .config import T2IConfig, is_video_family
from .data import PromptSet, load_prompt_set
from .hacking_monitor import HackingMonitor
from .objectives import reads_old_means
from .methods import ImageContext, ScoredRollout, build_method, method_class
from .model import build_policy, reference_context, resolution_problem_before_load, shard_policy
from .reward_stage import RewardStage


class T2ITrainer(RunLoop):
    unit = "iteration"
    resume_free = frozenset({"iterations", "stop_after", "resume", "progress", "checkpoint", "output_dir", "eval",
                             "artifacts", "monitor"})  # fmt: skip

    def __init__(self, config: T2IConfig):
        super().__init__(config, config.iterations)
        self.cfg: T2IConfig = config
        cfg = config
        self.progress_label = f"t2i-{cfg.method}"
        self.eval_every = cfg.eval.every
        self.video = is_video_family(cfg.model.family)  # decode gives clips [B, F, 3, H, W]: video scorers only
        if problem := resolution_problem_before_load(cfg.model, cfg.sampler.height, cfg.sampler.width):
            raise ConfigError(f"sampler.height / sampler.width: {problem}")
        sources = edit_data.ImageSpec(cfg.sampler.height, cfg.sampler.width, cfg.data.image_resize)  # edit rows
        self.prompts = load_prompt_set(cfg.data.prompts, cfg.data.path, images=sources)
        self.eval_prompts = load_prompt_set(
            cfg.data.eval_prompts, cfg.data.eval_path, "data (eval)", sources
        ) or self.prompts.take(list(range(min(4, len(self.prompts)))))
        edit_data.check_family([*self.prompts.prompts, *self.eval_prompts.prompts], cfg.model.family)
        try:
            self.rewards = RewardStage(cfg.rewards, cfg.reward_workers, video=self.video)
        except (ValueError, KeyError) as err:
            raise ConfigError(f"rewards: {err}") from None

        from pipelines.sampler import Sampler

        self.adapter, self.params = build_policy(cfg.model)
        try:
            self.adapter.check_resolution(cfg.sampler.height, cfg.sampler.width)
        except ValueError as err:
            raise ConfigError(f"sampler.height / sampler.width: {err}") from None
        method_class(cfg.method).prepare_model(self.adapter, cfg)
        self.sampler = Sampler(cfg.sampler.model_copy(update={"keep_means": reads_old_means(cfg.loss)}))
        self.reference = reference_context(self.adapter, cfg.model, method_class(cfg.method).needs_reference(cfg))
        if cfg.model.context_parallel.enabled:  # before FSDP2 wraps the hooked blocks (docs/scaling.md)
            self._enable_context_parallel()
        if self.dist.sharded:
            self.params = shard_policy(self.adapter, self.reference, self.dist)
        self.param_names = [n for n, p in self.adapter.denoiser.named_parameters() if p.requires_grad]
        built = build_optimizer(self.params, cfg.optim, cfg.iterations, fused=False)
        self.optimizer, self.scheduler = built.optimizer, built.scheduler
        self.ema = build_ema(self.params, cfg.ema)
        self.optimizer_step = OptimizerStep(
            self.params, self.optimizer, cfg.optim.max_grad_norm, self.dist, self.ema, guard=self.guard,
            module=self.adapter.denoiser, loss_scale=cfg.optim.loss_scale,
        )  # fmt: skip
        self.method = build_method(
            ImageContext(
                cfg=cfg, dist=self.dist, optimizer_step=self.optimizer_step, params=self.params,
                reference=self.reference, completed=lambda: self.iteration, adapter=self.adapter, sampler=self.sampler,
                ema=self.ema, scorer=self.rewards.scorer,
            )
        )  # fmt: skip
        self.prompt_sampler = PromptSampler(len(self.prompts), cfg.seed, cfg.data.shuffle)
        # per-prompt state across steps (SPO's tracker, Prompt Replay's buffer): None unless a part reads it
        sampling = cfg.prompt_sampling
        self.prompt_state = build_prompt_state(len(self.prompts), cfg.advantage.estimator.name, sampling.name)
        self.budgets = ragged.budget_settings(cfg)  # Knapsack RL: each prompt's own number of images (ragged.py)
        self.prompt_sampler.policy = prompt_policy(
            self.prompt_state, sampling.name, sampling.settings, cfg.seed, reads_budgets=self.budgets is not None
        )
        self.trackers: artifacts.Trackers | None = None  # rank 0 opens them with its first record
        self.monitor = HackingMonitor(cfg, self)  # reward-hacking monitor: gold scorers, image statistics, alarm
        if cfg.resume:
            self.resume()

    def _enable_context_parallel(self) -> None:
        """diffusers' context parallelism on the denoiser (and a full fine-tune's frozen KL reference, same mesh);
        the batch split becomes per group of `ulysses x ring` ranks (Distributed.use_context_parallel)."""
        from ..scaling.context_parallel import ContextParallelError, enable_context_parallel
        from .model import FrozenCopyReference

        cp = self.cfg.model.context_parallel
        self.dist.use_context_parallel(cp)
        try:
            mesh = enable_context_parallel(self.adapter.denoiser, cp)
            if isinstance(self.reference, FrozenCopyReference):
                enable_context_parallel(self.reference.frozen, cp, mesh)
        except ContextParallelError as err:
            raise ConfigError(str(err)) from None

    # --- checkpoints -------------------------------------------------------------------------------

    def _named(self, params: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        return {n: p.detach() for n, p in zip(self.param_names, params)}

    def checkpoint_parts(self) -> CheckpointParts:
        parts = CheckpointParts(tensors={"policy": self._named(self.params)}, optimizers={"policy": self.optimizer_step.checkpointed},
                                state={"prompts": self.prompt_sampler.state_dict(),
                                       "optimizer_steps": self.optimizer_step.total})  # fmt: skip
        if self.ema is not None:
            parts.tensors["ema"] = self._named(self.ema.model.shadow_params)
            parts.state["ema_optimization_step"] = self.ema.model.optimization_step
            parts.state["ema_clock"] = self.ema.clock
        if self.prompt_state is not None:  # float64 tensors: restored exactly
            parts.tensors["prompt_state"] = self.prompt_state.state_dict()
        self.method.checkpoint_parts(parts)
        parts.state["monitor"] = self.monitor.state_dict()
        return parts

    def restore(self, ckpt: Checkpoint) -> None:
        load_into(self.adapter.denoiser, ckpt.tensors["policy"])
        if self.ema is not None:
            with torch.no_grad():
                for p, name in zip(self.ema.model.shadow_params, self.param_names):
                    p.copy_(ckpt.tensors["ema"][name])
            self.ema.model.optimization_step = ckpt.state["ema_optimization_step"]
            self.ema.clock = ckpt.state.get("ema_clock", ckpt.state["optimizer_steps"])
        self.method.restore(ckpt)
        self.monitor.load_state_dict(ckpt.state.get("monitor"))
        self.prompt_sampler.load_state_dict(ckpt.state["prompts"])
        if self.prompt_state is not None:
            if "prompt_state" not in ckpt.tensors:
                raise ConfigError("resume: the checkpoint has no prompt state (written without a part that reads one)")
            self.prompt_state.load_state_dict(ckpt.tensors["prompt_state"])
        self.optimizer_step.total = ckpt.state["optimizer_steps"]

    # --- rollout and rewards -----------------------------------------------------------------------

    def _collect(
        self, record: dict[str, Any], batch_prompts: PromptSet, plan: Any, keep_images: bool, budgets: Any = None
    ) -> ScoredRollout:
        """Roll out this rank's batches and score them on worker threads; `budgets`: each prompt's number of images
        (ragged groups, ragged.py), else group_size each."""
        from pipelines.rollout import concat_trees

        cfg, split = self.cfg, self.cfg.rollout_split
        G = cfg.group_size // split  # images of a rollout batch per prompt: a part of the group when split
        Pc = cfg.rollout_prompts
        n_chunks = cfg.prompts_per_iteration // Pc * split  # batch c: prompts of block c // split, part c % split
        mine = self.dist.my_chunks(n_chunks)
        trees, futures = [], []
        nfe0 = self.sampler.counters.as_dict()
        t0 = time.perf_counter()
        for c in mine:
            gen = torch.Generator().manual_seed(((cfg.seed * 1_000_003 + self.iteration) * 10_007 + c) % 2**63)
            b = c // split
            prompts = batch_prompts.prompts[b * Pc : (b + 1) * Pc]
            meta = batch_prompts.metadata[b * Pc : (b + 1) * Pc]
            sizes = G if budgets is None else budgets[b * Pc : (b + 1) * Pc]
            with torch.no_grad(), self.method.rollout_policy() as policy:
                tree = self.sampler.run(policy, prompts, plan, sizes, generator=gen)
            real = ragged.real_leaves(tree)  # all True but for the padding of ragged groups: never decoded
            lat = [tree.leaf_latents().flatten(0, 1)]
            if budgets is not None:
                lat = [lat[0][real.reshape(-1).to(lat[0].device)]]
            rows = real.nonzero()[:, 0].tolist()
            if tree.probe_latents is not None:
                lat.append(tree.probe_latents)
                rows += tree.prompt[tree.probe_nodes].tolist()
            row_prompts = [prompts[r] for r in rows]
            futures.append(
                self.rewards.submit(
                    functools.partial(self.adapter.decode, prompts=row_prompts),  # wan2.2_i2v decodes its first frame
                    torch.cat(lat),
                    row_prompts,
                    [meta[r] for r in rows],
                    G,
                    int(real.sum()),
                    keep_images,
                    inline=c == mine[-1],  # nothing left to overlap it with: the caller would only wait
                )
            )
            trees.append(tree)
        record["time_rollout_s"] = seconds_since(t0, self.adapter.device)
        t1 = time.perf_counter()
        scored = [f.result() for f in futures]  # a scorer error (server down after retries) stops the run here
        record["time_reward_wait_s"] = time.perf_counter() - t1
        record["time_reward_s"] = sum(s.seconds for s in scored)
        record["reward_calls"] = sum(s.calls for s in scored)
        nfe1 = self.sampler.counters.as_dict()
        record["rollout_nfe_nograd"] = nfe1["nfe_nograd"] - nfe0["nfe_nograd"]
        for s in scored:
            for k, v in s.extras.items():
                record[k] = record.get(k, 0.0) + v / len(scored)
        n_leaf = [int(ragged.real_leaves(t).sum()) for t in trees]

        def gather(parts: list) -> Any:
            return self.dist.gather_chunks(parts, n_chunks)

        leaf_values, probe_values = (
            [s.values[:n] for s, n in zip(scored, n_leaf)],
            [s.values[n:] for s, n in zip(scored, n_leaf)],
        )
        if budgets is not None:  # ragged groups (ragged.py): batches padded to one layout on every rank, gathered
            local, global_tree, values, per_chunk = ragged.layout(trees, leaf_values, max(budgets), self.dist, n_chunks)
        else:
            local, values = concat_trees(trees), gather(leaf_values)
            global_tree, per_chunk = local, local.num_nodes // len(mine)
            if self.dist.active:  # the same structure for every batch: a global tree without states for credit
                logps = gather([t.edge_logp for t in trees]).view(n_chunks, -1)
                skeleton = [
                    replace(
                        trees[0],
                        states=torch.empty(trees[0].num_nodes, 0),
                        probe_latents=None,
                        edge_mean=None,
                        edge_logp=logps[c],
                        leaf_images=None,
                    )
                    for c in range(n_chunks)
                ]
                global_tree = concat_trees(skeleton)
        if split > 1:  # the parts of a group are consecutive batches: one group of group_size leaves again
            global_tree = replace(
                global_tree, prompt=global_tree.prompt // split, leaves=global_tree.leaves.reshape(-1, cfg.group_size)
            )
        return ScoredRollout(
            tree=local, global_tree=global_tree, leaf_values=values,
            probe_values=gather(probe_values) if trees[0].probe_latents is not None else None,
            preferences=gather([s.preferences for s in scored]),
            images=torch.cat([s.images for s in scored]) if keep_images else None,
            prompts=[p for c in mine for p in batch_prompts.prompts[c // split * Pc:(c // split + 1) * Pc]],
            batch_prompts=batch_prompts, nodes_per_chunk=per_chunk,
        )  # fmt: skip

    # --- one iteration -----------------------------------------------------------------------------

    def iterate(self, record: dict[str, Any]) -> None:
        from pipelines.plans import build_plan

        cfg = self.cfg
        self.monitor.baseline()  # once, before the first update
        nfe0 = self.sampler.counters.as_dict()
        rows = self.prompt_sampler.next(cfg.prompts_per_iteration)
        batch_prompts = self.prompts.take(rows)
        plan = build_plan(cfg.plan.name, cfg.sampler.num_steps, self.iteration, cfg.seed, **cfg.plan.settings)
        if restrict := getattr(self.adapter, "restrict_plan", None):  # Wan 2.2 A14B: the trained experts' steps
            plan = restrict(plan, self.sampler.schedule(self.adapter, plan))
        record["plan/trained_steps"] = len(plan.trained_steps)
        budgets = None
        if self.budgets is not None:  # Knapsack RL: the budgets of this step's prompts, from the prompt table
            budgets = ragged.step_budgets(self.prompt_state, rows, cfg, self.budgets, record, self.dist)
        keep = self._grid_due() or self.method.needs_images
        rollout = self._collect(record, batch_prompts, plan, keep, budgets)
        if budgets is None:
            leaf, probe = self.guard.rewards(record, rollout.leaf_values, rollout.probe_values)  # +-inf -> NaN, counted
        else:  # the real samples' rewards only: a padding slot's NaN is no missing reward
            real = ragged.real_leaves(rollout.global_tree)
            leaf, probe = self.guard.rewards(record, rollout.leaf_values[real.reshape(-1)], rollout.probe_values)
            leaf = ragged.spread(leaf, real)
        rollout = replace(rollout, leaf_values=leaf, probe_values=probe)
        if self.prompt_state is not None:  # the stateful parts: each group's dataset row and the run's prompt table
            rollout = replace(rollout, prompt_ids=torch.tensor(rows), prompt_state=self.prompt_state)

        t0 = time.perf_counter()
        self.optimizer_step.begin()
        self.method.update(rollout, record)
        record.update(self.optimizer_step.metrics())
        record["time_train_s"] = seconds_since(t0, self.adapter.device)

        nfe1 = self.sampler.counters.as_dict()
        record["nfe_nograd"] = nfe1["nfe_nograd"] - nfe0["nfe_nograd"]
        record["nfe_grad"] = nfe1["nfe_grad"] - nfe0["nfe_grad"]
        record.setdefault("backward_passes", 0)
        if self.dist.active:  # counts of the whole batch, not of this rank's share
            for key in ("nfe_nograd", "nfe_grad", "rollout_nfe_nograd", "reward_calls", "backward_passes",
                        "padding_passes"):  # fmt: skip
                if key in record:
                    record[key] = type(record[key])(self.dist.sum(record[key]))
        record["images"] = int(ragged.real_leaves(rollout.global_tree).sum())
        record["peak_memory_mb"] = _peak_memory_mb()
        if rollout.images is not None and self._grid_due():
            images, cols = rollout.images, cfg.group_size // cfg.rollout_split
            if budgets is not None:  # one row per group, black where a smaller group has no image
                images, cols = ragged.spread(images, ragged.real_leaves(rollout.tree), 0.0), max(budgets)
            artifacts.save_grid(
                images,
                self.out / "grids" / f"rollout_{self.iteration + 1:06d}.png",
                cols,
                cfg.artifacts.grid_images,
                prompts=rollout.prompts,  # edit prompts: source | edits
                fps=cfg.artifacts.video_fps,
            )
        self.monitor.step(record, self.iteration + 1)

    def _grid_due(self) -> bool:
        every = self.cfg.artifacts.grid_every
        return self.dist.is_main and bool(every) and (self.iteration + 1) % every == 0

    # --- evaluation, trackers, the end of the run --------------------------------------------------

    @torch.no_grad()
    def ode_images(
        self, prompts: list[str], steps: int, per_prompt: int, seed: int, use_ema: bool, **sampler: Any
    ) -> torch.Tensor:
        """Deterministic ODE samples of `prompts` from a fixed seed (EMA weights when kept and `use_ema`), decoded
        (images [N, 3, H, W]; a video family's clips [N, F, 3, H, W]): the held-out evaluation's and the hacking
        monitor's samples. `sampler`: further SamplerConfig changes."""
        from pipelines.plans import build_plan
        from pipelines.sampler import Sampler

        update = {"num_steps": steps, "keep_means": False, **sampler}
        with self._ema_weights(use_ema):
            tree = Sampler(self.cfg.sampler.model_copy(update=update)).run(
                self.adapter, prompts, build_plan("ode_only", steps), per_prompt, torch.Generator().manual_seed(seed)
            )
            rows = [p for p in prompts for _ in range(per_prompt)]  # wan2.2_i2v decodes each row's first frame
            return self.adapter.decode(tree.leaf_latents().flatten(0, 1), rows)

    @torch.no_grad()
    def evaluate(self, tag: str) -> dict[str, float]:
        """Deterministic ODE samples on the held-out prompts (EMA weights if kept); mean rewards."""
        cfg = self.cfg
        steps = cfg.eval.num_steps or cfg.sampler.num_steps
        images = self.ode_images(
            self.eval_prompts.prompts, steps, cfg.eval.images_per_prompt, cfg.eval.seed, cfg.eval.use_ema
        )
        if not self.dist.is_main:  # a sharded run's other ranks only took part in the forwards
            return {}
        n = cfg.eval.images_per_prompt
        rows = [p for p in range(len(self.eval_prompts)) for _ in range(n)]
        # a pairwise scorer needs at least two images per prompt to compare
        scorable = n > 1 or not self.rewards.has_pairwise
        scored = (
            self.rewards.score(
                images,
                [self.eval_prompts.prompts[r] for r in rows],
                [self.eval_prompts.metadata[r] for r in rows],
                n,
                len(rows),
            )
            if scorable
            else None
        )
        out: dict[str, float] = {}
        if scored is not None:
            for k, label in enumerate(self.rewards.labels):
                v = scored.values[:, k]
                out[f"eval/{label}/mean"] = (
                    float(v[torch.isfinite(v)].mean()) if bool(torch.isfinite(v).any()) else math.nan
                )
        if self.dist.is_main:  # a video family's grid is an MP4 / WebP beside the requested name
            grid = self.out / "grids" / f"eval_{tag}.png"
            fps = cfg.artifacts.video_fps
            written = artifacts.save_grid(images, grid, n, 64, prompts=self.eval_prompts.prompts, fps=fps)
            self._trackers().log_media(f"eval/{tag}", written, self.iteration, fps=fps)
        return out

    def _ema_weights(self, wanted: bool = True) -> Any:
        """Run with the EMA weights in place of the policy's (when kept and trained), restoring them after."""
        import contextlib

        use = wanted and self.ema is not None and self.optimizer_step.total > 0
        if not use:
            return contextlib.nullcontext()

        @contextlib.contextmanager
        def swapped() -> Any:
            self.ema.model.store(self.params)
            self.ema.model.copy_to(self.params)
            try:
                yield
            finally:
                self.ema.model.restore(self.params)

        return swapped()

    def _trackers(self) -> artifacts.Trackers:
        if self.trackers is None:
            self.trackers = artifacts.Trackers(self.out, self.cfg)
        return self.trackers

    def log_record(self, record: dict[str, Any], step: int) -> None:
        self._trackers().log(record, step)

    def progress_postfix(self, record: dict[str, Any]) -> dict[str, str]:
        """reward; kl_ref (KL to the reference model, where the loss computes one) and kl_old (the approximate KL
        between the sampling and the current policy: how far one update moved, not a distance to the reference).
        With a pairwise reward the weighted mean is no headline: a group's win rates average 0.5 by construction.
        The bar then shows each pointwise reward's mean and each pairwise reward's spread of win rates within a
        group (`<name>_sd`: how decisively the judge separates a group's images), plus unreadable verdicts."""
        labels, kinds = getattr(self.rewards, "labels", []), getattr(self.rewards, "kinds", [])
        if "pairwise" in kinds:
            out = {}
            for label, kind in zip(labels, kinds):
                if kind == "pairwise":
                    out[f"{label}_sd"] = f"{record.get(f'rewards/{label}/std', math.nan):.3f}"
                else:
                    out[label] = f"{record.get(f'rewards/{label}/mean', math.nan):.4f}"
            if record.get("win_rate/unreadable_pairs"):
                out["unreadable"] = f"{record['win_rate/unreadable_pairs']:g}"
        else:
            out = {"reward": f"{record.get('reward_mean', math.nan):.4f}"}
        if "kl/ref_mean" in record:
            out["kl_ref"] = f"{record['kl/ref_mean']:.1e}"
        if "approx_kl" in record:  # only where measured (NFT and discriminator iterations have none)
            out["kl_old"] = f"{record['approx_kl']:.1e}"
        return {**out, **self.monitor.postfix()}

    def stop_reason(self) -> str | None:
        return self.monitor.stop_reason()

    def finish(self, final_eval: dict[str, float]) -> None:
        (self.out / "eval_final.json").write_text(artifacts.to_json(final_eval))
        if self.cfg.artifacts.plot:
            artifacts.plot_rewards(self.out / "metrics.jsonl", self.out / "reward_curve.png")

    def save_final_model(self) -> None:
        """`checkpoint.save_final_model`: the LoRA in diffusers format (`lora/`; the EMA weights' in `lora_ema/`),
        a full fine-tune as a diffusers model folder (`transformer/` or `unet/`; `<name>_ema/`). A sharded run
        gathers the weights on rank 0 first (every rank calls this)."""
        import contextlib

        lora = self.cfg.model.finetune == "lora"
        name = "lora" if lora else self.adapter.denoiser_name
        exports = [(self.out / name, contextlib.nullcontext())]
        if self.ema is not None and self.optimizer_step.total > 0:
            exports.insert(0, (self.out / f"{name}_ema", self._ema_weights()))
        for folder, weights in exports:
            with weights:  # written inside: on one rank the gathered tensors are the live weights themselves
                state = full_state(self.adapter.denoiser, trainable_only=lora) if self.dist.sharded else None
                if self.dist.is_main:
                    (self.adapter.save_lora if lora else self.adapter.save_denoiser)(folder, state=state)

    def close(self) -> None:
        self.rewards.close()
        self.monitor.close()
        if self.trackers is not None:
            self.trackers.close()


def _peak_memory_mb() -> float:
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def train_t2i(config: T2IConfig) -> list[dict[str, Any]]:
    return T2ITrainer(config).train()
