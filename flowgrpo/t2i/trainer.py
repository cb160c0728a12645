"""The text-to-image RL loop, top to bottom. Every recipe in configs/ is a config over this one loop.

One iteration:

    P prompts -> rollout batches of `rollout_prompts` prompts, each by the iteration's plan
              -> (worker threads) decode final images + probe completions -> scorers -> rewards
                 (scoring batch b overlaps the rollout of batch b + 1)
    GRPO:     -> credit.assign_credit: flowgrpo.core advantages -> one advantage per trained edge
              -> inner_epochs x mini_batches optimizer steps; each mini-batch has ONE global loss
                 normaliser and accumulates micro-batches: re-score edges under the current weights
                 (sampler.rescore), flowgrpo.core.policy_loss, backward
    NFT:      -> advantages -> optimality r -> forward-process loss on the clean samples,
                 then the old policy's soft update
    Adv-GRPO: -> on discriminator iterations the discriminator trains instead of the policy
              -> clip grad norm, AdamW, LR schedule, EMA, metrics.jsonl / tensorboard, grids, checkpoint

The first micro-batch of a fresh rollout is scored by the weights that sampled it: its ratio must be
exactly 1. The deviation is measured every iteration and a loud warning names it when it is not.
"""

from __future__ import annotations

import logging
import math
import resource
import time
import warnings
from dataclasses import replace
from pathlib import Path
from typing import Any, Optional

import torch

from ..checkpoint import latest_checkpoint, load_checkpoint, load_into, save_checkpoint, check_resume_config
from ..config import ConfigError, dump_config
from ..core import LossNormalizer, compute_advantages
from ..core.contracts import GroupBatch
from ..metrics import LossMetrics, MetricsWriter, truncate_metrics
from ..process import prepare_process
from ..text.data import PromptSampler
from ..text.optim import lr_factor
from . import artifacts
from .config import T2IConfig
from .credit import assign_credit
from .data import load_prompt_set
from ..distributed import Distributed
from ..guards import NonFiniteGuard
from ..interrupts import StopRequest
from .model import active_lora, build_policy, reference_context
from .nft import nft_loss, old_decay, soft_update
from .objectives import EdgeObjective, edge_batch
from .rewards import RewardStage

log = logging.getLogger(__name__)
_RESUME_FREE = {"iterations", "stop_after", "resume", "progress", "checkpoint", "output_dir", "eval", "artifacts"}


class OnPolicyRatioWarning(UserWarning):
    """The first pass over a fresh rollout did not give ratio 1."""


