"""The text GRPO trainer: rollout, scoring and the token-level update of a causal LM.

One training step (the shared loop, flowgrpo/run/loop.py, runs it and owns checkpoints, metrics, progress):

    P prompts -> generate G completions each          (transformers generate or vLLM; each chunk of
                                                         prompts seeded by itself, on rank chunk % W)
              -> reward functions -> rewards [P, G, K] (NaN = not applicable / failed), gathered on every rank
              -> [DAPO dynamic sampling: drop zero-spread groups, generate more, bounded rounds]
                 (collect.py)
              -> flowgrpo.core.compute_advantages     (any estimator; GDPO reads the K heads)
              -> old (and reference) token log-probs, no grad, in micro-batches (the old ones only when
                 several optimizer steps use the batch or the sampler's log-probs were recorded; else a
                 few rows re-scored for the on-policy check)
              -> [rollout-vs-training mismatch: importance weights exp(old - sampler), truncated / masked]
              -> inner_epochs passes x mini_batches optimizer steps, each with ONE LossNormalizer
                 counted over its whole mini-batch, micro-batches accumulate gradients (micro-batch k
                 on rank k % W, gradients summed over ranks)
                 -> flowgrpo.core.policy_loss (any preset / parts) -> the shared optimizer step

The first micro-batches of a fresh batch (before any optimizer step) are scored by the weights
that sampled it: their ratio must be 1 (flowgrpo/run/ratio_check.py).

Every forward over completions runs each distinct prompt of its micro-batch once and repeats the
prompt's key/value cache for the completions that share it (`train.shared_prompt`; on the first
batch the trainer checks that this gives the plain forward's log-probs before using it), except with
`train.gradient_checkpointing`, where each decoder layer recomputes its activations in backward instead.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, replace
from typing import Any, Callable, Mapping, Optional

import torch

from ..checkpoint import Checkpoint, load_into
from ..config import ConfigError
from ..core import LossInputs, LossNormalizer, compute_advantages, policy_loss
from ..metrics import TIME_KEY, LossMetrics
from ..scaling.sharding import ShardingError, enable_activation_checkpointing, full_state
from ..run import CheckpointParts, FirstPassCheck, OptimizerStep, PromptSampler, RunLoop, build_optimizer
from .collect import Collector, ScoredBatch, group_batch
from .config import TextConfig
from .data import load_prompts
from .generation import Rollout, TransformersGenerator, eos_token_ids
from .logprobs import TokenLogprobs, micro_logprobs, sampler_deviation, shared_prompt_deviation
from .models import is_peft, load_policy, reference_policy, resolve_model_path, trainable_state
from .rewards import build_rewards
from .rollout_correction import correction_weights, mismatch_metrics

log = logging.getLogger(__name__)

PAD_ROWS = torch.zeros(1, dtype=torch.long)  # the sequence a sharded run's padding passes run on

SUSPECTS = (
    "The weights that score the batch do not reproduce the log-probs that sampled it (dropout on? "
    "non-deterministic kernels? a changed model between the passes?)"
)


@dataclass
class PreparedBatch:
    """A scored rollout ready for the update: loss inputs of every sequence, the micro-batch plan, the check rows."""

    rollout: Rollout
    full: LossInputs  # [N, Tc]; logp is filled per micro-batch
    have_old: bool  # logp_old is the old pass (else the detached current log-probs)
    entropy: Optional[torch.Tensor]  # [N, Tc] from the old pass, when there was one
    plan: list[list[tuple[torch.Tensor, list[torch.Tensor]]]]  # per pass: (mini-batch rows, its micro-batches)
    checked_at: torch.Tensor  # [N] row -> its index in check_logp (-1: not re-scored)
    check_logp: Optional[torch.Tensor]


class TextGRPOTrainer(RunLoop):
    """GRPO-family training of a causal LM. `reward_funcs` adds callables by name for `rewards[].name`."""

    unit = "step"
    progress_label = "text-grpo"
    resume_free = frozenset({"steps", "stop_after", "resume", "progress", "checkpoint", "output_dir"})
    nan_reward_is_missing = True  # a reward function's None: counted per reward already, not a failure

    def __init__(self, config: TextConfig, reward_funcs: Optional[Mapping[str, Callable]] = None):
        super().__init__(config, config.steps)
        self.cfg: TextConfig = config
        cfg = config
        self.tokenizer, self.model = load_policy(cfg.model)
        self.use_kl = cfg.loss.kl.coef != 0
        self.reference = reference_policy(self.model, self.use_kl)  # a frozen copy is taken before sharding
        if cfg.train.gradient_checkpointing:  # after the copy: the frozen reference runs without grad anyway
            try:
                enable_activation_checkpointing(self.model)
            except ShardingError as err:
                raise ConfigError(f"train.gradient_checkpointing: {err}") from None
        if self.dist.sharded:
            self.dist.shard(self.model)
            frozen = getattr(self.reference, "frozen", None)
            if frozen is not None:
                self.dist.shard(frozen)
        self.device = next(self.model.parameters()).device
        self.eos_ids = eos_token_ids(self.model, self.tokenizer)
        try:
            self.rewards = build_rewards(
                cfg.rewards,
                extra=reward_funcs,
                context={
                    "max_tokens": cfg.generation.max_new_tokens,
                    "eos_token_ids": self.eos_ids,
                    "tokenizer": self.tokenizer,
                    "device": str(self.device),
                },
            )
        except ValueError as err:
            raise ConfigError(f"rewards: {err}") from None
        context = getattr(self._base_config(), "max_position_embeddings", None)
        self.data = load_prompts(
            cfg.data,
            self.tokenizer,
            context_length=context,
            max_new_tokens=cfg.generation.max_new_tokens,
            required_columns={r.name: r.columns for r in self.rewards},
        )
        self.generator = self._build_generator()
        self.sampler = PromptSampler(len(self.data), cfg.seed, cfg.data.shuffle)
        self.collector = Collector(
            cfg, self.generator, self.tokenizer, self.data, self.rewards, self.sampler, self.dist
        )
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        built = build_optimizer(self.params, cfg.optim, cfg.steps, fused=True)
        self.optimizer, self.scheduler = built.optimizer, built.scheduler
        self.optimizer_step = OptimizerStep(
            self.params, self.optimizer, cfg.optim.max_grad_norm, self.dist, guard=self.guard, module=self.model
        )
        # Off with gradient checkpointing (the config refuses shared_prompt true with it), and in sharded or ZeRO-3
        # runs: the shared-prompt path runs one or two forwards depending on the rows, and every rank there must
        # run the same number, so those take the plain forward (one per micro-batch)
        configured = None if cfg.train.shared_prompt == "auto" else cfg.train.shared_prompt
        off = cfg.train.gradient_checkpointing or self.dist.gathers_weights
        self.shared_prompt: Optional[bool] = False if off else configured
        if cfg.resume:
            self.resume()

    def _build_generator(self) -> Any:
        gen = self.cfg.generation
        if gen.backend == "transformers":
            return TransformersGenerator(self.model, self.tokenizer, gen, synced=self.dist.gathers_weights)
        if self.dist.zero is not None and self.dist.zero.stage == 3:
            raise ConfigError(
                "generation.backend vllm under ZeRO-3: the policy's weights are partitioned; use ZeRO-2 or FSDP2"
            )
        from .vllm_backend import VLLMGenerator

        m = self.cfg.model
        if m.gguf_file and not m.gguf_cache_dir:
            raise ConfigError(
                "generation.backend vllm with model.gguf_file needs model.gguf_cache_dir (vLLM "
                "loads the de-quantised safetensors copy)"
            )
        path = m.gguf_cache_dir if m.gguf_file else resolve_model_path(m.name_or_path)
        longest = max(len(ids) for ids in self.data.prompt_ids)
        generator = VLLMGenerator(self.model, self.tokenizer, gen, model_path=path, max_prompt_len=longest)
        generator.sync_weights()  # LoRA / resumed weights: the engine loaded the base model only
        return generator

    def _base_config(self) -> Any:
        model = self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model
        return model.config

    # --- checkpoints, the end of the run -----------------------------------------------------

    def checkpoint_parts(self) -> CheckpointParts:
        return CheckpointParts(tensors={"model": trainable_state(self.model)}, optimizers={"policy": self.optimizer_step.checkpointed},
                               state={"sampler": self.sampler.state_dict()})  # fmt: skip

    def restore(self, ckpt: Checkpoint) -> None:
        load_into(self.model, ckpt.tensors["model"])
        self.sampler.load_state_dict(ckpt.state["sampler"])
        self.generator.sync_weights()

    def save_final_model(self) -> None:
        """`final/`: the LoRA adapter (peft) or the whole model (transformers) and the tokenizer. A sharded run
        gathers the weights on rank 0 first (every rank calls this)."""
        final = self.out / "final"
        state = None
        if self.dist.sharded:
            state = full_state(self.model, trainable_only=is_peft(self.model))
            # tied weights (lm_head = embeddings) come back as two tensors: keep the name the model keeps
            own = {n for n, _ in self.model.named_parameters()} | {n for n, _ in self.model.named_buffers()}
            state = {k: v for k, v in state.items() if k in own}
        if self.dist.is_main:
            self.model.save_pretrained(str(final), state_dict=state)
            self.tokenizer.save_pretrained(str(final))

    def progress_postfix(self, record: dict[str, Any]) -> dict[str, str]:
        return {"reward": f"{record.get('reward_mean', math.nan):.3f}",
                "len": f"{record.get('completions/mean_length', math.nan):.1f}"}  # fmt: skip

    # --- one step ----------------------------------------------------------------------------

    def train_step(self) -> dict[str, Any]:
        record = super().train_step()
        tokens = record.get("tokens/generated", 0)
        record["tokens/per_second"] = tokens / max(record[TIME_KEY], 1e-9)
        return record

    def iterate(self, record: dict[str, Any]) -> None:
        record.update(self.generator.settings)
        batch = self.collector.collect(record, self.step)
        if batch is None:
            log.warning("step %d: dynamic sampling kept no group with reward spread; no update", self.step + 1)
            record["skipped_update"] = 1
            return
        values = self.guard.rewards(record, batch.scores.values)  # +-inf -> NaN (left out like None), counted
        batch = replace(batch, scores=replace(batch.scores, values=values))
        # rows (sequences) through the model without / with gradient, and backward calls: the image side's names
        counts = {"nfe_nograd": 0, "nfe_grad": 0, "backward_passes": 0}
        t0 = time.perf_counter()
        prepared = self._prepare(batch, record, counts)
        record["time_logprob_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        self._update(prepared, record, counts)
        record["time_train_s"] = time.perf_counter() - t0
        record.update(counts)
        gen_tokens = int(prepared.rollout.lengths.sum())
        record["tokens/generated"] = gen_tokens
        record["tokens/per_second_generate"] = gen_tokens / max(record["time_rollout_s"], 1e-9)

    def _prepare(self, batch: ScoredBatch, record: dict[str, Any], counts: dict[str, int]) -> PreparedBatch:
        """Advantages, the old / reference log-probs (no grad), mismatch weights, the micro-batch plan."""
        cfg, rollout = self.cfg, batch.rollout
        adv = compute_advantages(group_batch(cfg, self.rewards, batch.scores.values, rollout), cfg.advantage)
        if adv.level != "sample":
            raise ValueError(
                f"advantage estimator '{cfg.advantage.estimator.name}' gives {adv.level}-level "
                f"advantages; the text trainer uses one advantage per completion"
            )
        record.update(adv.metrics)
        record.update(_completion_metrics(rollout))
        N = rollout.num_sequences
        mask = rollout.completion_mask.clone()
        if cfg.generation.mask_truncated:
            mask &= ~rollout.truncated.unsqueeze(1)
        advantages = adv.advantages.reshape(N)
        sample_weight = adv.sample_weight.reshape(N, 1).expand(mask.shape).clone()
        # the order of every pass, fixed up front: the on-policy check needs the first rows trained on
        orders = []
        for it in range(cfg.train.inner_epochs):
            if cfg.train.shuffle:
                g = torch.Generator().manual_seed(cfg.seed * 1_000_003 + self.step * 1009 + it)
                orders.append(torch.randperm(N, generator=g))
            else:
                orders.append(torch.arange(N))

        if self.shared_prompt is None:
            self._decide_shared_prompt(rollout, record, counts)
        shared = bool(self.shared_prompt)
        logp_old = entropy = logp_ref = check_logp = None
        check = cfg.ratio_check.enabled
        corrected = rollout.rollout_logp is not None
        if self._needs_old_logp() or corrected or (check and cfg.ratio_check.rows is None):
            old = self._all_logprobs(self.model, rollout, shared, counts, with_entropy=True)
            logp_old, entropy = old.logp, old.entropy
        if self.use_kl:
            with self.reference() as ref_model:
                logp_ref = self._all_logprobs(ref_model, rollout, shared, counts).logp
        if corrected:
            # the sampler's log-probs against the training forward's, and the importance weights
            record.update(mismatch_metrics(logp_old, rollout.rollout_logp, mask))
            correction = correction_weights(logp_old, rollout.rollout_logp, mask, cfg.rollout_correction)
            record.update(correction.metrics)
            sample_weight = sample_weight * correction.weights
        live = (mask & (sample_weight > 0)).any(1)
        if self._skip_zero_advantage():
            live &= advantages != 0
        plan = [
            [(mini, self._micro_batches(mini, live)) for mini in order.chunk(cfg.train.mini_batches)]
            for order in orders
        ]
        checked_at = torch.full((N,), -1, dtype=torch.long)  # row -> its index in check_rows
        if logp_old is None and check:
            # one update per batch: the loss takes the detached current log-probs as the old ones (as TRL
            # does), and only a few sequences of this rank's first micro-batch are re-scored for the check
            mine = [m for k, m in enumerate(plan[0][0][1]) if k % self.dist.world_size == self.dist.rank]
            check_rows = mine[0][: cfg.ratio_check.rows] if mine else torch.zeros(0, dtype=torch.long)
            with torch.no_grad():
                if check_rows.numel():
                    check_logp = micro_logprobs(
                        self.model, rollout, check_rows, cfg.generation.temperature, shared_prompt=shared
                    ).logp
                for _ in range(self.dist.passes_to_pad(int(check_rows.numel() > 0))):  # sharded: forward together
                    micro_logprobs(self.model, rollout, PAD_ROWS, cfg.generation.temperature, shared_prompt=shared)
            counts["nfe_nograd"] += check_rows.numel()
            checked_at[check_rows] = torch.arange(check_rows.numel())
        dev = self.device
        full = LossInputs(
            logp=torch.zeros(mask.shape, device=dev),
            logp_old=torch.zeros(mask.shape, device=dev) if logp_old is None else logp_old.to(dev),
            advantages=advantages.to(dev),
            mask=mask.to(dev),
            sample_weight=sample_weight.to(dev),
            logp_ref=None if logp_ref is None else logp_ref.to(dev),
        )
        if entropy is not None:
            record["entropy/mean"] = float(entropy[mask].mean()) if bool(mask.any()) else math.nan
        return PreparedBatch(rollout, full, logp_old is not None, entropy, plan, checked_at, check_logp)

    def _update(self, batch: PreparedBatch, record: dict[str, Any], counts: dict[str, int]) -> None:
        """inner_epochs passes x mini_batches optimizer steps; micro-batch k of a mini-batch runs on rank
        k % world_size, gradients are summed over ranks by the optimizer step."""
        cfg, full, shared = self.cfg, batch.full, bool(self.shared_prompt)
        metrics = LossMetrics()
        check = FirstPassCheck(cfg.ratio_check.enabled, cfg.ratio_check.tolerance)
        ent_sum, ent_tokens = 0.0, 0
        on_policy = True  # until the first optimizer step
        self.optimizer_step.begin()
        for it, minis in enumerate(batch.plan):
            for mini, micros in minis:
                norm = LossNormalizer.from_inputs(full.split(mini), const_len=cfg.generation.max_new_tokens)
                mine = [m for k, m in enumerate(micros) if k % self.dist.world_size == self.dist.rank]
                for _ in range(self.dist.passes_to_pad(len(mine))):  # sharded: as many passes as the busiest rank
                    self._padding_pass(batch, norm)
                for micro in mine:
                    # entropy: for the loss (with grad), or as a metric of the first pass when no old pass gave it
                    ent_metric = batch.entropy is None and it == 0
                    scored = micro_logprobs(
                        self.model,
                        batch.rollout,
                        micro,
                        cfg.generation.temperature,
                        with_entropy=bool(cfg.loss.entropy_coef) or ent_metric,
                        entropy_grad=bool(cfg.loss.entropy_coef),
                        shared_prompt=shared,
                    )
                    logp, ent = scored.logp, scored.entropy
                    counts["nfe_grad"] += micro.numel()
                    m = full.mask[micro]
                    if ent_metric:
                        ent_sum += float(ent.detach()[m].sum())
                        ent_tokens += int(m.sum())
                    old = full.logp_old[micro] if batch.have_old else logp.detach()
                    if on_policy and check.enabled:
                        check.observe(*self._first_pass_deviation(logp.detach(), old, m, micro, batch))
                    inputs = replace(
                        full.split(micro), logp=logp, logp_old=old, entropy=ent if cfg.loss.entropy_coef else None
                    )
                    out = policy_loss(inputs, cfg.loss, norm)
                    self.optimizer_step.backward(out.loss)
                    counts["backward_passes"] += 1
                    metrics.add(out.metrics, int(m.sum()))
                self.optimizer_step()
                on_policy = False
        self.generator.sync_weights()
        if self.dist.active:  # every rank's share of the metrics and counts
            metrics = LossMetrics.merged(self.dist.gather_objects([metrics]))
            for key in counts:
                counts[key] = int(self.dist.sum(counts[key]))
            ent_sum, ent_tokens = self.dist.sum(ent_sum), int(self.dist.sum(ent_tokens))
            check.reduce(self.dist)
        if batch.entropy is None and ent_tokens:
            record["entropy/mean"] = ent_sum / ent_tokens
        steps = self.optimizer_step.metrics()
        record.update(metrics.result(int(steps["optimizer_steps"])))
        record.update(steps)
        record["train/shared_prompt"] = int(shared)
        check.report(record, f"step {self.step + 1}", SUSPECTS)

    # --- helpers of the update ------------------------------------------------------------------

    def _padding_pass(self, batch: PreparedBatch, norm: LossNormalizer) -> None:
        """A sharded run's extra forward / backward with a zero loss, so that every rank runs as many passes
        (each gathers the blocks' shards from all ranks)."""
        cfg = self.cfg
        scored = micro_logprobs(
            self.model, batch.rollout, PAD_ROWS, cfg.generation.temperature,
            with_entropy=bool(cfg.loss.entropy_coef), entropy_grad=bool(cfg.loss.entropy_coef),
            shared_prompt=bool(self.shared_prompt),
        )  # fmt: skip
        inputs = replace(
            batch.full.split(PAD_ROWS), logp=scored.logp, logp_old=scored.logp.detach(),
            entropy=scored.entropy if cfg.loss.entropy_coef else None,
        )  # fmt: skip
        self.optimizer_step.backward(policy_loss(inputs, cfg.loss, norm).loss.mul(0.0))

    def _decide_shared_prompt(self, rollout: Rollout, record: dict[str, Any], counts: dict[str, int]) -> None:
        """train.shared_prompt auto: compare the shared-prompt and the plain forward on the first groups of
        the first batch; use the shared one when they agree to a tenth of the ratio-check tolerance, or (the
        sampler's log-probs recorded) when the shared one is no further from the plain one than the plain one
        is from the sampler: in bf16 both paths round differently, as the sampling engine does."""
        G = rollout.group_size
        temperature = self.cfg.generation.temperature
        rows = torch.arange(min(rollout.num_sequences, max(2 * G, 2), self.cfg.train.micro_batch_size))
        shares = torch.unique(rollout.prompt_index[rows]).numel() < rows.numel()
        deviation, floor = math.inf, None
        if shares:  # once per run: the plain and the shared pass
            with torch.no_grad():
                plain = micro_logprobs(self.model, rollout, rows, temperature).logp
            deviation = shared_prompt_deviation(self.model, rollout, rows, temperature, plain=plain)
            floor = sampler_deviation(self.model, rollout, rows, temperature, plain=plain)
            counts["nfe_nograd"] += 2 * rows.numel()
        deviation = self.dist.max(deviation)  # every rank decides the same
        bound = self.cfg.ratio_check.tolerance / 10
        if floor is not None:  # the same on every rank: whether the sampler's log-probs are recorded is config
            floor = self.dist.max(floor)
            record["check/shared_prompt_floor"] = floor
            bound = max(bound, floor)
        self.shared_prompt = deviation <= bound
        record["check/shared_prompt_deviation"] = deviation
        log.info(
            "shared-prompt forward %s (max |log-prob difference| to the plain forward: %.2e; allowed: %.2e)",
            "on" if self.shared_prompt else "off",
            deviation,
            bound,
        )

    def _needs_old_logp(self) -> bool:
        """The loss needs the rollout policy's log-probs: several optimizer steps per generation batch."""
        t = self.cfg.train
        return t.inner_epochs > 1 or t.mini_batches > 1

    def _skip_zero_advantage(self) -> bool:
        """Rows with A = 0 add nothing to the gradient unless a KL / entropy term or a local normaliser is used."""
        return (
            not self.use_kl and not self.cfg.loss.entropy_coef and self.cfg.loss.aggregation.name != "local_token_mean"
        )

    def _micro_batches(self, mini: torch.Tensor, live: torch.Tensor) -> list[torch.Tensor]:
        rows = mini[live[mini]]
        return list(rows.split(self.cfg.train.micro_batch_size)) if rows.numel() else []

    def _all_logprobs(
        self, model: Any, rollout: Rollout, shared: bool, counts: dict[str, int], with_entropy: bool = False
    ) -> TokenLogprobs:
        """No-grad log-probs (and entropies) [N, Tc] of the whole rollout on CPU: row block b of
        `logprob_batch_size` sequences on rank b % world_size, gathered on every rank."""
        size = self.cfg.train.logprob_batch_size or self.cfg.train.micro_batch_size
        N = rollout.num_sequences
        blocks = [torch.arange(s, min(s + size, N)) for s in range(0, N, size)]
        local = []
        mine = self.dist.my_chunks(len(blocks))
        with torch.no_grad():
            for b in mine:
                scored = micro_logprobs(
                    model, rollout, blocks[b], self.cfg.generation.temperature, with_entropy, shared_prompt=shared
                )
                ent = scored.entropy
                local.append((b, scored.logp.cpu(), None if ent is None else ent.cpu()))
            for _ in range(self.dist.passes_to_pad(len(mine))):  # sharded: forward together
                micro_logprobs(model, rollout, PAD_ROWS, self.cfg.generation.temperature, shared_prompt=shared)
        counts["nfe_nograd"] += sum(lp.shape[0] for _, lp, _ in local)
        parts = sorted(self.dist.gather_objects(local), key=lambda item: item[0])
        logp = torch.cat([lp for _, lp, _ in parts])
        return TokenLogprobs(logp, torch.cat([e for _, _, e in parts]) if with_entropy else None)

    @staticmethod
    def _first_pass_deviation(
        logp: torch.Tensor, old: torch.Tensor, m: torch.Tensor, micro: torch.Tensor, batch: PreparedBatch
    ) -> tuple[float, int]:
        """max |ratio - 1| of a micro-batch before any optimizer step, and how many sequences it covered:
        against the old pass when there is one, else against the re-scored check rows."""
        if batch.have_old:
            if not bool(m.any()):
                return 0.0, 0
            return float(((logp - old)[m].exp() - 1).abs().max()), int(m.any(1).sum())
        if batch.check_logp is None:
            return 0.0, 0
        at = batch.checked_at[micro]
        sel = at >= 0
        if not bool(sel.any()):
            return 0.0, 0
        ms = m[sel.to(m.device)]
        diff = logp[sel.to(logp.device)] - batch.check_logp[at[sel]].to(logp.device)
        dev = float((diff[ms].exp() - 1).abs().max()) if bool(ms.any()) else 0.0
        return dev, int(sel.sum())


def _completion_metrics(rollout: Rollout) -> dict[str, float]:
    lengths = rollout.lengths.float()
    done = ~rollout.truncated
    return {
        "completions/mean_length": float(lengths.mean()), "completions/min_length": float(lengths.min()),
        "completions/max_length": float(lengths.max()),
        "completions/clipped_ratio": float(rollout.truncated.float().mean()),
        "completions/mean_terminated_length": float(lengths[done].mean()) if bool(done.any()) else math.nan,
    }  # fmt: skip


def train_text(config: TextConfig, reward_funcs: Optional[Mapping[str, Callable]] = None) -> list[dict[str, Any]]:
    """Build the trainer and run it; returns the metrics records of the steps run."""
    return TextGRPOTrainer(config, reward_funcs).train()
