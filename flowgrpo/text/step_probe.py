"""SPAE's step probes for the text trainer: each completion's step potentials, and step advantages on its tokens.

flowgrpo/core/spae.py holds the maths (source: cii030/SPAE-RL inference/probe_mechanism_example.py @ 1f8c839). For
each completion of a rollout:

    step ends     core.spae.step_ends over its tokens: a token whose text ends with the estimator's `boundary`
                  (".\\n\\n"), before the token `think_end`; a completion without one is one step ending at its
                  last token (ours: it keeps its outcome advantage instead of none)
    probe k       prompt + completion[: end_k + 1] + `probe_suffix`, then the gold answer's K tokens read in one
                  of two ways (no grad; `probe_batch_size` sequences at a time, blocks split over ranks, counted in
                  nfe_nograd) -> core.spae.probe_scores -> step_potential -> `step_rewards` [P, G, S], `step_mask`

and after the estimator, each token takes its step's advantage (core.spae.token_steps: tokens after the last end
take the last step's).

The reading of a probe:
- `probe_samples: 0` (the default): **teacher-forced** (◐, ours). One forward over prefix + gold answer
  (flowgrpo.text.logprobs.micro_logprobs): at position k, with the gold answer's first k tokens as context, gold
  token k's log-prob and the entropy of the full distribution at temperature 1. One deterministic continuation
  (N = 1): the source's reading whenever a sample reproduces the gold answer, which a confident correct step does at
  temperature 0.6. A probe costs one forward row, no generation.
- `probe_samples: N`: **the source's**. N continuations of each prefix sampled by transformers `generate` (at
  `probe_temperature` 0.6, `probe_max_tokens` 10, seeded by the run seed, iteration and block); at each sampled
  position t < K, with the sampled tokens before t as context, gold token t's log-prob if it is among the top 20
  (else -10) and the top 20's unnormalised entropy (`GoldReader`), over min(K, the continuation's length)
  positions. The source reads vLLM's top-20 log-probs; whether those are before or after the temperature depends on
  vLLM's version (◐): here before (the model's own distribution). The generation runs on the policy itself, not on
  a vLLM engine.

Both: the source re-tokenises the decoded prefix + suffix; here the prefix keeps its sampled tokens and the suffix
and the answer are tokenised on their own.

Gold answers come from the data rows: `answer_column` (None: the built-in task's own, GOLD_COLUMNS; `answer` for a
JSONL file), read through answers.reference_answer (GSM8K's "####", a \\boxed{}).
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any, Optional

import numpy as np
import torch
from torch import Tensor

from ..core.advantages import ESTIMATORS
from ..core.contracts import AdvantageResult, GroupBatch
from ..core.spae import probe_scores, step_ends, step_potential, token_steps
from .answers import reference_answer
from .generation import Rollout, eos_token_ids, left_pad, seeded
from .logprobs import micro_logprobs

log = logging.getLogger(__name__)

GOLD_COLUMNS = {"arithmetic": "answer", "pattern": "target", "echo": "reference"}  # built-in task -> its answers
PAD_ROW = torch.zeros(1, dtype=torch.long)


def reads_step_potentials(cfg: Any) -> bool:
    """The configured estimator reads SPAE's step potentials (`spae`)."""
    return cfg.advantage.estimator.name == "spae"


def build_step_probe(ctx: Any) -> "StepProbe":
    """The probe of a method's context: the policy's tokenizer and the data rows (their gold answers)."""
    return StepProbe(ctx, ctx.tokenizer, ctx.data.rows)


