"""T-PPO's windowed generation (`critic.window: W`, method tppo): a pool of streams that each generate at most W
tokens a step and carry an unfinished response into the next step.

The pool holds S = prompts_per_iteration x group_size streams (T-PPO has no groups: the critic gives each token its
advantage, so group_size only sizes the pool; each stream draws its own prompt). One step:

    free streams draw fresh prompts (the run's prompt sampler, one row each, in stream order)
    -> every stream generates up to W tokens from prompt + its response so far (left-padded, as any prompt),
       in chunks of `generation.batch_size` streams, chunk c seeded by (run seed, step, c) on rank c % world_size,
       and cut at the response budget `generation.max_new_tokens`
    -> each stream's whole response so far is scored (T-PPO reads the reward of finished responses only)
    -> the rollout to train: row s = stream s, its prompt + earlier tokens as the context (`prompt_ids`), this
       step's tokens as the completion; `truncated` = no end-of-sequence token yet (the critic's V(s_l) bootstraps)
    -> a stream that ended (an end-of-sequence token, or the budget) is freed; the others keep their tokens.

The pool is state: a checkpoint holds it (`tppo_streams` tensors) and a resumed run continues bit-identically.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import Tensor

from ..config import ConfigError
from .generation import Rollout, completion_mask, finalize, left_pad, prompts_per_call
from .reward_functions import RewardScores


class StreamPool:
    """S streams: dataset row (-1: free) and the response so far (-1 past its length)."""

    def __init__(self, streams: int, budget: int) -> None:
        self.index = torch.full((streams,), -1, dtype=torch.long)
        self.tokens = torch.full((streams, budget), -1, dtype=torch.long)
        self.length = torch.zeros(streams, dtype=torch.long)

    def response(self, s: int) -> list[int]:
        return self.tokens[s, : int(self.length[s])].tolist()

    def state_dict(self) -> dict[str, Tensor]:
        return {"index": self.index.clone(), "tokens": self.tokens.clone(), "length": self.length.clone()}

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        if state["tokens"].shape != self.tokens.shape:
            raise ConfigError(
                f"resume: the checkpoint's T-PPO stream pool is {tuple(state['tokens'].shape)} (streams x "
                f"max_new_tokens), this run's {tuple(self.tokens.shape)}"
            )
        self.index, self.tokens, self.length = state["index"].clone(), state["tokens"].clone(), state["length"].clone()


class Windows:
    """The windowed rollout of a collector (flowgrpo/text/collect.py); `restored`: the pool came from a checkpoint."""

    def __init__(self, cfg: Any, window: int) -> None:
        self.window, self.budget = window, cfg.generation.max_new_tokens
        self.pool = StreamPool(cfg.prompts_per_iteration * cfg.group_size, self.budget)
        self.restored = False

    def collect(self, collector: Any, record: dict[str, Any], step: int) -> tuple[Rollout, RewardScores, float, float]:
        """This step's windows of every stream (the whole batch on every rank), and this rank's generate / reward
        seconds."""
        pool, cfg = self.pool, collector.cfg
        if step > 0 and not self.restored:
            raise ConfigError(
                "resume with critic.window: the trainer did not restore the T-PPO stream pool (it needs "
                "Collector.restore from the checkpoint)"
            )
        self.restored = True
        free = (pool.index < 0).nonzero()[:, 0]
        if free.numel():
            pool.index[free] = torch.tensor(collector.sampler.next(int(free.numel())), dtype=torch.long)
        S, prompt_ids = pool.index.numel(), collector.data.prompt_ids
        contexts = [list(prompt_ids[int(pool.index[s])]) + pool.response(s) for s in range(S)]
        size = prompts_per_call(cfg.generation, 1)
        chunks = [torch.arange(s, min(s + size, S)) for s in range(0, S, size)]
        times = {"gen": 0.0, "rew": 0.0}

        def work(c: int) -> tuple[Rollout, RewardScores]:
            t0 = time.perf_counter()
            rows = chunks[c]
            out = collector.generator.generate(
                [contexts[int(s)] for s in rows], pool.index[rows].tolist(), 1,
                seed=collector._chunk_seed(step, 0, c), max_new_tokens=self.window,
            )  # fmt: skip
            out = self._cut(out, self.budget - pool.length[rows], collector.generator)
            t1 = time.perf_counter()
            scores = collector._score(self._responses(rows, out, prompt_ids, collector.generator.pad_id), step)
            times["gen"] += t1 - t0
            times["rew"] += time.perf_counter() - t1
            return out, scores

        parts = collector._gathered(work, len(chunks))
        rollout = Rollout.concat([r for r, _ in parts], collector.generator.pad_id)
        rollout.group_size = cfg.group_size
        merged = RewardScores.concat([sc for _, sc in parts])
        finished = ~rollout.truncated
        ended = finished | (pool.length + rollout.lengths >= self.budget)
        record.update({
            "windows/continued": int((pool.length > 0).sum()), "windows/finished": int(finished.sum()),
            "windows/budget_cut": int((ended & ~finished).sum()),
            "windows/context_mean": float(pool.length.float().mean()),
        })  # fmt: skip
        self._advance(rollout, ended)
        return rollout, merged, times["gen"], times["rew"]

    def _cut(self, out: Rollout, room: Tensor, generator: Any) -> Rollout:
        """Each row's window cut to its room left in the budget (an end-of-sequence token past it does not count)."""
        keep = torch.arange(out.completion_ids.shape[1]).unsqueeze(0) < room.unsqueeze(1)
        tokens = torch.where(keep & out.completion_mask, out.completion_ids, torch.full_like(out.completion_ids, -1))
        mask, truncated = completion_mask(tokens, generator.eos_ids)
        out.completion_mask, out.truncated = mask & keep & out.completion_mask, truncated
        return finalize(out, generator.pad_id)

    def _responses(self, rows: Tensor, out: Rollout, prompt_ids: Any, pad_id: int) -> Rollout:
        """The streams' original prompts and whole responses so far (what the reward functions read)."""
        pool = self.pool
        prompts, pmask = left_pad([list(prompt_ids[int(pool.index[s])]) for s in rows], pad_id)
        whole = [pool.response(int(s)) + out.completion_ids[i, out.completion_mask[i]].tolist() for i, s in
                 enumerate(rows)]  # fmt: skip
        width = max(max(len(w) for w in whole), 1)
        ids = torch.full((len(whole), width), pad_id, dtype=torch.long)
        mask = torch.zeros(len(whole), width, dtype=torch.bool)
        for i, w in enumerate(whole):
            ids[i, : len(w)], mask[i, : len(w)] = torch.tensor(w, dtype=torch.long), True
        return Rollout(prompts, pmask, ids, mask, out.truncated, pool.index[rows].clone(), 1)

    def _advance(self, rollout: Rollout, ended: Tensor) -> None:
        """Unfinished streams keep this step's tokens; the ended ones are freed."""
        pool = self.pool
        for s in range(pool.index.numel()):
            if bool(ended[s]):
                pool.index[s], pool.length[s] = -1, 0
                pool.tokens[s] = -1
                continue
            new = rollout.completion_ids[s, rollout.completion_mask[s]]
            at = int(pool.length[s])
            pool.tokens[s, at : at + new.numel()] = new
            pool.length[s] = at + new.numel()
