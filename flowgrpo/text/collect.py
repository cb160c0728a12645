"""The text trainer's rollout phase: generate P x G completions, score them, and (DAPO) refill the batch.

Chunk c of a step's prompts is sampled with its own seed and scored on rank c % world_size; every rank
gets the whole batch back in chunk order. With `rollout_split: k` each chunk is sampled as k parts
(G / k completions of each of its prompts, each part its own seed and rank), joined back into whole groups. With dynamic sampling, groups whose rewards do not vary are
dropped and more prompts are generated, for a bounded number of extra rounds. With `prompt_sampling: knapsack`
(Knapsack RL, flowgrpo/core/knapsack.py) prompt i gets its own budget N_i from the prompt table (the same on every
rank), is sampled as a chunk of its own, and its group is padded to the step's largest N_i with masked rows
(`Rollout.valid`, NaN rewards), so every estimator normalises each prompt within its own N_i samples. With T-PPO's
`critic.window` the step's rows are windows of carried-over streams instead (flowgrpo/text/windows.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Any, Callable, Optional, Sequence

import numpy as np
import torch

from ..core import GroupBatch
from ..core.contracts import given
from ..core.knapsack import check_budget_settings, knapsack_budgets
from ..core.prompt_state import BUDGET_SAMPLERS, PromptTable
from ..core.stats import masked_std
from ..distributed import Distributed
from ..run.prompts import PromptSampler
from .config import TextConfig
from .data import PromptData
from .generation import Rollout, prompts_per_call
from .reward_functions import RewardFunction, RewardScores, score_completions
from .windows import Windows


@dataclass
class ScoredBatch:
    """The groups a training step trains on, with their rewards."""

    rollout: Rollout
    scores: RewardScores


def group_batch(
    cfg: TextConfig, rewards: Sequence[RewardFunction], values: torch.Tensor, rollout: Rollout
) -> GroupBatch:
    """Rewards [N, K] of a rollout as flowgrpo.core's groups [P, G, K] (with lengths for length-aware estimators)."""
    G = rollout.group_size
    P = values.shape[0] // G
    return GroupBatch(
        rewards=values.view(P, G, -1),
        reward_weights=[r.weight for r in rewards],
        reward_names=[r.name for r in rewards],
        lengths=rollout.lengths.view(P, G).float(),
        head_nan_policy=cfg.advantage.head_nan_policy,
        valid=None if rollout.valid is None else rollout.valid.view(P, G),
    )


def whole_groups(chunk_sizes: Sequence[int], k: int, G: int) -> torch.Tensor:
    """Row order that joins split parts into whole groups: parts arrive chunk by chunk, part by part, each
    [prompts of its chunk x G / k]; the result is [prompt x G] with part q's samples at q * G / k."""
    g, rows, start = G // k, [], 0
    for n in chunk_sizes:
        rows += [start + q * n * g + j * g + r for j in range(n) for q in range(k) for r in range(g)]
        start += n * G
    return torch.tensor(rows, dtype=torch.long)


def _nan_rows(values: torch.Tensor, rows: int) -> torch.Tensor:
    """values [n, K] grown to [rows, K] with NaN rows (padding of a ragged group: not scored)."""
    extra = rows - values.shape[0]
    return torch.cat([values, values.new_full((extra, *values.shape[1:]), float("nan"))]) if extra > 0 else values


