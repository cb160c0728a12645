"""The text GRPO loop, top to bottom.

One training step:

    P prompts -> generate G completions each          (transformers generate or vLLM; each chunk of
                                                         prompts seeded by itself, on rank chunk % W)
              -> reward functions -> rewards [P, G, K] (NaN = not applicable / failed), gathered on every rank
              -> [DAPO dynamic sampling: drop zero-spread groups, generate more, bounded rounds]
              -> flowgrpo.core.compute_advantages     (any estimator; GDPO reads the K heads)
              -> old (and reference) token log-probs, no grad, in micro-batches (the old ones only when
                 several optimizer steps use the batch or the sampler's log-probs were recorded; else a
                 few rows re-scored for the on-policy check)
              -> [rollout-vs-training mismatch: importance weights exp(old - sampler), truncated / masked]
              -> num_iterations passes x mini_batches optimizer steps, each with ONE LossNormalizer
                 counted over its whole mini-batch, micro-batches accumulate gradients (micro-batch k
                 on rank k % W, gradients summed over ranks)
                 -> flowgrpo.core.policy_loss (any preset / parts) -> clip grad norm -> AdamW
              -> LR schedule, metrics.jsonl, progress bar, checkpoint every k steps

The first micro-batches of a fresh batch (before any optimizer step) are scored by the weights
that sampled it: their ratio must be 1. The deviation is measured and logged every step, with a
loud warning when it exceeds the tolerance.

Every forward over completions runs each distinct prompt of its micro-batch once and repeats the
prompt's key/value cache for the completions that share it (`train.shared_prompt`; on the first
batch the trainer checks that this gives the plain forward's log-probs before using it).
"""

from __future__ import annotations

import logging
import math
import time
import warnings
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Mapping, Optional

import numpy as np
import torch

from ..checkpoint import latest_checkpoint, load_checkpoint, load_into, save_checkpoint, check_resume_config
from ..config import ConfigError, dump_config
from ..core import GroupBatch, LossInputs, LossNormalizer, compute_advantages, policy_loss
from ..core.stats import masked_std
from ..distributed import Distributed
from ..guards import NonFiniteGuard
from ..interrupts import StopRequest
from ..metrics import LossMetrics, MetricsWriter, truncate_metrics
from ..process import prepare_process
from .config import TextConfig
from .data import PromptSampler, load_prompts
from .generation import Rollout, TransformersGenerator, eos_token_ids, prompts_per_call
from .logprobs import micro_logprobs, shared_prompt_deviation
from .models import load_policy, reference_policy, resolve_model_path, trainable_state
from .optim import build_optimizer
from .rewards import RewardScores, build_rewards, score_completions
from .rollout_correction import correction_weights, mismatch_metrics

log = logging.getLogger(__name__)

# keys of the config that may change between a checkpoint and its resumption without a warning
_RESUME_FREE = {"steps", "stop_after", "resume", "progress", "checkpoint", "output_dir"}


class OnPolicyRatioWarning(UserWarning):
    """The first pass over a fresh batch did not give ratio 1."""


