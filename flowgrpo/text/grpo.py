"""method: grpo - the GRPO family's token-level update of a causal LM (every text preset).

    scored batch -> flowgrpo.core.compute_advantages (any estimator; GDPO reads the K heads)
                 -> old (and reference) token log-probs, no grad, in micro-batches (the old ones only when
                    several optimizer steps use the batch or the sampler's log-probs were recorded; else a
                    few rows re-scored for the on-policy check)
                 -> [rollout-vs-training mismatch: importance weights exp(old - sampler), truncated / masked]
                 -> inner_epochs passes x mini_batches optimizer steps (the shared update loop,
                    flowgrpo.run.update), each with ONE LossNormalizer counted over its whole mini-batch;
                    micro-batch k on rank k % W, gradients summed over ranks
                 -> flowgrpo.core.policy_loss (any preset / parts)

Every forward over completions runs each distinct prompt of its micro-batch once and repeats the prompt's
key/value cache for the completions that share it (`train.shared_prompt`; on the first batch the method checks
that this gives the plain forward's log-probs before using it), except with `train.gradient_checkpointing`,
where each decoder layer recomputes its activations in backward instead.

Inputs some loss parts read besides the log-probs: each row's group (`group_index`; REAL, whose micro-batches then
hold whole groups), the vocabulary mean of the log-softmax under the current and the old policy (ROVER's next-state
term), and, before the advantages, each prompt's drift since its last stored completion (SPO `rho_type: kl`,
flowgrpo/text/drift.py). Padding rows of ragged groups (`Rollout.valid` False) go through no forward.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, replace
from typing import Any, Iterator, Optional

import torch

from ..core import LossInputs, LossNormalizer, compute_advantages, policy_loss
from ..core.conditional import reads_entropy
from ..core.contracts import given
from ..core.losses import BOUNDS, RATIOS, STEP_WEIGHTINGS, SURROGATES
from ..core.regularizers import REGULARIZERS
from ..run.clock import seconds_since
from ..run.ratio_check import FirstPassCheck
from ..run.method import Method
from ..run.update import MiniBatch, MicroLoss, pass_order, run_update
from .collect import ScoredBatch, group_batch
from .drift import CompletionMemory
from .generation import Rollout
from .logprobs import TokenLogprobs, micro_logprobs, sampler_deviation, shared_prompt_deviation
from .methods import METHODS, TextContext
from .rollout_correction import correction_weights, mismatch_metrics
from .step_probe import build_step_probe, reads_step_potentials

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
    vocab_mean_old: Optional[torch.Tensor]  # [N, Tc] ROVER's m_t from the old pass, when read and there was one
    plan: list[list[tuple[torch.Tensor, list[torch.Tensor]]]]  # per pass: (mini-batch rows, its micro-batches)
    checked_at: torch.Tensor  # [N] row -> its index in check_logp (-1: not re-scored)
    check_logp: Optional[torch.Tensor]


@METHODS.register("grpo")
class TextGRPOMethod(Method):
    """Advantages over each prompt's group of completions, then the clipped token-level policy loss."""

    ctx: TextContext

    def __init__(self, ctx: TextContext) -> None:
        super().__init__(ctx)
        cfg = ctx.cfg
        self.use_kl = bool(cfg.loss.kl.coef != 0)
        # Off with gradient checkpointing (the config refuses shared_prompt true with it), and in sharded or ZeRO-3
        # runs: the shared-prompt path runs one or two forwards depending on the rows, and every rank there must
        # run the same number, so those take the plain forward (one per micro-batch)
        configured = None if cfg.train.shared_prompt == "auto" else cfg.train.shared_prompt
        off = cfg.train.gradient_checkpointing or ctx.dist.gathers_weights
        self.shared_prompt: Optional[bool] = False if off else configured
        self.whole_groups = loss_reads(cfg.loss, "group_index")  # REAL: every micro-batch holds whole groups
        self.vocab_mean = loss_reads(cfg.loss, "vocab_mean_logp")  # ROVER's next-state term
        spo_kl = cfg.advantage.estimator.name == "spo" and cfg.advantage.estimator.settings.get("rho_type") == "kl"
        self.memory = CompletionMemory() if spo_kl else None
        self.memory_fresh = True  # not yet used or restored: a resumed run that did not restore it says so

    @staticmethod
    def needs_reference(cfg: Any) -> bool:
        return bool(cfg.loss.kl.coef != 0) or reads_confidence(cfg)

    def update(self, rollout: ScoredBatch, record: dict[str, Any]) -> None:
        # rows (sequences) through the model without / with gradient, and backward calls: the image side's names
        counts = {"nfe_nograd": 0, "nfe_grad": 0, "backward_passes": 0}
        t0 = time.perf_counter()
        prepared = self._prepare(rollout, record, counts)
        record["time_logprob_s"] = seconds_since(t0, self.ctx.device)
        t0 = time.perf_counter()
        self._update(prepared, record, counts)
        record["time_train_s"] = seconds_since(t0, self.ctx.device)
        record.update(counts)
        record["tokens/generated"] = int(prepared.rollout.lengths.sum())

    def _prepare(self, batch: ScoredBatch, record: dict[str, Any], counts: dict[str, int]) -> PreparedBatch:
        """Advantages, the old / reference log-probs (no grad), mismatch weights, the micro-batch plan."""
        ctx, cfg, rollout = self.ctx, self.ctx.cfg, batch.rollout
        if self.shared_prompt is None:
            self._decide_shared_prompt(rollout, record, counts)
        shared = bool(self.shared_prompt)
        groups = replace(group_batch(cfg, ctx.rewards, batch.scores.values, rollout), step=ctx.iteration + 1)
        if ctx.prompt_state is not None:  # the stateful parts: each group's dataset row and the run's prompt table
            ids = rollout.prompt_index.view(groups.num_groups, groups.group_size)[:, 0]
            groups = replace(groups, prompt_ids=ids, prompt_state=ctx.prompt_state)
        if self.memory is not None:  # SPO rho_type kl: each prompt's drift since its stored completion
            if self.memory_fresh and ctx.iteration > 0:
                log.warning(
                    "SPO rho_type kl: resumed without its stored completions (D = 0 at each prompt's next sight)"
                )
            self.memory_fresh = False
            drift = self.memory.drift(rollout, lambda r: self._all_logprobs(ctx.model, r, False, counts).logp)
            groups = replace(groups, drift=drift)
        old = logp_ref = None
        if reads_entropy(cfg.advantage.estimator.name, cfg.advantage.estimator.settings):
            # CANON splits groups by mean token entropy: score the rollout first (the old pass, reused below)
            old = self._all_logprobs(ctx.model, rollout, shared, counts, with_entropy=True, vocab_mean=self.vocab_mean)
            ent, cm = given(old.entropy, "entropy"), rollout.completion_mask
            per_sample = (ent * cm).sum(1) / cm.sum(1).clamp_min(1)
            groups = replace(groups, entropy=per_sample.view(groups.num_groups, groups.group_size))
        if reads_confidence(cfg):
            # ACE: each completion's sequence log-prob under the policy minus under the reference, before the
            # advantages (both passes are reused below)
            if old is None:
                old = self._all_logprobs(ctx.model, rollout, shared, counts, True, self.vocab_mean)
            logp_ref = self._reference_logprobs(rollout, shared, counts)
            cm = rollout.completion_mask
            conf = ((old.logp - logp_ref) * cm).sum(1)
            groups = replace(groups, confidence=conf.view(groups.num_groups, groups.group_size))
        adv = compute_advantages(self._advantage_inputs(groups, rollout, record, counts), cfg.advantage)
        record.update(adv.metrics)
        record.update(_completion_metrics(rollout))
        N = rollout.num_sequences
        mask = rollout.completion_mask.clone()
        if cfg.generation.mask_truncated:
            mask &= ~rollout.truncated.unsqueeze(1)
        advantages = self._action_advantages(adv, rollout)
        # step / token levels weigh [P, G, S]: a completion's steps are all valid or none (the token mask is the mask's)
        weight = adv.sample_weight.amax(-1) if adv.sample_weight.dim() > 2 else adv.sample_weight
        sample_weight = weight.reshape(N, 1).expand(mask.shape).clone()
        # the order of every pass, fixed up front: the on-policy check needs the first rows trained on
        minis = [self._mini_batches(N, rollout.group_size, it) for it in range(cfg.train.inner_epochs)]

        logp_old = entropy = check_logp = None
        check = cfg.ratio_check.enabled
        corrected = rollout.rollout_logp is not None
        if old is not None or self._needs_old_logp() or corrected or (check and cfg.ratio_check.rows is None):
            if old is None:
                old = self._all_logprobs(ctx.model, rollout, shared, counts, True, self.vocab_mean)
            logp_old, entropy = old.logp, old.entropy
        if self.use_kl and logp_ref is None:
            logp_ref = self._reference_logprobs(rollout, shared, counts)
        if corrected:
            # the sampler's log-probs against the training forward's, and the importance weights
            record.update(mismatch_metrics(logp_old, rollout.rollout_logp, mask))
            correction = correction_weights(logp_old, rollout.rollout_logp, mask, cfg.rollout_correction)
            record.update(correction.metrics)
            sample_weight = sample_weight * correction.weights
        live = (mask & (sample_weight > 0)).any(1)
        if self._skip_zero_advantage():
            live &= (advantages != 0).reshape(N, -1).any(1)
        G = rollout.group_size
        plan = [[(mini, self._micro_batches(mini, live, G)) for mini in chunks] for chunks in minis]
        checked_at = torch.full((N,), -1, dtype=torch.long)  # row -> its index in check_rows
        if logp_old is None and check:
            # one update per batch: the loss takes the detached current log-probs as the old ones (as TRL
            # does), and only a few sequences of this rank's first micro-batch are re-scored for the check
            mine = [m for k, m in enumerate(plan[0][0][1]) if k % ctx.dist.world_size == ctx.dist.rank]
            check_rows = mine[0][: cfg.ratio_check.rows] if mine else torch.zeros(0, dtype=torch.long)
            with torch.no_grad():
                if check_rows.numel():
                    check_logp = micro_logprobs(
                        ctx.model, rollout, check_rows, cfg.generation.temperature, shared_prompt=shared
                    ).logp
                for _ in range(ctx.dist.passes_to_pad(int(check_rows.numel() > 0))):  # sharded: forward together
                    micro_logprobs(ctx.model, rollout, PAD_ROWS, cfg.generation.temperature, shared_prompt=shared)
            counts["nfe_nograd"] += check_rows.numel()
            checked_at[check_rows] = torch.arange(check_rows.numel())
        dev = ctx.device
        full = LossInputs(
            logp=torch.zeros(mask.shape, device=dev),
            logp_old=torch.zeros(mask.shape, device=dev) if logp_old is None else logp_old.to(dev),
            advantages=advantages.to(dev),
            mask=mask.to(dev),
            sample_weight=sample_weight.to(dev),
            logp_ref=None if logp_ref is None or not self.use_kl else logp_ref.to(dev),
            group_index=(torch.arange(N) // rollout.group_size).to(dev) if self.whole_groups else None,
        )
        if entropy is not None:
            record["entropy/mean"] = float(entropy[mask].mean()) if bool(mask.any()) else math.nan
        vocab_mean_old = None if old is None or old.vocab_mean is None else old.vocab_mean.to(dev)
        return PreparedBatch(rollout, full, logp_old is not None, entropy, vocab_mean_old, plan, checked_at, check_logp)

    def _advantage_inputs(self, groups: Any, rollout: Any, record: dict[str, Any], counts: dict[str, int]) -> Any:
        """The estimator's input; a method that feeds more (a critic's values) extends it. SPAE: + each completion's
        step potentials from the probes (flowgrpo/text/step_probe.py)."""
        if not reads_step_potentials(self.ctx.cfg):
            return groups
        self.step_probe = getattr(self, "step_probe", None) or build_step_probe(self.ctx)
        return self.step_probe.inputs(groups, rollout, record, counts)

    def _action_advantages(self, adv: Any, rollout: Any) -> torch.Tensor:
        """Advantages per completion [N] (or per token [N, T] where a method maps finer levels onto tokens)."""
        if adv.level == "step" and reads_step_potentials(self.ctx.cfg):  # SPAE: each token its step's advantage
            return self.step_probe.token_advantages(adv, rollout)
        if adv.level != "sample":
            raise ValueError(
                f"advantage estimator '{self.ctx.cfg.advantage.estimator.name}' gives {adv.level}-level "
                f"advantages; method grpo uses one advantage per completion"
            )
        return adv.advantages.reshape(rollout.num_sequences)

    def checkpoint_parts(self, parts: Any) -> None:
        if self.memory is not None:  # SPO rho_type kl: the stored completions, exact (tensors)
            parts.tensors["spo_completions"] = self.memory.state_dict()

    def restore(self, ckpt: Any) -> None:
        if self.memory is not None:
            if "spo_completions" not in ckpt.tensors:
                raise ValueError(
                    "resume: the checkpoint has no SPO completion memory (it was written without rho_type kl)"
                )
            self.memory.load_state_dict(ckpt.tensors["spo_completions"])
            self.memory_fresh = False

    def _update(self, batch: PreparedBatch, record: dict[str, Any], counts: dict[str, int]) -> None:
        """The shared update loop over the prepared plan; micro-batch k of a mini-batch runs on rank
        k % world_size, gradients are summed over ranks by the optimizer step."""
        ctx, cfg, full, shared = self.ctx, self.ctx.cfg, batch.full, bool(self.shared_prompt)
        dist = ctx.dist
        entropy = {"sum": 0.0, "tokens": 0}

        def passes() -> Iterator[Iterator[MiniBatch]]:
            for it, minis in enumerate(batch.plan):
                yield (
                    MiniBatch(
                        [(it, m) for k, m in enumerate(micros) if k % dist.world_size == dist.rank],
                        LossNormalizer.from_inputs(full.split(mini), const_len=cfg.generation.max_new_tokens),
                    )
                    for mini, micros in minis
                )

        def micro_loss(item: tuple[int, torch.Tensor], norm: LossNormalizer, on_policy: bool) -> MicroLoss:
            it, micro = item
            # entropy: for the loss (with grad), or as a metric of the first pass when no old pass gave it
            ent_metric = batch.entropy is None and it == 0
            scored = micro_logprobs(
                ctx.model,
                batch.rollout,
                micro,
                cfg.generation.temperature,
                with_entropy=bool(cfg.loss.entropy_coef) or ent_metric,
                entropy_grad=bool(cfg.loss.entropy_coef),
                shared_prompt=shared,
                with_vocab_mean=self.vocab_mean,
            )
            logp, ent = scored.logp, scored.entropy
            counts["nfe_grad"] += micro.numel()
            m = full.mask[micro]
            if ent_metric:
                entropy["sum"] += float(ent.detach()[m].sum())
                entropy["tokens"] += int(m.sum())
            old = full.logp_old[micro] if batch.have_old else logp.detach()
            dev = None
            if on_policy and cfg.ratio_check.enabled:
                dev = self._first_pass_deviation(logp.detach(), old, m, micro, batch)
            inputs = replace(full.split(micro), logp=logp, logp_old=old, entropy=ent if cfg.loss.entropy_coef else None)
            if self.vocab_mean:  # one update per batch: the old pass is these weights, the next-state term 0
                now = given(scored.vocab_mean, "vocab_mean")
                was = batch.vocab_mean_old[micro] if batch.have_old and batch.vocab_mean_old is not None else now
                inputs = replace(inputs, vocab_mean_logp=now, vocab_mean_logp_old=was)
            out = policy_loss(inputs, cfg.loss, norm)
            return MicroLoss(out.loss, out.metrics, int(m.sum()), dev)

        check = FirstPassCheck(cfg.ratio_check.enabled, cfg.ratio_check.tolerance)
        result = run_update(
            passes(), micro_loss, lambda norm: self._padding_loss(batch, norm), ctx.optimizer_step, dist, check
        )
        counts["backward_passes"] += result.backward_passes
        ent_sum, ent_tokens = entropy["sum"], entropy["tokens"]
        if dist.active:  # every rank's share of the counts
            for key in counts:
                counts[key] = int(dist.sum(counts[key]))
            ent_sum, ent_tokens = dist.sum(ent_sum), int(dist.sum(ent_tokens))
        if batch.entropy is None and ent_tokens:
            record["entropy/mean"] = ent_sum / ent_tokens
        record.update(result.metrics.result(len(ctx.optimizer_step.norms)))
        record["train/shared_prompt"] = int(shared)
        check.report(record, f"step {ctx.iteration + 1}", SUSPECTS)

    # --- helpers of the update ------------------------------------------------------------------

    def _padding_loss(self, batch: PreparedBatch, norm: LossNormalizer) -> torch.Tensor:
        """A sharded run's extra forward / backward (the loop zeroes its loss), so that every rank runs as many
        passes (each gathers the blocks' shards from all ranks)."""
        cfg = self.ctx.cfg
        scored = micro_logprobs(
            self.ctx.model, batch.rollout, PAD_ROWS, cfg.generation.temperature,
            with_entropy=bool(cfg.loss.entropy_coef), entropy_grad=bool(cfg.loss.entropy_coef),
            shared_prompt=bool(self.shared_prompt), with_vocab_mean=self.vocab_mean,
        )  # fmt: skip
        inputs = replace(
            batch.full.split(PAD_ROWS), logp=scored.logp, logp_old=scored.logp.detach(),
            entropy=scored.entropy if cfg.loss.entropy_coef else None,
            vocab_mean_logp=scored.vocab_mean, vocab_mean_logp_old=scored.vocab_mean,
        )  # fmt: skip
        return policy_loss(inputs, cfg.loss, norm).loss

    def _decide_shared_prompt(self, rollout: Rollout, record: dict[str, Any], counts: dict[str, int]) -> None:
        """train.shared_prompt auto: compare the shared-prompt and the plain forward on the first groups of
        the first batch; use the shared one when they agree to a tenth of the ratio-check tolerance, or (the
        sampler's log-probs recorded) when the shared one is no further from the plain one than the plain one
        is from the sampler: in bf16 both paths round differently, as the sampling engine does."""
        G = rollout.group_size
        temperature = self.ctx.cfg.generation.temperature
        rows = torch.arange(min(rollout.num_sequences, max(2 * G, 2), self.ctx.cfg.train.micro_batch_size))
        shares = torch.unique(rollout.prompt_index[rows]).numel() < rows.numel()
        deviation, floor = math.inf, None
        if shares:  # once per run: the plain and the shared pass
            with torch.no_grad():
                plain = micro_logprobs(self.ctx.model, rollout, rows, temperature).logp
            deviation = shared_prompt_deviation(self.ctx.model, rollout, rows, temperature, plain=plain)
            floor = sampler_deviation(self.ctx.model, rollout, rows, temperature, plain=plain)
            counts["nfe_nograd"] += 2 * rows.numel()
        deviation = self.ctx.dist.max(deviation)  # every rank decides the same
        bound = self.ctx.cfg.ratio_check.tolerance / 10
        if floor is not None:  # the same on every rank: whether the sampler's log-probs are recorded is config
            floor = self.ctx.dist.max(floor)
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

    def _reference_logprobs(self, rollout: Rollout, shared: bool, counts: dict[str, int]) -> torch.Tensor:
        ref = self.ctx.reference
        assert ref is not None
        with ref() as ref_model:
            return self._all_logprobs(ref_model, rollout, shared, counts).logp

    def _needs_old_logp(self) -> bool:
        """The loss needs the rollout policy's log-probs: several optimizer steps per generation batch."""
        t = self.ctx.cfg.train
        return t.inner_epochs > 1 or t.mini_batches > 1

    def _skip_zero_advantage(self) -> bool:
        """Rows with A = 0 add nothing to the gradient unless a KL / entropy term or a local normaliser is used."""
        return (
            not self.use_kl
            and not self.ctx.cfg.loss.entropy_coef
            and self.ctx.cfg.loss.aggregation.name != "local_token_mean"
        )

    def _mini_batches(self, N: int, G: int, epoch: int) -> list[torch.Tensor]:
        """The rows of each mini-batch of pass `epoch`, in training order (seeded); whole groups when the loss reads
        them (the groups' order is then the seeded one, each group's rows in order)."""
        cfg, it = self.ctx.cfg, self.ctx.iteration
        if not self.whole_groups:
            return list(pass_order(N, cfg.seed, it, epoch, cfg.train.shuffle).chunk(cfg.train.mini_batches))
        order = pass_order(N // G, cfg.seed, it, epoch, cfg.train.shuffle)
        return [(g.unsqueeze(1) * G + torch.arange(G)).reshape(-1) for g in order.chunk(cfg.train.mini_batches)]

    def _micro_batches(self, mini: torch.Tensor, live: torch.Tensor, G: int) -> list[torch.Tensor]:
        """The live rows of a mini-batch in micro-batches of `micro_batch_size` rows; whole groups when the loss
        reads them (as many whole groups as fit, at least one)."""
        rows, size = mini[live[mini]], self.ctx.cfg.train.micro_batch_size
        if not rows.numel():
            return []
        if not self.whole_groups:
            return list(rows.split(size))
        _, counts = torch.unique_consecutive(rows // G, return_counts=True)
        micros: list[list[torch.Tensor]] = [[]]
        for group in rows.split(counts.tolist()):
            if micros[-1] and sum(g.numel() for g in micros[-1]) + group.numel() > size:
                micros.append([])
            micros[-1].append(group)
        return [torch.cat(m) for m in micros]

    def _all_logprobs(
        self,
        model: Any,
        rollout: Rollout,
        shared: bool,
        counts: dict[str, int],
        with_entropy: bool = False,
        vocab_mean: bool = False,
    ) -> TokenLogprobs:
        """No-grad log-probs (and entropies, ROVER's vocabulary means) [N, Tc] of the whole rollout on CPU: row
        block b of `logprob_batch_size` real sequences on rank b % world_size, gathered on every rank; the padding
        rows of ragged groups (`valid` False) are not run and read 0."""
        size = self.ctx.cfg.train.logprob_batch_size or self.ctx.cfg.train.micro_batch_size
        N, Tc = rollout.num_sequences, rollout.completion_ids.shape[1]
        real = torch.arange(N) if rollout.valid is None else rollout.valid.nonzero()[:, 0]
        blocks = list(real.split(size))
        local: list[tuple[int, torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]] = []
        mine = self.ctx.dist.my_chunks(len(blocks))
        temperature = self.ctx.cfg.generation.temperature
        with torch.no_grad():
            for b in mine:
                scored = micro_logprobs(
                    model,
                    rollout,
                    blocks[b],
                    temperature,
                    with_entropy,
                    shared_prompt=shared,
                    with_vocab_mean=vocab_mean,
                )
                ent, vm = scored.entropy, scored.vocab_mean
                local.append(
                    (b, scored.logp.cpu(), None if ent is None else ent.cpu(), None if vm is None else vm.cpu())
                )
            for _ in range(self.ctx.dist.passes_to_pad(len(mine))):  # sharded: forward together
                micro_logprobs(model, rollout, PAD_ROWS, temperature, shared_prompt=shared)
        counts["nfe_nograd"] += sum(item[1].shape[0] for item in local)
        parts = sorted(self.ctx.dist.gather_objects(local), key=lambda item: item[0])

        def full(k: int) -> Optional[torch.Tensor]:
            if not parts or parts[0][k] is None:
                return None
            out = torch.zeros(N, Tc, dtype=parts[0][k].dtype)
            out[real] = torch.cat([item[k] for item in parts])
            return out

        logp = full(1)
        return TokenLogprobs(torch.zeros(N, Tc) if logp is None else logp, full(2), full(3))

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


def reads_confidence(cfg: Any) -> bool:
    """ACE's transform reads each completion's policy-minus-reference sequence log-prob (GroupBatch.confidence)."""
    return any(t.name == "ace" for t in cfg.advantage.transforms)


def _completion_metrics(rollout: Rollout) -> dict[str, float]:
    """Lengths of the real completions (a ragged group's padding rows are none)."""
    real = torch.ones(rollout.num_sequences, dtype=torch.bool) if rollout.valid is None else rollout.valid
    lengths = rollout.lengths[real].float()
    done = ~rollout.truncated[real]
    return {
        "completions/mean_length": float(lengths.mean()), "completions/min_length": float(lengths.min()),
        "completions/max_length": float(lengths.max()),
        "completions/clipped_ratio": float((~done).float().mean()),
        "completions/mean_terminated_length": float(lengths[done].mean()) if bool(done.any()) else math.nan,
    }  # fmt: skip


def loss_reads(loss: Any, name: str) -> bool:
    """Whether a part of the configured loss reads the optional LossInputs field `name` (its `requires`)."""
    entries = [
        RATIOS.get(loss.ratio.name), BOUNDS.get(loss.bounds.name), SURROGATES.get(loss.surrogate.name),
        STEP_WEIGHTINGS.get(loss.step_weighting.name), REGULARIZERS.get(loss.regularizer.name),
    ]  # fmt: skip
    return any(name in e.requires for e in entries)