class GoldReader:
    """A logits processor that reads, at each sampled position t, what the source reads from vLLM's top-20
    log-probs: gold token t's log-prob when it is among the top 20 (else -10) and the top 20's entropy, unnormalised
    (the source's `entropy_from_logprob_dict`), from the model's logits before temperature (transformers runs user
    processors before its warpers, as SampledLogprobRecorder relies on). Position t counts where t < K and the
    continuation has not ended before t (the source reads min(K, its length) positions)."""

    TOP, MISSING = 20, -10.0

    def __init__(self, gold: Tensor, lengths: Tensor, eos_ids: list[int]) -> None:
        self.gold, self.lengths, self.eos = gold, lengths, torch.tensor(eos_ids)
        self.lp = torch.zeros(gold.shape, dtype=torch.float64)
        self.entropy = torch.zeros(gold.shape, dtype=torch.float64)
        self.valid = torch.zeros(gold.shape, dtype=torch.bool)
        self.done = torch.zeros(gold.shape[0], dtype=torch.bool)
        self.t = 0

    def __call__(self, input_ids: Tensor, scores: Tensor) -> Tensor:
        t, self.t = self.t, self.t + 1
        if t > 0:  # the last input token was sampled at t - 1
            self.done |= torch.isin(input_ids[:, -1].cpu(), self.eos)
        if t < self.gold.shape[1]:
            logp = torch.log_softmax(scores.double(), -1)
            top, idx = logp.topk(min(self.TOP, logp.shape[-1]), -1)
            gold = self.gold[:, t].to(logp.device).unsqueeze(1)
            hit = (idx == gold).any(-1)
            self.lp[:, t] = torch.where(hit, logp.gather(1, gold).squeeze(1), self.MISSING).cpu()
            self.entropy[:, t] = (-(top.exp() * top).sum(-1)).cpu()
            self.valid[:, t] = (t < self.lengths) & ~self.done
        return scores