class Collector:
    """Generates and scores the groups of each training step."""

    def __init__(
        self,
        cfg: TextConfig,
        generator: Any,
        tokenizer: Any,
        data: PromptData,
        rewards: Sequence[RewardFunction],
        sampler: PromptSampler,
        dist: Distributed,
        prompt_state: Optional[PromptTable] = None,
    ) -> None:
        self.cfg, self.generator, self.tokenizer, self.data = cfg, generator, tokenizer, data
        self.rewards, self.sampler, self.dist = rewards, sampler, dist
        self.prompt_state = prompt_state
        sampling = cfg.prompt_sampling
        self.budgets = dict(sampling.settings) if sampling.name in BUDGET_SAMPLERS else None
        if self.budgets is not None:
            check_budget_settings(cfg.group_size, **self.budgets)
            if cfg.dynamic_sampling.enabled or cfg.rollout_split > 1 or prompt_state is None:
                raise ValueError(
                    f"prompt_sampling {sampling.name}: ragged groups go without dynamic_sampling and rollout_split "
                    "(and need the run's prompt state)"
                )
        window = cfg.critic.window if cfg.method == "tppo" else None
        self.windows = Windows(cfg, window) if window is not None else None

    def checkpoint_parts(self, parts: Any) -> None:
        """T-PPO's stream pool (`critic.window`), exact (tensors); nothing otherwise."""
        if self.windows is not None:
            parts.tensors["tppo_streams"] = self.windows.pool.state_dict()

    def restore(self, ckpt: Any) -> None:
        if self.windows is not None:
            if "tppo_streams" not in ckpt.tensors:
                raise ValueError(
                    "resume: the checkpoint has no T-PPO stream pool (it was written without critic.window)"
                )
            self.windows.pool.load_state_dict(ckpt.tensors["tppo_streams"])
            self.windows.restored = True

    def _gathered(
        self, work: Callable[[int], Any], n_chunks: int, setup: Optional[Callable[[list[int]], None]] = None
    ) -> list[Any]:
        """work(c) of this rank's chunks c (after `setup(mine)`), every rank's results in chunk order on every rank; a
        failure on any rank stops every rank with its reason."""
        local: list[tuple[int, Any]] = []
        failure = None
        try:
            mine = self.dist.my_chunks(n_chunks)
            if setup is not None:
                setup(mine)
            local = [(c, work(c)) for c in mine]
        except Exception as err:
            if not self.dist.active:
                raise
            # the other ranks wait at the gather below: tell them, so every rank stops with the reason
            failure = err
            local = [(-1, f"rank {self.dist.rank}: {type(err).__name__}: {err}")]
        parts = sorted(self.dist.gather_objects(local), key=lambda item: item[0])
        if failure is not None:
            raise failure
        if failed := [msg for c, msg in parts if c < 0]:
            raise RuntimeError("generation or scoring failed on another rank: " + "; ".join(failed))
        return [item for _, item in parts]

    def _score(self, rollout: Rollout, step: int) -> RewardScores:
        rows = [self.data.rows[int(i)] for i in rollout.prompt_index]
        field = self.cfg.data.prompt_field
        ids = [c[m].tolist() for c, m in zip(rollout.completion_ids, rollout.completion_mask)]
        texts = self.tokenizer.batch_decode(ids, skip_special_tokens=True)
        conv = [self.data.conversational[int(i)] for i in rollout.prompt_index]
        completions = [[{"role": "assistant", "content": t}] if c else t for t, c in zip(texts, conv)]
        names = sorted({k for row in rows for k in row} - {field})
        columns = {k: [row.get(k) for row in rows] for k in names}
        return score_completions(
            self.rewards,
            prompts=[row[field] for row in rows],
            completions=completions,
            completion_ids=ids,
            columns=columns,
            trainer_state={"global_step": step},
            stop_on_error=self.cfg.stop_on_reward_error,
        )

    def _chunk_seed(self, step: int, round_: int, chunk: int) -> int:
        """The sampling seed of a chunk of prompts: the same on any rank, for any number of ranks, after a resume."""
        return int(np.random.SeedSequence([self.cfg.seed, step, round_, chunk]).generate_state(1)[0])

    def _generate_and_score(
        self, index: list[int], step: int, round_: int, budgets: Optional[list[int]] = None
    ) -> tuple[Rollout, RewardScores, float, float]:
        """The whole batch on every rank, and this rank's generate / reward seconds. `budgets`: each prompt's number
        of completions (Knapsack RL): one chunk per prompt, groups padded to the largest."""
        G, k = self.cfg.group_size, self.cfg.rollout_split
        per_call = 1 if budgets else prompts_per_call(self.cfg.generation, G)
        chunks = [index[s : s + per_call] for s in range(0, len(index), per_call)]
        times = {"gen": 0.0, "rew": 0.0}

        def pad_passes(mine: list[int]) -> None:
            # generate on a sharded policy gathers its blocks: every rank calls it as often (vLLM holds its own copy)
            for _ in range(self.dist.passes_to_pad(len(mine)) if getattr(self.generator, "synced", False) else 0):
                self.generator.generate([self.data.prompt_ids[chunks[0][0]]], chunks[0][:1], seed=0)

        def work(c: int) -> tuple[Rollout, RewardScores]:  # part c of chunk c // k (k = 1: the chunks themselves)
            t0 = time.perf_counter()
            prompts = chunks[c // k]
            rollout = self.generator.generate(
                [self.data.prompt_ids[i] for i in prompts], prompts, budgets[c] if budgets else G // k,
                seed=self._chunk_seed(step, round_, c),
            )  # fmt: skip
            t1 = time.perf_counter()
            scores = self._score(rollout, step)
            times["gen"] += t1 - t0
            times["rew"] += time.perf_counter() - t1
            return rollout, scores

        parts = self._gathered(work, len(chunks) * k, pad_passes)
        if budgets:  # ragged groups: pad each prompt's group to the largest, padding unscored (NaN) and masked
            width, pad = max(budgets), self.generator.pad_id
            parts = [(r.padded(width, pad), replace(sc, values=_nan_rows(sc.values, width))) for r, sc in parts]
        rollout = Rollout.concat([r for r, _ in parts], self.generator.pad_id)
        merged = RewardScores.concat([sc for _, sc in parts])
        t_gen, t_rew = times["gen"], times["rew"]
        if k > 1:
            rows = whole_groups([len(c) for c in chunks], k, G)
            rollout = rollout.select_rows(rows, G)
            merged = replace(merged, values=merged.values[rows])
        return rollout, merged, t_gen, t_rew

    def collect(self, record: dict[str, Any], step: int) -> Optional[ScoredBatch]:
        """Generate and score P groups; with dynamic sampling, keep only groups whose rewards vary (None: none)."""
        if self.windows is not None:
            return self._collect_windows(record, step)
        ds = self.cfg.dynamic_sampling
        P, G = self.cfg.prompts_per_iteration, self.cfg.group_size
        kept_r, kept_s = [], []
        n_kept, rounds, generated = 0, 0, 0
        t_gen = t_rew = 0.0
        nones = [0] * len(self.rewards)
        errors = [0] * len(self.rewards)
        while True:
            index = self.sampler.next(P)
            budgets = None
            if self.budgets is not None:  # every rank: the same budgets from the same table
                table = given(self.prompt_state, "the run's prompt state (Knapsack RL)")
                budgets = knapsack_budgets(table, index, P * G, **self.budgets)
                record.update({"knapsack/budget_min": min(budgets), "knapsack/budget_max": max(budgets)})
            rollout, scores, dt_gen, dt_rew = self._generate_and_score(index, step, rounds, budgets)
            t_gen += dt_gen
            t_rew += dt_rew
            generated += P
            nones = [a + b for a, b in zip(nones, scores.none_counts)]
            errors = [a + b for a, b in zip(errors, scores.error_counts)]
            if not ds.enabled:
                kept_r, kept_s, n_kept = [rollout], [scores], P
                break
            scalar = group_batch(self.cfg, self.rewards, scores.values, rollout).scalar_rewards()
            ok = torch.isfinite(scalar)
            spread = masked_std(scalar, ok, dim=1, unbiased=False).squeeze(1) > ds.min_std
            keep = [g for g in range(P) if bool(spread[g])][: P - n_kept]
            if keep:
                kept_r.append(rollout.select_groups(keep))
                rows = torch.tensor([g * G + j for g in keep for j in range(G)])
                kept_s.append(replace(scores, values=scores.values[rows]))
                n_kept += len(keep)
            if n_kept >= P or rounds >= ds.max_extra_rounds:
                break
            rounds += 1
        # seconds: the slowest rank's (the others wait for it at the gather)
        record.update(
            {
                "time_rollout_s": self.dist.max(t_gen),
                "time_reward_s": self.dist.max(t_rew),
                "count/generated_groups": generated,
                "reward_calls": len(self.rewards) * (generated // P),
            }
        )
        for r, n, e in zip(self.rewards, nones, errors):
            record[f"rewards/{r.name}/none_count"] = n
            record[f"rewards/{r.name}/error_count"] = e
        if ds.enabled:
            record.update(
                {
                    "dynamic_sampling/extra_rounds": rounds,
                    "dynamic_sampling/kept_groups": n_kept,
                    "dynamic_sampling/dropped_groups": generated - n_kept,
                }
            )
        if not kept_r:
            return None
        rollout = Rollout.concat(kept_r, self.generator.pad_id)
        values = torch.cat([s.values for s in kept_s])
        return ScoredBatch(rollout, RewardScores(values, nones, errors))

    def _collect_windows(self, record: dict[str, Any], step: int) -> ScoredBatch:
        """T-PPO's windows of the stream pool (flowgrpo/text/windows.py) as the step's batch."""
        assert self.windows is not None
        rollout, scores, t_gen, t_rew = self.windows.collect(self, record, step)
        record.update({"time_rollout_s": self.dist.max(t_gen), "time_reward_s": self.dist.max(t_rew),
                       "count/generated_groups": self.cfg.prompts_per_iteration,
                       "reward_calls": len(self.rewards)})  # fmt: skip
        for r, n, e in zip(self.rewards, scores.none_counts, scores.error_counts):
            record[f"rewards/{r.name}/none_count"] = n
            record[f"rewards/{r.name}/error_count"] = e
        return ScoredBatch(rollout, scores)