class T2ITrainer:
    def __init__(self, config: T2IConfig):
        self.cfg = cfg = config
        prepare_process(cfg.seed, cfg.num_threads, cfg.deterministic)
        self.dist = Distributed.from_environment()
        self.out = Path(cfg.output_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        self.ckpt_dir = Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else self.out / "checkpoints"
        if not cfg.resume and latest_checkpoint(self.ckpt_dir) is not None:
            raise ConfigError(f"{self.ckpt_dir} holds checkpoints of an earlier run: set resume=true to continue "
                              "it, or choose another output_dir (nothing was overwritten)")

        self.prompts = load_prompt_set(cfg.data.prompts, cfg.data.path)
        self.eval_prompts = load_prompt_set(cfg.data.eval_prompts, cfg.data.eval_path, "data (eval)") \
            or self.prompts.take(list(range(min(4, len(self.prompts)))))
        chunks = cfg.prompts_per_iteration // cfg.rollout_prompts
        if chunks % self.dist.world_size:
            raise ConfigError(f"prompts_per_iteration / rollout_prompts = {chunks} rollout batches must divide "
                              f"evenly over {self.dist.world_size} processes")
        try:
            self.rewards = RewardStage(cfg.rewards, cfg.reward_workers)
        except (ValueError, KeyError) as err:
            raise ConfigError(f"rewards: {err}") from None
        if self.rewards.has_pairwise and cfg.advantage.estimator.name in ("turning_point", "value_anchored", "sibling"):
            raise ConfigError("a pairwise reward compares the final images of a group; the per-step estimator "
                              f"'{cfg.advantage.estimator.name}' needs pointwise probe rewards")

        from pipelines.sampler import Sampler

        self.adapter, self.params = build_policy(cfg.model)
        self.param_names = [n for n, p in self.adapter.denoiser.named_parameters() if p.requires_grad]
        sampler_cfg = cfg.sampler.model_copy(update={"keep_means": cfg.loss.ratio.name == "ratio_norm"})
        self.sampler = Sampler(sampler_cfg)
        needs_ref = (cfg.method == "grpo" and cfg.loss.kl.coef != 0) or (cfg.method == "nft" and cfg.nft.kl_coef != 0)
        self.reference = reference_context(self.adapter, cfg.model, needs_ref)
        self.objective = EdgeObjective(self.sampler, cfg.loss, self.reference)
        self.optimizer = torch.optim.AdamW(self.params, lr=cfg.optim.lr, betas=tuple(cfg.optim.betas),
                                           eps=cfg.optim.eps, weight_decay=cfg.optim.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: lr_factor(s, cfg.optim, max(cfg.iterations, 1)))
        self.ema = None
        if cfg.ema.enabled:
            from diffusers.training_utils import EMAModel

            self.ema = EMAModel(self.params, decay=cfg.ema.decay, min_decay=cfg.ema.decay)
        self.old_params: list[torch.nn.Parameter] = []
        if cfg.method == "nft":  # the old policy: a second LoRA adapter, starting equal to the policy
            self.adapter.add_lora(rank=cfg.model.lora.rank, alpha=cfg.model.lora.alpha, init=cfg.model.lora.init,
                                  target_modules=cfg.model.lora.target_modules, adapter_name="old")
            self.adapter.denoiser.set_adapter("default")
            for p in self.params:
                p.requires_grad_(True)
            self.old_params = self.adapter.lora_parameters("old")
            for p in self.old_params:
                p.requires_grad_(False)
            soft_update(self.old_params, self.params, 0.0)
        self.discriminator = None
        if cfg.adversarial.enabled:
            from .adversarial import Discriminator

            self.discriminator = Discriminator(self.rewards.scorer(cfg.adversarial.reward), cfg.adversarial,
                                               (cfg.sampler.height, cfg.sampler.width), cfg.seed)
        self.prompt_sampler = PromptSampler(len(self.prompts), cfg.seed, cfg.data.shuffle)
        self.guard = NonFiniteGuard(cfg.guards, "iteration")  # hardening: non-finite rewards / grads / weights
        self.iteration = 0
        self.optimizer_steps = 0
        self.resumed_from: Optional[Path] = None
        if cfg.resume:
            self._resume()

    # --- checkpoints -------------------------------------------------------------------------------

    def _named(self, params) -> dict[str, torch.Tensor]:
        return {n: p.detach() for n, p in zip(self.param_names, params)}

    def save(self) -> Path:
        tensors = {"policy": self._named(self.params)}
        optimizers = {"policy": self.optimizer}
        state: dict[str, Any] = {"prompts": self.prompt_sampler.state_dict(), "optimizer_steps": self.optimizer_steps}
        if self.ema is not None:
            tensors["ema"] = self._named(self.ema.shadow_params)
            state["ema_optimization_step"] = self.ema.optimization_step
        if self.old_params:
            tensors["nft_old"] = {f"{i}": p.detach() for i, p in enumerate(self.old_params)}
        if self.discriminator is not None:
            tensors["discriminator"] = self.discriminator.state_tensors()
            optimizers["discriminator"] = self.discriminator.optimizer
        return save_checkpoint(self.ckpt_dir, self.iteration, tensors=tensors, optimizers=optimizers,
                               schedulers={"lr": self.scheduler}, state=state,
                               config=self.cfg.model_dump(mode="json"), keep_last=self.cfg.checkpoint.keep_last)

    def _resume(self) -> None:
        path = latest_checkpoint(self.ckpt_dir, verify=True)  # hardening: skips (and names) damaged ones
        if path is None:
            log.info("resume: no checkpoint under %s; starting at iteration 0", self.ckpt_dir)
            return
        optimizers = {"policy": self.optimizer}
        if self.discriminator is not None:
            optimizers["discriminator"] = self.discriminator.optimizer
        ckpt = load_checkpoint(path, optimizers=optimizers, schedulers={"lr": self.scheduler})
        load_into(self.adapter.denoiser, ckpt.tensors["policy"])
        if self.ema is not None:
            with torch.no_grad():
                for p, name in zip(self.ema.shadow_params, self.param_names):
                    p.copy_(ckpt.tensors["ema"][name])
            self.ema.optimization_step = ckpt.state["ema_optimization_step"]
        if self.old_params:
            with torch.no_grad():
                for i, p in enumerate(self.old_params):
                    p.copy_(ckpt.tensors["nft_old"][f"{i}"])
        if self.discriminator is not None:
            self.discriminator.load_state_tensors(ckpt.tensors["discriminator"])
        self.prompt_sampler.load_state_dict(ckpt.state["prompts"])
        self.optimizer_steps = ckpt.state["optimizer_steps"]
        self.iteration = ckpt.step
        self.resumed_from = path
        check_resume_config(self.cfg.model_dump(mode="json"), ckpt.config, _RESUME_FREE)  # hardening: refuse
        log.info("resumed from %s (iteration %d)", path, self.iteration)

    # --- rollout and rewards -----------------------------------------------------------------------

    def _rollout_policy(self):
        """NFT samples with the old policy; GRPO with the current one."""
        import contextlib

        return active_lora(self.adapter, "old") if self.cfg.method == "nft" else contextlib.nullcontext(self.adapter)

    def _collect(self, record: dict, batch_prompts, plan, keep_images: bool):
        """Roll out this rank's batches and score them on worker threads; (tree, rewards...)."""
        from pipelines.rollout import concat_trees

        cfg, G = self.cfg, self.cfg.group_size
        Pc = cfg.rollout_prompts
        n_chunks = cfg.prompts_per_iteration // Pc
        mine = self.dist.my_chunks(n_chunks)
        trees, futures = [], []
        nfe0 = self.sampler.counters.as_dict()
        t0 = time.perf_counter()
        for c in mine:
            gen = torch.Generator().manual_seed(((cfg.seed * 1_000_003 + self.iteration) * 10_007 + c) % 2**63)
            prompts = batch_prompts.prompts[c * Pc:(c + 1) * Pc]
            meta = batch_prompts.metadata[c * Pc:(c + 1) * Pc]
            with torch.no_grad(), self._rollout_policy() as policy:
                tree = self.sampler.run(policy, prompts, plan, G, generator=gen)
            L = tree.leaves.shape[1]
            lat = [tree.leaf_latents().flatten(0, 1)]
            rows = [p for p in range(len(prompts)) for _ in range(L)]
            if tree.probe_latents is not None:
                lat.append(tree.probe_latents)
                rows += tree.prompt[tree.probe_nodes].tolist()
            futures.append(self.rewards.submit(self.adapter.decode, torch.cat(lat), [prompts[r] for r in rows],
                                               [meta[r] for r in rows], G, len(prompts) * L, keep_images))
            trees.append(tree)
        record["time_rollout_s"] = time.perf_counter() - t0
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
        n_leaf = trees[0].leaves.numel()
        gather = lambda parts: self.dist.gather_chunks(parts, n_chunks)  # noqa: E731
        leaf_values = gather([s.values[:n_leaf] for s in scored])
        probe_values = gather([s.values[n_leaf:] for s in scored]) if trees[0].probe_latents is not None else None
        prefs = gather([s.preferences for s in scored])
        images = torch.cat([s.images for s in scored]) if keep_images else None
        local = concat_trees(trees)
        if self.dist.active:  # the same structure for every batch: a global tree without states for credit
            logps = gather([t.edge_logp for t in trees]).view(n_chunks, -1)
            skeleton = [replace(trees[0], states=torch.empty(trees[0].num_nodes, 0), probe_latents=None,
                                edge_mean=None, edge_logp=logps[c]) for c in range(n_chunks)]
            global_tree = concat_trees(skeleton)
        else:
            global_tree = local
        local_prompts = [p for c in mine for p in batch_prompts.prompts[c * Pc:(c + 1) * Pc]]
        return local, global_tree, leaf_values, probe_values, prefs, images, local_prompts

    # --- updates -----------------------------------------------------------------------------------

    def _optimizer_step(self, record: dict, grad_norms: list) -> None:
        self.dist.all_reduce_grads(self.params)
        max_norm = self.cfg.optim.max_grad_norm if self.cfg.optim.max_grad_norm is not None else math.inf
        grad_norms.append(float(torch.nn.utils.clip_grad_norm_(self.params, max_norm)))
        if not self.guard.step_ok(record, grad_norms[-1]):  # hardening: never step on a NaN / inf gradient
            self.optimizer.zero_grad(set_to_none=True)
            return
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.optimizer_steps += 1
        if self.ema is not None and self.optimizer_steps % self.cfg.ema.update_every == 0:
            self.ema.step(self.params)

    def _order(self, n: int, epoch: int) -> torch.Tensor:
        if not self.cfg.train.shuffle:
            return torch.arange(n)
        g = torch.Generator().manual_seed(self.cfg.seed * 1_000_003 + self.iteration * 1009 + epoch)
        return torch.randperm(n, generator=g)

    def _grpo_update(self, record: dict, tree, credit, prompts: list[str], nodes_per_chunk: int) -> None:
        """Optimizer steps over the trained edges (global order; this rank back-propagates its own)."""
        cfg = self.cfg
        E = credit.edges.numel()
        metrics = LossMetrics()
        grad_norms: list[float] = []
        first_dev, measured, on_policy, backwards = 0.0, False, True, 0
        for epoch in range(cfg.train.inner_epochs):
            order = self._order(E, epoch)
            for mini in order.chunk(cfg.train.mini_batches) if E else []:
                mine, local_ids = self.dist.localize(credit.edges[mini], nodes_per_chunk)
                part = edge_batch(tree, local_ids, credit.advantages[mini][mine], credit.weights[mini][mine])
                norm = self.dist.reduce_normalizer(LossNormalizer.from_inputs(part.inputs()))
                for micro in torch.arange(local_ids.numel()).split(cfg.train.micro_batch_size):
                    rows = part.rows(micro)
                    out, logp = self.objective(self.adapter, tree, rows, prompts, norm)
                    if on_policy:
                        dev = ((logp.float().cpu() - rows.logp_old).exp() - 1).abs().max()
                        first_dev, measured = max(first_dev, float(dev)), True
                    out.loss.backward()
                    backwards += 1
                    metrics.add(out.metrics, micro.numel())
                self._optimizer_step(record, grad_norms)
                on_policy = False
        record.update(metrics.result(len(grad_norms)))
        record["backward_passes"] = backwards
        record["optimizer_steps"] = len(grad_norms)
        if grad_norms:
            record["grad_norm"] = sum(grad_norms) / len(grad_norms)
        self._check_ratio(record, first_dev, measured)

    def _check_ratio(self, record: dict, deviation: float, measured: bool) -> None:
        if not (self.cfg.ratio_check.enabled and measured):
            return
        record["check/first_pass_ratio_dev"] = deviation
        if deviation > self.cfg.ratio_check.tolerance:
            msg = (f"ON-POLICY CHECK FAILED at iteration {self.iteration + 1}: re-scoring the fresh rollout with "
                   f"the weights that sampled it gives |ratio - 1| up to {deviation:.3e} (tolerance "
                   f"{self.cfg.ratio_check.tolerance:.1e}). Rollout and training compute different transitions "
                   f"(precision, batch-dependent kernels, a CFG or scheduler mismatch?)")
            log.warning(msg)
            warnings.warn(msg, OnPolicyRatioWarning, stacklevel=3)

    def _nft_update(self, record: dict, tree, leaf_values, prompts: list[str]) -> None:
        """DiffusionNFT on this rank's clean samples (x0 = the leaves)."""
        cfg, nft = self.cfg, self.cfg.nft
        L = tree.leaves.shape[1]
        batch = GroupBatch(rewards=leaf_values.view(-1, L, leaf_values.shape[-1]),
                           reward_weights=[r.weight for r in cfg.rewards], reward_names=[r.label for r in cfg.rewards],
                           head_nan_policy=cfg.advantage.head_nan_policy)
        result = compute_advantages(batch, cfg.advantage)
        record.update(result.metrics)
        adv = result.advantages.reshape(-1).float()
        weight = result.sample_weight.reshape(-1).float()
        opt_r = (adv.clamp(-nft.adv_max, nft.adv_max) / nft.adv_max / 2 + 0.5).clamp(0, 1)
        mine, _ = self.dist.localize(torch.arange(adv.numel()), cfg.rollout_prompts * L)
        adv, weight, opt_r = adv[mine], weight[mine], opt_r[mine]  # this rank's samples, in local order
        x0 = tree.leaf_latents().flatten(0, 1)
        prompt_of = torch.arange(tree.num_prompts).repeat_interleave(L)
        keep = (weight > 0).nonzero().squeeze(1)
        schedule = tree.schedule
        sig = schedule.sigmas.float() if hasattr(schedule, "sigmas") else None
        if sig is None:
            raise ConfigError("method 'nft' needs a flow-matching model (sigma schedule)")
        n_t = max(1, int((len(sig) - 1) * nft.timestep_fraction))
        embeds = self.adapter.encode_prompts(prompts)
        metrics_sum, n_terms, backwards = 0.0, 0, 0
        grad_norms: list[float] = []
        total = max(self.dist.sum(float(keep.numel())) * int(n_t), 1.0)
        for epoch in range(cfg.train.inner_epochs):
            g = torch.Generator().manual_seed(cfg.seed * 1_000_003 + self.iteration * 1009 + epoch)
            order = keep[torch.randperm(keep.numel(), generator=g)]
            for mini in order.chunk(cfg.train.mini_batches) if keep.numel() else []:
                for micro in mini.split(cfg.train.micro_batch_size):
                    # each sample trains on n_t grid times, fresh noise every time
                    times = torch.stack([torch.randperm(len(sig) - 1, generator=g)[:n_t] for _ in micro])
                    for j in range(n_t):
                        t = sig[times[:, j]]
                        x_0 = x0[micro].float()
                        eps = torch.randn(x_0.shape, generator=g).to(x_0.device)
                        tt = t.to(x_0.device).view(-1, 1, 1, 1)
                        x_t = (1 - tt) * x_0 + tt * eps
                        rows = embeds.index(prompt_of[micro])
                        with torch.no_grad(), active_lora(self.adapter, "old") as old:
                            v_old = old.model_output(x_t, t, rows, cfg.sampler.guidance_scale, "none")
                        v = self.adapter.model_output(x_t, t, rows, cfg.sampler.guidance_scale, "none")
                        self.sampler.counters.nfe_nograd += micro.numel()
                        self.sampler.counters.nfe_grad += micro.numel()
                        per = nft_loss(v, v_old, x_t, x_0, t, opt_r[micro].to(v.device), beta=nft.beta,
                                       adv_max=nft.adv_max)
                        loss = per.sum() / total * cfg.train.mini_batches
                        if nft.kl_coef:
                            with torch.no_grad(), self.reference() as ref:
                                v_ref = ref.model_output(x_t, t, rows, cfg.sampler.guidance_scale, "none")
                            self.sampler.counters.nfe_nograd += micro.numel()
                            loss = loss + nft.kl_coef * ((v - v_ref) ** 2).flatten(1).mean(1).sum() / total
                        loss.backward()
                        backwards += 1
                        metrics_sum += float(per.detach().sum())
                        n_terms += micro.numel()
                self._optimizer_step(record, grad_norms)
        decay = old_decay(self.iteration, nft.decay)
        soft_update(self.old_params, self.params, decay)
        record.update({"loss/policy": metrics_sum / max(n_terms, 1), "nft/old_decay": decay,
                       "backward_passes": backwards, "nft/mean_r": float(opt_r[keep].mean()) if keep.numel() else math.nan})
        if grad_norms:
            record["grad_norm"] = sum(grad_norms) / len(grad_norms)

    # --- one iteration -----------------------------------------------------------------------------

    def train_iteration(self) -> dict[str, Any]:
        from pipelines.plans import build_plan

        cfg = self.cfg
        t_start = time.perf_counter()
        nfe0 = self.sampler.counters.as_dict()
        record: dict[str, Any] = {"iteration": self.iteration + 1, "lr": self.optimizer.param_groups[0]["lr"]}
        index = self.prompt_sampler.next(cfg.prompts_per_iteration)
        batch_prompts = self.prompts.take(index)
        plan = build_plan(cfg.plan.name, cfg.sampler.num_steps, self.iteration, cfg.seed, **cfg.plan.settings)
        record["plan/trained_steps"] = len(plan.trained_steps)
        keep_images = self._grid_due() or self.discriminator is not None
        tree, global_tree, leaf_values, probe_values, prefs, images, local_prompts = self._collect(
            record, batch_prompts, plan, keep_images)
        leaf_values, probe_values = self.guard.rewards(record, leaf_values, probe_values)  # hardening: inf -> NaN
        nodes_per_chunk = tree.num_nodes // len(self.dist.my_chunks(cfg.prompts_per_iteration // cfg.rollout_prompts))

        t0 = time.perf_counter()
        if self.discriminator is not None and self.discriminator.trains_at(self.iteration):
            record.update(self.discriminator.update(images, batch_prompts, cfg.group_size))
            record["adversarial/policy_update"] = 0
            record.update(assign_credit(global_tree, leaf_values, probe_values, prefs, cfg, self.iteration).metrics)
        elif cfg.method == "nft":
            self._nft_update(record, tree, leaf_values, local_prompts)
        else:
            credit = assign_credit(global_tree, leaf_values, probe_values, prefs, cfg, self.iteration)
            record.update(credit.metrics)
            self._grpo_update(record, tree, credit, local_prompts, nodes_per_chunk)
            if self.discriminator is not None:
                record["adversarial/policy_update"] = 1
        record["time_train_s"] = time.perf_counter() - t0

        nfe1 = self.sampler.counters.as_dict()
        record["nfe_nograd"] = nfe1["nfe_nograd"] - nfe0["nfe_nograd"]
        record["nfe_grad"] = nfe1["nfe_grad"] - nfe0["nfe_grad"]
        record.setdefault("backward_passes", 0)
        record["images"] = global_tree.leaves.numel()
        record["ratio_mean"] = record.get("ratio/mean", math.nan)
        record["peak_memory_mb"] = _peak_memory_mb()
        if images is not None and self._grid_due():
            artifacts.save_grid(images, self.out / "grids" / f"rollout_{self.iteration + 1:06d}.png",
                                cfg.group_size, cfg.artifacts.grid_images)
        self.scheduler.step()
        self.iteration += 1
        record["time_iteration_s"] = time.perf_counter() - t_start
        return record

    def _grid_due(self) -> bool:
        every = self.cfg.artifacts.grid_every
        return self.dist.is_main and bool(every) and (self.iteration + 1) % every == 0

    # --- evaluation --------------------------------------------------------------------------------

    @torch.no_grad()
    def evaluate(self, tag: str) -> dict[str, float]:
        """Deterministic ODE samples on the held-out prompts (EMA weights if kept); mean rewards."""
        from pipelines.plans import build_plan
        from pipelines.sampler import Sampler

        cfg = self.cfg
        steps = cfg.eval.num_steps or cfg.sampler.num_steps
        sampler = Sampler(cfg.sampler.model_copy(update={"num_steps": steps, "keep_means": False}))
        plan = build_plan("ode_only", steps)
        use_ema = self.ema is not None and cfg.eval.use_ema and self.optimizer_steps > 0
        if use_ema:
            self.ema.store(self.params)
            self.ema.copy_to(self.params)
        try:
            gen = torch.Generator().manual_seed(cfg.eval.seed)
            tree = sampler.run(self.adapter, self.eval_prompts.prompts, plan, cfg.eval.images_per_prompt, gen)
            images = self.adapter.decode(tree.leaf_latents().flatten(0, 1))
        finally:
            if use_ema:
                self.ema.restore(self.params)
        n = cfg.eval.images_per_prompt
        rows = [p for p in range(len(self.eval_prompts)) for _ in range(n)]
        # a pairwise scorer needs at least two images per prompt to compare
        scorable = n > 1 or not self.rewards.has_pairwise
        scored = self.rewards.score(images, [self.eval_prompts.prompts[r] for r in rows],
                                    [self.eval_prompts.metadata[r] for r in rows], n, len(rows)) if scorable else None
        out: dict[str, float] = {}
        if scored is not None:
            for k, label in enumerate(self.rewards.labels):
                v = scored.values[:, k]
                out[f"eval/{label}/mean"] = float(v[torch.isfinite(v)].mean()) if bool(torch.isfinite(v).any()) else math.nan
        if self.dist.is_main:
            artifacts.save_grid(images, self.out / "grids" / f"eval_{tag}.png", n, 64)
        return out

    # --- the run -----------------------------------------------------------------------------------

    def train(self) -> list[dict[str, Any]]:
        cfg = self.cfg
        from tqdm.auto import tqdm

        if self.dist.is_main:
            dump_config(cfg, self.out / "config.yaml")
        metrics_path = self.out / "metrics.jsonl"
        truncate_metrics(metrics_path, self.iteration, "iteration")
        end = cfg.iterations if cfg.stop_after is None else min(cfg.iterations, cfg.stop_after)
        history: list[dict[str, Any]] = []
        trackers = artifacts.Trackers(self.out, cfg) if self.dist.is_main else artifacts.Trackers.off()
        if self.iteration == 0 and self.dist.is_main:
            history_eval = self.evaluate("before")
            trackers.log(history_eval, 0)
        bar = tqdm(total=cfg.iterations, initial=self.iteration, desc=f"t2i-{cfg.method}",
                   disable=not (cfg.progress and self.dist.is_main))
        writer = MetricsWriter(metrics_path, append=self.iteration > 0) if self.dist.is_main else None
        stop = StopRequest.install("iteration")  # hardening: SIGINT / SIGTERM -> finish, save, stop
        try:
            while self.iteration < end:
                record = self.train_iteration()
                self.guard.end_update(record, self.iteration, self.params)  # hardening: warn / stop, never save NaN
                every = cfg.eval.every
                if every and self.iteration % every == 0 and self.iteration < cfg.iterations:
                    record.update(self.evaluate(f"{self.iteration:06d}"))
                if writer is not None:
                    writer.write(record)  # before the checkpoint: a resumed run drops records past it
                    trackers.log(record, self.iteration)
                history.append(record)
                ck = cfg.checkpoint.every
                if stop.poll(self.dist) or (ck and self.iteration % ck == 0) or self.iteration == end:
                    if self.dist.is_main:
                        self.save()
                    self.dist.barrier()
                bar.update(1)
                bar.set_postfix(reward=f"{record.get('reward_mean', math.nan):.4f}",  # hardening: kl only if measured
                                **({"kl": f"{record['approx_kl']:.1e}"} if "approx_kl" in record else {}))
                stop.check(self.iteration)  # hardening: raises Interrupted after the save
        finally:
            stop.restore()
            bar.close()
            if writer is not None:
                writer.close()
            self.rewards.close()
        if self.iteration >= cfg.iterations and self.dist.is_main:
            final = self.evaluate("after")
            trackers.log(final, self.iteration)
            (self.out / "eval_final.json").write_text(artifacts.to_json(final))
            if cfg.artifacts.plot:
                artifacts.plot_rewards(metrics_path, self.out / "reward_curve.png")
            if cfg.artifacts.save_lora and cfg.model.finetune == "lora":
                if self.ema is not None and self.optimizer_steps > 0:
                    self.ema.store(self.params)
                    self.ema.copy_to(self.params)
                    self.adapter.save_lora(self.out / "lora_ema")
                    self.ema.restore(self.params)
                self.adapter.save_lora(self.out / "lora")
        trackers.close()
        return history


def _peak_memory_mb() -> float:
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def train_t2i(config: T2IConfig) -> list[dict[str, Any]]:
    return T2ITrainer(config).train()