class TextGRPOTrainer:
    """GRPO-family training of a causal LM. `reward_funcs` adds callables by name for `rewards[].name`."""

    def __init__(self, config: TextConfig, reward_funcs: Optional[Mapping[str, Callable]] = None):
        self.cfg = cfg = config
        prepare_process(cfg.seed, cfg.num_threads, cfg.deterministic)

        self.dist = Distributed.from_environment()
        self.out = Path(cfg.output_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        self.ckpt_dir = Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else self.out / "checkpoints"

        self.tokenizer, self.model = load_policy(cfg.model)
        self.device = next(self.model.parameters()).device
        self.eos_ids = eos_token_ids(self.model, self.tokenizer)
        try:
            self.rewards = build_rewards(cfg.rewards, extra=reward_funcs, context={
                "max_tokens": cfg.generation.max_new_tokens, "eos_token_ids": self.eos_ids,
                "tokenizer": self.tokenizer, "device": str(self.device)})
        except ValueError as err:
            raise ConfigError(f"rewards: {err}") from None
        context = getattr(self._base_config(), "max_position_embeddings", None)
        self.data = load_prompts(cfg.data, self.tokenizer, context_length=context,
                                 max_new_tokens=cfg.generation.max_new_tokens,
                                 required_columns={r.name: r.columns for r in self.rewards})
        self.generator = self._build_generator()
        self.sampler = PromptSampler(len(self.data), cfg.seed, cfg.data.shuffle)
        self.params, self.optimizer, self.scheduler = build_optimizer(self.model, cfg.optim, cfg.steps)
        self.use_kl = cfg.loss.kl.coef != 0
        self.reference = reference_policy(self.model, self.use_kl)
        self.guard = NonFiniteGuard(cfg.guards, "step", nan_is_missing=True)  # hardening: non-finite values
        self.step = 0
        self._in_step = False
        self.shared_prompt: Optional[bool] = None if cfg.train.shared_prompt == "auto" else cfg.train.shared_prompt
        self.resumed_from: Optional[Path] = None
        if cfg.resume:
            self._resume()

    def _build_generator(self):
        gen = self.cfg.generation
        if gen.backend == "transformers":
            return TransformersGenerator(self.model, self.tokenizer, gen)
        from .vllm_backend import VLLMGenerator

        m = self.cfg.model
        if m.gguf_file and not m.gguf_cache_dir:
            raise ConfigError("generation.backend vllm with model.gguf_file needs model.gguf_cache_dir (vLLM "
                              "loads the de-quantised safetensors copy)")
        path = m.gguf_cache_dir if m.gguf_file else resolve_model_path(m.name_or_path)
        longest = max(len(ids) for ids in self.data.prompt_ids)
        generator = VLLMGenerator(self.model, self.tokenizer, gen, model_path=path, max_prompt_len=longest)
        generator.sync_weights()  # LoRA / resumed weights: the engine loaded the base model only
        return generator

    def _base_config(self):
        model = self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model
        return model.config

    # --- checkpoints -------------------------------------------------------------------------

    def save(self) -> Optional[Path]:
        """Rank 0 writes the checkpoint (every rank holds the same weights); the others wait for it."""
        path = self._save() if self.dist.is_main else None
        self.dist.barrier()
        return path

    def _save(self) -> Path:
        return save_checkpoint(
            self.ckpt_dir, self.step,
            tensors={"model": trainable_state(self.model)},
            optimizers={"policy": self.optimizer}, schedulers={"lr": self.scheduler},
            state={"sampler": self.sampler.state_dict()},
            config=self.cfg.model_dump(mode="json"), keep_last=self.cfg.checkpoint.keep_last)

    def _resume(self) -> None:
        path = latest_checkpoint(self.ckpt_dir, verify=True)  # hardening: skips (and names) damaged ones
        if path is None:
            log.info("resume: no checkpoint under %s; starting from step 0", self.ckpt_dir)
            return
        ckpt = load_checkpoint(path, optimizers={"policy": self.optimizer}, schedulers={"lr": self.scheduler})
        load_into(self.model, ckpt.tensors["model"])
        self.sampler.load_state_dict(ckpt.state["sampler"])
        self.step = ckpt.step
        self.resumed_from = path
        check_resume_config(self.cfg.model_dump(mode="json"), ckpt.config, _RESUME_FREE)  # hardening: refuse
        log.info("resumed from %s (step %d)", path, self.step)
        self.generator.sync_weights()

    # --- phases ------------------------------------------------------------------------------

    def _score(self, rollout: Rollout) -> RewardScores:
        rows = [self.data.rows[int(i)] for i in rollout.prompt_index]
        field = self.cfg.data.prompt_field
        ids = [c[m].tolist() for c, m in zip(rollout.completion_ids, rollout.completion_mask)]
        texts = self.tokenizer.batch_decode(ids, skip_special_tokens=True)
        conv = [self.data.conversational[int(i)] for i in rollout.prompt_index]
        completions = [[{"role": "assistant", "content": t}] if c else t for t, c in zip(texts, conv)]
        names = sorted({k for row in rows for k in row} - {field})
        columns = {k: [row.get(k) for row in rows] for k in names}
        return score_completions(self.rewards, prompts=[row[field] for row in rows], completions=completions,
                                 completion_ids=ids, columns=columns,
                                 trainer_state={"global_step": self.step},
                                 stop_on_error=self.cfg.stop_on_reward_error)

    def _group_batch(self, values: torch.Tensor, rollout: Rollout) -> GroupBatch:
        G = rollout.group_size
        P = values.shape[0] // G
        return GroupBatch(rewards=values.view(P, G, -1), reward_weights=[r.weight for r in self.rewards],
                          reward_names=[r.name for r in self.rewards], lengths=rollout.lengths.view(P, G).float(),
                          head_nan_policy=self.cfg.advantage.head_nan_policy)

    def _chunk_seed(self, round_: int, chunk: int) -> int:
        """The sampling seed of a chunk of prompts: the same on any rank, for any number of ranks, after a resume."""
        return int(np.random.SeedSequence([self.cfg.seed, self.step, round_, chunk]).generate_state(1)[0])

    def _generate_and_score(self, index: list[int], round_: int) -> tuple[Rollout, RewardScores, float, float]:
        """Chunk c of the prompts is sampled (with its own seed) and scored on rank c % world_size; every
        rank gets the whole batch back in chunk order. Returns the local generate / reward seconds too."""
        per_call = prompts_per_call(self.cfg.generation)
        chunks = [index[s:s + per_call] for s in range(0, len(index), per_call)]
        local, t_gen, t_rew, failure = [], 0.0, 0.0, None
        try:
            for c in self.dist.my_chunks(len(chunks)):
                t0 = time.perf_counter()
                rollout = self.generator.generate([self.data.prompt_ids[i] for i in chunks[c]], chunks[c],
                                                  seed=self._chunk_seed(round_, c))
                t1 = time.perf_counter()
                local.append((c, rollout, self._score(rollout)))
                t_gen += t1 - t0
                t_rew += time.perf_counter() - t1
        except Exception as err:
            if not self.dist.active:
                raise
            # the other ranks wait at the gather below: tell them, so every rank stops with the reason
            failure = err
            local = [(-1, f"rank {self.dist.rank}: {type(err).__name__}: {err}", None)]
        parts = sorted(self.dist.gather_objects(local), key=lambda item: item[0])
        failed = [msg for c, msg, _ in parts if c < 0]
        if failure is not None:
            raise failure
        if failed:
            raise RuntimeError("generation or scoring failed on another rank: " + "; ".join(failed))
        rollout = Rollout.concat([r for _, r, _ in parts], self.generator.pad_id)
        scores = [sc for _, _, sc in parts]
        merged = RewardScores(torch.cat([sc.values for sc in scores]),
                              [sum(col) for col in zip(*(sc.none_counts for sc in scores))],
                              [sum(col) for col in zip(*(sc.error_counts for sc in scores))])
        return rollout, merged, t_gen, t_rew

    def _collect(self, record: dict) -> tuple[Optional[Rollout], Optional[RewardScores]]:
        """Generate and score P groups; with dynamic sampling, keep only groups whose rewards vary."""
        cfg, ds = self.cfg.generation, self.cfg.dynamic_sampling
        P, G = cfg.prompts_per_step, cfg.group_size
        kept_r, kept_s = [], []
        n_kept, rounds, generated = 0, 0, 0
        t_gen = t_rew = 0.0
        nones = [0] * len(self.rewards)
        errors = [0] * len(self.rewards)
        while True:
            index = self.sampler.next(P)
            rollout, scores, dt_gen, dt_rew = self._generate_and_score(index, rounds)
            t_gen += dt_gen
            t_rew += dt_rew
            generated += P
            nones = [a + b for a, b in zip(nones, scores.none_counts)]
            errors = [a + b for a, b in zip(errors, scores.error_counts)]
            if not ds.enabled:
                kept_r, kept_s, n_kept = [rollout], [scores], P
                break
            scalar = self._group_batch(scores.values, rollout).scalar_rewards()
            ok = torch.isfinite(scalar)
            spread = masked_std(scalar, ok, dim=1, unbiased=False).squeeze(1) > ds.min_std
            keep = [g for g in range(P) if bool(spread[g])][:P - n_kept]
            if keep:
                kept_r.append(rollout.select_groups(keep))
                rows = torch.tensor([g * G + j for g in keep for j in range(G)])
                kept_s.append(replace(scores, values=scores.values[rows]))
                n_kept += len(keep)
            if n_kept >= P or rounds >= ds.max_extra_rounds:
                break
            rounds += 1
        # seconds: the slowest rank's (the others wait for it at the gather)
        record.update({"time/generate": self.dist.max(t_gen), "time/reward": self.dist.max(t_rew),
                       "count/generated_groups": generated,
                       "count/reward_calls": len(self.rewards) * (generated // P)})
        for r, n, e in zip(self.rewards, nones, errors):
            record[f"rewards/{r.name}/none_count"] = n
            record[f"rewards/{r.name}/error_count"] = e
        if ds.enabled:
            record.update({"dynamic_sampling/extra_rounds": rounds, "dynamic_sampling/kept_groups": n_kept,
                           "dynamic_sampling/dropped_groups": generated - n_kept})
        if not kept_r:
            return None, None
        rollout = Rollout.concat(kept_r, self.generator.pad_id)
        values = torch.cat([s.values for s in kept_s])
        return rollout, RewardScores(values, nones, errors)

    def _decide_shared_prompt(self, rollout: Rollout, record: dict, counts: dict) -> None:
        """train.shared_prompt auto: compare the shared-prompt and the plain forward on the first groups of
        the first batch; use the shared one when they agree to a tenth of the ratio-check tolerance."""
        G = rollout.group_size
        rows = torch.arange(min(rollout.num_sequences, max(2 * G, 2), self.cfg.train.micro_batch_size))
        shares = torch.unique(rollout.prompt_index[rows]).numel() < rows.numel()
        deviation = shared_prompt_deviation(self.model, rollout, rows, self.cfg.generation.temperature) \
            if shares else math.inf
        counts["count/forward_nograd"] += 2 if shares else 0  # once per run: plain + shared pass
        deviation = self.dist.max(deviation)  # every rank decides the same
        self.shared_prompt = deviation <= self.cfg.ratio_check.tolerance / 10
        record["check/shared_prompt_deviation"] = deviation
        log.info("shared-prompt forward %s (max |log-prob difference| to the plain forward: %.2e)",
                 "on" if self.shared_prompt else "off", deviation)

    def _needs_old_logp(self) -> bool:
        """The loss needs the rollout policy's log-probs: several optimizer steps per generation batch."""
        t = self.cfg.train
        return t.num_iterations > 1 or t.mini_batches > 1

    def _skip_zero_advantage(self) -> bool:
        """Rows with A = 0 add nothing to the gradient unless a KL / entropy term or a local normaliser is used."""
        return (not self.use_kl and not self.cfg.loss.entropy_coef
                and self.cfg.loss.aggregation.name != "local_token_mean")

    def _micro_batches(self, mini: torch.Tensor, live: torch.Tensor) -> list[torch.Tensor]:
        rows = mini[live[mini]]
        return list(rows.split(self.cfg.train.micro_batch_size)) if rows.numel() else []

    def _all_logprobs(self, model, rollout: Rollout, shared: bool, counts: dict,
                      with_entropy: bool = False) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """No-grad log-probs (and entropies) [N, Tc] of the whole rollout on CPU: row block b of
        `logprob_batch_size` sequences on rank b % world_size, gathered on every rank."""
        size = self.cfg.train.logprob_batch_size or self.cfg.train.micro_batch_size
        N = rollout.num_sequences
        blocks = [torch.arange(s, min(s + size, N)) for s in range(0, N, size)]
        local = []
        with torch.no_grad():
            for b in self.dist.my_chunks(len(blocks)):
                lp, ent = micro_logprobs(model, rollout, blocks[b], self.cfg.generation.temperature,
                                         with_entropy, shared_prompt=shared)
                local.append((b, lp.cpu(), None if ent is None else ent.cpu()))
        counts["count/forward_nograd"] += len(local)
        parts = sorted(self.dist.gather_objects(local), key=lambda item: item[0])
        logp = torch.cat([lp for _, lp, _ in parts])
        return logp, (torch.cat([e for _, _, e in parts]) if with_entropy else None)

    @staticmethod
    def _first_pass_deviation(logp: torch.Tensor, old: torch.Tensor, m: torch.Tensor, micro: torch.Tensor,
                              checked_at: torch.Tensor, check_logp: Optional[torch.Tensor],
                              have_old: bool) -> tuple[float, int]:
        """max |ratio - 1| of a micro-batch before any optimizer step, and how many sequences it covered:
        against the old pass when there is one, else against the re-scored check rows."""
        if have_old:
            if not bool(m.any()):
                return 0.0, 0
            return float(((logp - old)[m].exp() - 1).abs().max()), int(m.any(1).sum())
        if check_logp is None:
            return 0.0, 0
        at = checked_at[micro]
        sel = at >= 0
        if not bool(sel.any()):
            return 0.0, 0
        ms = m[sel.to(m.device)]
        diff = logp[sel.to(logp.device)] - check_logp[at[sel]].to(logp.device)
        dev = float((diff[ms].exp() - 1).abs().max()) if bool(ms.any()) else 0.0
        return dev, int(sel.sum())

    # --- one step ----------------------------------------------------------------------------

    def train_step(self) -> dict[str, Any]:
        cfg = self.cfg
        self._in_step = True  # weights may be half-updated until _finish_step
        t_step = time.perf_counter()
        record: dict[str, Any] = {"step": self.step + 1, "lr": self.optimizer.param_groups[0]["lr"]}
        record.update(self.generator.settings)
        rollout, scores = self._collect(record)
        scores = scores and replace(scores, values=self.guard.rewards(record, scores.values))  # hardening: inf -> NaN
        if rollout is None:
            log.warning("step %d: dynamic sampling kept no group with reward spread; no update", self.step + 1)
            record["skipped_update"] = 1
            self._finish_step(record, t_step)
            return record

        # rewards -> advantages (shared core)
        batch = self._group_batch(scores.values, rollout)
        adv = compute_advantages(batch, cfg.advantage)
        if adv.level != "sample":
            raise ValueError(f"advantage estimator '{cfg.advantage.estimator.name}' gives {adv.level}-level "
                             f"advantages; the text trainer uses one advantage per completion")
        record.update(adv.metrics)
        lengths = rollout.lengths.float()
        record.update({
            "completions/mean_length": float(lengths.mean()), "completions/min_length": float(lengths.min()),
            "completions/max_length": float(lengths.max()),
            "completions/clipped_ratio": float(rollout.truncated.float().mean()),
            "completions/mean_terminated_length": float(lengths[~rollout.truncated].mean())
            if bool((~rollout.truncated).any()) else math.nan,
        })

        N = rollout.num_sequences
        mask = rollout.completion_mask.clone()
        if cfg.generation.mask_truncated:
            mask &= ~rollout.truncated.unsqueeze(1)
        temp = cfg.generation.temperature
        counts = {k: 0 for k in ("count/forward_nograd", "count/forward_grad", "count/backward",
                                 "count/optimizer_steps")}
        advantages = adv.advantages.reshape(N)
        sample_weight = adv.sample_weight.reshape(N, 1).expand(mask.shape).clone()
        # the order of every pass, fixed up front: the on-policy check needs the first rows trained on
        orders = []
        for it in range(cfg.train.num_iterations):
            if cfg.train.shuffle:
                g = torch.Generator().manual_seed(cfg.seed * 1_000_003 + self.step * 1009 + it)
                orders.append(torch.randperm(N, generator=g))
            else:
                orders.append(torch.arange(N))

        # old and reference log-probs (no grad)
        t0 = time.perf_counter()
        if self.shared_prompt is None:
            self._decide_shared_prompt(rollout, record, counts)
        shared = self.shared_prompt
        logp_old = entropy = logp_ref = check_rows = check_logp = None
        check = cfg.ratio_check.enabled
        corrected = rollout.rollout_logp is not None
        if self._needs_old_logp() or corrected or (check and cfg.ratio_check.rows is None):
            logp_old, entropy = self._all_logprobs(self.model, rollout, shared, counts, with_entropy=True)
        if self.use_kl:
            with self.reference() as ref_model:
                logp_ref, _ = self._all_logprobs(ref_model, rollout, shared, counts)
        if corrected:
            # the sampler's log-probs against the training forward's, and the importance weights
            record.update(mismatch_metrics(logp_old, rollout.rollout_logp, mask))
            weights, corr_metrics = correction_weights(logp_old, rollout.rollout_logp, mask, cfg.rollout_correction)
            record.update(corr_metrics)
            sample_weight = sample_weight * weights
        live = (mask & (sample_weight > 0)).any(1)
        if self._skip_zero_advantage():
            live &= advantages != 0
        micro_plan = [[(mini, self._micro_batches(mini, live)) for mini in order.chunk(cfg.train.mini_batches)]
                      for order in orders]
        if logp_old is None and check:
            # one update per batch: the loss takes the detached current log-probs as the old ones (as TRL
            # does), and only a few sequences of this rank's first micro-batch are re-scored for the check
            mine = [m for k, m in enumerate(micro_plan[0][0][1]) if k % self.dist.world_size == self.dist.rank]
            check_rows = mine[0][:cfg.ratio_check.rows] if mine else torch.zeros(0, dtype=torch.long)
            if check_rows.numel():
                with torch.no_grad():
                    check_logp, _ = micro_logprobs(self.model, rollout, check_rows, temp, shared_prompt=shared)
                counts["count/forward_nograd"] += 1
        record["time/logprob"] = time.perf_counter() - t0

        dev = self.device
        full = LossInputs(
            logp=torch.zeros(mask.shape, device=dev), logp_old=torch.zeros(mask.shape, device=dev)
            if logp_old is None else logp_old.to(dev), advantages=advantages.to(dev),
            mask=mask.to(dev), sample_weight=sample_weight.to(dev),
            logp_ref=None if logp_ref is None else logp_ref.to(dev))
        if entropy is not None:
            record["entropy/mean"] = float(entropy[mask].mean()) if bool(mask.any()) else math.nan
        checked_at = torch.full((N,), -1, dtype=torch.long)  # row -> its index in check_rows
        if check_rows is not None:
            checked_at[check_rows] = torch.arange(check_rows.numel())

        # policy update: num_iterations passes x mini_batches optimizer steps; micro-batch k of a
        # mini-batch runs on rank k % world_size, gradients are summed over ranks before the step
        t0 = time.perf_counter()
        metrics = LossMetrics()
        first_pass_dev = 0.0
        checked_rows = 0
        ent_sum, ent_tokens = 0.0, 0
        grad_norms = []
        on_policy = True  # until the first optimizer step
        for it, minis in enumerate(micro_plan):
            for mini, micros in minis:
                norm = LossNormalizer.from_inputs(full.split(mini), const_len=cfg.generation.max_new_tokens)
                self.optimizer.zero_grad(set_to_none=True)
                for k, micro in enumerate(micros):
                    if k % self.dist.world_size != self.dist.rank:
                        continue
                    # entropy: for the loss (with grad), or as a metric of the first pass when no old pass gave it
                    ent_metric = entropy is None and it == 0
                    logp, ent = micro_logprobs(self.model, rollout, micro, temp,
                                               with_entropy=bool(cfg.loss.entropy_coef) or ent_metric,
                                               entropy_grad=bool(cfg.loss.entropy_coef), shared_prompt=shared)
                    counts["count/forward_grad"] += 1
                    m = full.mask[micro]
                    if ent_metric:
                        ent_sum += float(ent.detach()[m].sum())
                        ent_tokens += int(m.sum())
                    old = full.logp_old[micro] if logp_old is not None else logp.detach()
                    if on_policy and check:
                        dev_, rows_ = self._first_pass_deviation(logp.detach(), old, m, micro, checked_at,
                                                                 check_logp, logp_old is not None)
                        first_pass_dev, checked_rows = max(first_pass_dev, dev_), checked_rows + rows_
                    inputs = replace(full.split(micro), logp=logp, logp_old=old,
                                     entropy=ent if cfg.loss.entropy_coef else None)
                    out = policy_loss(inputs, cfg.loss, norm)
                    out.loss.backward()
                    counts["count/backward"] += 1
                    metrics.add(out.metrics, int(m.sum()))
                self.dist.all_reduce_grads(self.params)
                max_norm = cfg.optim.max_grad_norm if cfg.optim.max_grad_norm is not None else math.inf
                grad_norms.append(float(torch.nn.utils.clip_grad_norm_(self.params, max_norm)))
                if self.guard.step_ok(record, grad_norms[-1]):  # hardening: never step on a NaN / inf gradient
                    self.optimizer.step()
                counts["count/optimizer_steps"] += 1
                on_policy = False
        self.generator.sync_weights()
        if self.dist.active:  # every rank's share of the metrics and counts
            merged = LossMetrics()
            for part in self.dist.gather_objects([metrics]):
                merged.absorb(part)
            metrics = merged
            for key in ("count/forward_nograd", "count/forward_grad", "count/backward"):
                counts[key] = int(self.dist.sum(counts[key]))
            ent_sum, ent_tokens = self.dist.sum(ent_sum), int(self.dist.sum(ent_tokens))
            first_pass_dev, checked_rows = self.dist.max(first_pass_dev), int(self.dist.sum(checked_rows))
        if entropy is None and ent_tokens:
            record["entropy/mean"] = ent_sum / ent_tokens
        record["time/train"] = time.perf_counter() - t0
        record.update(metrics.result(counts["count/optimizer_steps"]))
        record.update(counts)
        if grad_norms:
            record["grad_norm"] = sum(grad_norms) / len(grad_norms)
            record["grad_norm_max"] = max(grad_norms)
        record["train/shared_prompt"] = int(bool(shared))
        if cfg.ratio_check.enabled:
            record["check/first_pass_ratio_dev"] = first_pass_dev
            record["check/rows"] = checked_rows
            if first_pass_dev > cfg.ratio_check.tolerance:
                msg = (f"ON-POLICY CHECK FAILED at step {self.step + 1}: the first pass over a fresh batch gives "
                       f"|ratio - 1| up to {first_pass_dev:.3e} (tolerance {cfg.ratio_check.tolerance:.1e}). The "
                       f"weights that score the batch do not reproduce the log-probs that sampled it (dropout on? "
                       f"non-deterministic kernels? a changed model between the passes?)")
                log.warning(msg)
                warnings.warn(msg, OnPolicyRatioWarning, stacklevel=2)
        gen_tokens = int(rollout.lengths.sum())
        record["tokens/generated"] = gen_tokens
        record["tokens/per_second_generate"] = gen_tokens / max(record["time/generate"], 1e-9)
        self._finish_step(record, t_step, gen_tokens)
        return record

    def _finish_step(self, record: dict, t_step: float, gen_tokens: int = 0) -> None:
        self.scheduler.step()
        self.step += 1
        self._in_step = False
        record["time/step"] = time.perf_counter() - t_step
        record["tokens/per_second"] = gen_tokens / max(record["time/step"], 1e-9)

    # --- the run -----------------------------------------------------------------------------

    def train(self) -> list[dict[str, Any]]:
        cfg = self.cfg
        from tqdm.auto import tqdm

        main = self.dist.is_main  # rank 0 writes the config, metrics, checkpoints and the final model
        metrics_path = self.out / "metrics.jsonl"
        if main:
            dump_config(cfg, self.out / "config.yaml")
            if self.step > 0:
                truncate_metrics(metrics_path, self.step, "step")
        end = cfg.steps if cfg.stop_after is None else min(cfg.steps, cfg.stop_after)
        history: list[dict[str, Any]] = []
        bar = tqdm(total=cfg.steps, initial=self.step, desc="text-grpo", disable=not (cfg.progress and main))
        saved_at = ckpt_seconds = None
        writer = MetricsWriter(metrics_path, append=self.step > 0) if main else None
        stop = StopRequest.install("step")  # hardening: SIGINT / SIGTERM -> finish, save, stop
        try:
            while self.step < end:
                record = self.train_step()
                self.guard.end_update(record, self.step, self.params)  # hardening: warn / stop, never save NaN
                if ckpt_seconds is not None:  # the save that followed the previous step
                    record["time/checkpoint"], ckpt_seconds = ckpt_seconds, None
                # the record goes out before the checkpoint: a crash in between leaves a record
                # newer than the checkpoint, which a resumed run drops and writes again
                if writer is not None:
                    writer.write(record)
                history.append(record)
                every = cfg.checkpoint.every
                if stop.poll(self.dist) or (every and self.step % every == 0) or self.step == end:
                    t0 = time.perf_counter()
                    self.save()
                    saved_at = self.step
                    ckpt_seconds = time.perf_counter() - t0
                bar.update(1)
                bar.set_postfix(reward=f"{record.get('reward_mean', math.nan):.3f}",
                                len=f"{record.get('completions/mean_length', math.nan):.1f}")
                stop.check(self.step)  # hardening: raises Interrupted after the save
        except KeyboardInterrupt:
            if self.step > 0 and saved_at != self.step and not self._in_step and main:
                log.warning("interrupted: saving a checkpoint at step %d", self.step)
                self._save()
            raise
        finally:
            stop.restore()
            bar.close()
            if writer is not None:
                writer.close()
        if self.step >= cfg.steps and cfg.checkpoint.save_final_model and main:
            final = self.out / "final"
            self.model.save_pretrained(str(final))
            self.tokenizer.save_pretrained(str(final))
        return history


def train_text(config: TextConfig, reward_funcs: Optional[Mapping[str, Callable]] = None) -> list[dict[str, Any]]:
    """Build the trainer and run it; returns the metrics records of the steps run."""
    return TextGRPOTrainer(config, reward_funcs).train()