class StepProbe:
    """SPAE's probes over a rollout (`inputs`) and the step advantages spread over tokens (`token_advantages`)."""

    def __init__(self, ctx: Any, tokenizer: Any, rows: list[dict[str, Any]]) -> None:
        cfg = ctx.cfg
        settings = {**ESTIMATORS.get("spae").settings, **cfg.advantage.estimator.settings}
        if not settings["boundary"]:
            raise ValueError("advantage.estimator.boundary: the step boundary text must not be empty")
        if settings["probe_batch_size"] < 0:
            raise ValueError(f"advantage.estimator.probe_batch_size must be >= 0, got {settings['probe_batch_size']}")
        self.ctx, self.tokenizer, self.boundary = ctx, tokenizer, settings["boundary"]
        self.samples, self.temperature = settings["probe_samples"], settings["probe_temperature"]
        # sequences per forward (teacher-forced) or per generate call (sampled: N per probe)
        default = (
            cfg.generation.batch_size if self.samples else cfg.train.logprob_batch_size or cfg.train.micro_batch_size
        )
        self.batch_size = settings["probe_batch_size"] or default
        self.max_tokens = settings["probe_max_tokens"]
        # (their bounds are checked at config load: flowgrpo/core/config.py)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.eos_ids = eos_token_ids(ctx.model, tokenizer)
        self.suffix = tokenizer.encode(settings["probe_suffix"], add_special_tokens=False)
        think = tokenizer.encode(settings["think_end"], add_special_tokens=False) if settings["think_end"] else []
        self.think_end: Optional[int] = think[0] if len(think) == 1 else None
        if think and self.think_end is None:
            log.info("SPAE: think_end %r is not one token of this tokenizer: steps run to each completion's end",
                     settings["think_end"])  # fmt: skip
        self.gold = self._gold_answers(cfg, rows, settings["answer_column"])
        self._boundary_ids: dict[int, bool] = {}
        self._ends: Optional[tuple[Rollout, list[list[int]]]] = None

    @staticmethod
    def _gold_answers(cfg: Any, rows: list[dict[str, Any]], column: Optional[str]) -> list[Optional[str]]:
        task = cfg.data.task.name if cfg.data.task is not None else None
        if column is None:
            if task is not None and task not in GOLD_COLUMNS:
                raise ValueError(
                    f"SPAE's probe needs gold answers; data.task '{task}' has none (tasks with them: "
                    f"{sorted(GOLD_COLUMNS)}), or name its column in advantage.estimator.answer_column"
                )
            column = GOLD_COLUMNS[task] if task is not None else "answer"
        missing = next((i for i, row in enumerate(rows) if row.get(column) in (None, "")), None)
        if missing is not None:
            raise ValueError(
                f"SPAE's probe needs a gold answer in every data row: row {missing} has no '{column}' "
                f"(advantage.estimator.answer_column; the built-in tasks' columns: {GOLD_COLUMNS})"
            )
        return [reference_answer(str(row[column])) for row in rows]

    # --- steps ---------------------------------------------------------------------------------------

    def _is_boundary(self, tok: int) -> bool:
        if tok not in self._boundary_ids:
            self._boundary_ids[tok] = self.tokenizer.decode([tok]).endswith(self.boundary)
        return self._boundary_ids[tok]

    def ends(self, rollout: Rollout) -> list[list[int]]:
        """Each row's step ends (token indices in its completion; [] for a padding row or an empty completion)."""
        if self._ends is not None and self._ends[0] is rollout:
            return self._ends[1]
        out = []
        real = rollout.valid if rollout.valid is not None else torch.ones(rollout.num_sequences, dtype=torch.bool)
        for ids, n, ok in zip(rollout.completion_ids.tolist(), rollout.lengths.tolist(), real.tolist()):
            tokens = ids[:n] if ok else []
            boundaries = {t for t in set(tokens) if self._is_boundary(t)}
            out.append(step_ends(tokens, boundaries, self.think_end) or ([n - 1] if tokens else []))
        self._ends = (rollout, out)
        return out

    # --- the probes ----------------------------------------------------------------------------------

    def inputs(self, groups: GroupBatch, rollout: Rollout, record: dict[str, Any], counts: dict[str, int]) -> Any:
        """`groups` with the step potentials (`step_rewards` [P, G, S], `step_mask`) of every completion."""
        ends = self.ends(rollout)
        prefixes, golds, where = [], [], []
        for n, row_ends in enumerate(ends):
            prompt = rollout.prompt_ids[n][rollout.prompt_mask[n].bool()].tolist()
            completion = rollout.completion_ids[n].tolist()
            gold = self.tokenizer.encode(self.gold[int(rollout.prompt_index[n])], add_special_tokens=False)
            for k, end in enumerate(row_ends):
                prefixes.append(prompt + completion[: end + 1] + self.suffix)
                golds.append(gold)
                where.append((n, k))
        N, S = rollout.num_sequences, max([len(e) for e in ends] + [1])
        phi, mask = torch.zeros(N, S, dtype=torch.float64), torch.zeros(N, S, dtype=torch.bool)
        if prefixes:
            potentials = self._potentials(self._probe_rollout(prefixes, golds, self.pad_id), counts)
            rows, steps = torch.tensor(where).T
            phi[rows, steps], mask[rows, steps] = potentials, True
        record["spae/steps_mean"] = float(mask.sum(1).float()[mask.any(1)].mean()) if bool(mask.any()) else 0.0
        record["spae/potential_mean"] = float(phi[mask].mean()) if bool(mask.any()) else 0.0
        P, G = groups.num_groups, groups.group_size
        return replace(groups, step_rewards=phi.view(P, G, S), step_mask=mask.view(P, G, S))

    @staticmethod
    def _probe_rollout(prefixes: list[list[int]], golds: list[list[int]], pad_id: int) -> Rollout:
        """The probes as a rollout: each prefix a prompt, its gold answer the completion (teacher-forced)."""
        prompt_ids, prompt_mask = left_pad(prefixes, pad_id)
        width = max(len(g) for g in golds)
        gold_ids = torch.full((len(golds), width), pad_id, dtype=torch.long)
        for i, g in enumerate(golds):
            gold_ids[i, : len(g)] = torch.as_tensor(g, dtype=torch.long)
        lengths = torch.tensor([len(g) for g in golds])
        gold_mask = torch.arange(width).unsqueeze(0) < lengths.unsqueeze(1)
        R = len(golds)
        return Rollout(
            prompt_ids, prompt_mask, gold_ids, gold_mask, torch.zeros(R, dtype=torch.bool), torch.arange(R), 1
        )

    def _potentials(self, probes: Rollout, counts: dict[str, int]) -> Tensor:
        """Phi of every probe row, from the gold tokens' log-probs and entropies (teacher-forced or sampled, no grad):
        blocks of rows split over ranks, gathered in order."""
        ctx, N = self.ctx, self.samples
        blocks = list(torch.arange(probes.num_sequences).split(max(1, self.batch_size // max(N, 1))))
        mine = ctx.dist.my_chunks(len(blocks))
        local = []
        with torch.no_grad():
            for b in mine:
                lp, H, valid = self._sampled(probes, blocks[b], b) if N else self._forced(probes, blocks[b])
                local.append((b, step_potential(*probe_scores(lp, H, valid))))
                counts["nfe_nograd"] += lp.shape[0] * lp.shape[1]  # probe sequences (x N continuations)
            for _ in range(ctx.dist.passes_to_pad(len(mine))):  # sharded: every rank runs as many passes
                self._sampled(probes, PAD_ROW, -1) if N else micro_logprobs(ctx.model, probes, PAD_ROW, 1.0)
        parts = sorted(ctx.dist.gather_objects(local), key=lambda item: item[0])
        return torch.cat([p[1] for p in parts])

    def _forced(self, probes: Rollout, rows: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """[n, 1, K] gold log-probs, entropies and positions: one forward over prefix + gold answer (N = 1)."""
        scored = micro_logprobs(self.ctx.model, probes, rows, 1.0, with_entropy=True, entropy_grad=False)
        valid = probes.completion_mask[rows]
        K = valid.shape[1]
        ent = scored.entropy
        assert ent is not None
        return scored.logp[:, :K].cpu().unsqueeze(1), ent[:, :K].cpu().unsqueeze(1), valid.unsqueeze(1)

    def _sampled(self, probes: Rollout, rows: Tensor, block: int) -> tuple[Tensor, Tensor, Tensor]:
        """[n, N, K] as the source reads them: N continuations of each prefix sampled by transformers `generate` at
        `probe_temperature`, `probe_max_tokens` long, seeded by (run seed, iteration, block); `GoldReader` reads the
        model's logits at each sampled position."""
        from transformers import GenerationConfig as HFGenerationConfig, LogitsProcessorList

        model, N, pad = self.ctx.model, self.samples, self.pad_id
        device = next(model.parameters()).device
        n, K = rows.numel(), probes.completion_ids.shape[1]
        reader = GoldReader(
            probes.completion_ids[rows].repeat_interleave(N, 0),
            probes.completion_mask[rows].sum(1).repeat_interleave(N),
            self.eos_ids,
        )
        config = HFGenerationConfig(
            do_sample=True, temperature=self.temperature, top_p=1.0, top_k=0, max_new_tokens=self.max_tokens,
            num_return_sequences=N, eos_token_id=self.eos_ids, pad_token_id=pad, use_cache=True,
        )  # fmt: skip
        seed = int(np.random.SeedSequence([self.ctx.cfg.seed, self.ctx.iteration, block + 1]).generate_state(1)[0])
        with seeded(seed, device):
            model.generate(
                input_ids=probes.prompt_ids[rows].to(device),
                attention_mask=probes.prompt_mask[rows].to(device),
                generation_config=config,
                logits_processor=LogitsProcessorList([reader]),
                synced_gpus=self.ctx.dist.gathers_weights,
            )
        return reader.lp.view(n, N, K), reader.entropy.view(n, N, K), reader.valid.view(n, N, K)

    # --- after the estimator -------------------------------------------------------------------------

    def token_advantages(self, adv: AdvantageResult, rollout: Rollout) -> Tensor:
        """Step advantages [P, G, S] -> per token [N, Tc] (token j takes the advantage of its step M(j)); the"""
        N, Tc = rollout.num_sequences, rollout.completion_ids.shape[1]
        step_adv = adv.advantages.reshape(N, -1)
        out = torch.stack([step_adv[n, token_steps(Tc, e)] for n, e in enumerate(self.ends(rollout))])
        return out
