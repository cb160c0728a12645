"""SPO's KL-adaptive forgetting in the text trainer: each prompt's last completion, kept across steps, and its drift.

verl-project/verl-recipe spo/spo_ray_trainer.py @ 550d42f53169e41b36921faef86336fdfc558820 (`_get_spo_rho`) keeps,
per prompt, its last response and that response's log-probs under the policy of the moment; at the prompt's next
sight it re-scores the stored response under the current policy and takes D = the token mean of
|log pi_stored - log pi_current| (`flowgrpo.core.spo.kl_drift`), 0 at a first sight; then it stores the new response.
Here the re-scoring runs before the advantages of the step that sees the prompt again (the source: after that
step's update, ◐), and of a group of G completions the last valid one is kept (the source samples G = 1).

`CompletionMemory` holds the stored completions (token ids and log-probs, float32 as scored) by dataset row; its
`state_dict` goes into checkpoints as tensors, so a resumed run computes the same drift bit for bit.
"""

from __future__ import annotations

from typing import Callable, Mapping

import torch
from torch import Tensor

from ..core.spo import kl_drift
from .generation import Rollout

Scorer = Callable[[Rollout], Tensor]  # no-grad log-probs [n, Tc] of a rollout's completion tokens


class CompletionMemory:
    """Each prompt's (dataset row's) last stored completion: its token ids and its log-probs when stored."""

    def __init__(self) -> None:
        self.items: dict[int, tuple[Tensor, Tensor]] = {}  # row -> (token ids [L] long, log-probs [L] float32)

    def drift(self, rollout: Rollout, score: Scorer) -> Tensor:
        """D [P] float64 of the rollout's groups (0 at a prompt's first sight), then the groups' completions stored
        in their place (a prompt twice in the batch: its later group's). `score` runs the no-grad forward: one call
        over the stored completions (on the groups' prompts) and this step's kept ones."""
        G = rollout.group_size
        P = rollout.num_sequences // G
        valid = torch.ones(rollout.num_sequences, dtype=torch.bool) if rollout.valid is None else rollout.valid
        kept = torch.tensor([p * G + int(valid[p * G : (p + 1) * G].nonzero().max()) for p in range(P)])
        ids = rollout.prompt_index[kept].tolist()
        known = [p for p in range(P) if ids[p] in self.items]
        new = rollout.select_rows(kept, 1)
        parts = [self._stored(new, known, ids), new] if known else [new]
        logp = score(Rollout.concat(parts, pad_id=0) if known else new).float()
        drift = torch.zeros(P, dtype=torch.float64)
        if known:
            stored = [self.items[ids[p]][1] for p in known]
            width = logp.shape[1]
            old = torch.stack([torch.nn.functional.pad(s, (0, width - s.numel())) for s in stored])
            mask = torch.arange(width).unsqueeze(0) < torch.tensor([s.numel() for s in stored]).unsqueeze(1)
            drift[known] = kl_drift(old, logp[: len(known)], mask)
        lengths = new.completion_mask.sum(1).tolist()
        for p, row in enumerate(ids):  # after the drift: every group reads the state from before this batch
            n = int(lengths[p])
            self.items[row] = (new.completion_ids[p, :n].clone(), logp[len(known) + p, :n].clone())
        return drift

    def _stored(self, new: Rollout, known: list[int], ids: list[int]) -> Rollout:
        """The stored completions of the groups `known`, on their prompts (this batch's, the same dataset rows)."""
        tokens = [self.items[ids[p]][0] for p in known]
        width = max(t.numel() for t in tokens)
        completion = torch.stack([torch.nn.functional.pad(t, (0, width - t.numel())) for t in tokens])
        mask = torch.arange(width).unsqueeze(0) < torch.tensor([t.numel() for t in tokens]).unsqueeze(1)
        rows = torch.tensor(known)
        return Rollout(
            new.prompt_ids[rows],
            new.prompt_mask[rows],
            completion,
            mask,
            torch.zeros(len(known), dtype=torch.bool),
            new.prompt_index[rows],
            1,
        )

    def state_dict(self) -> dict[str, Tensor]:
        """Padded tensors: rows [M], lengths [M], tokens [M, L], log-probs [M, L] (zero past each length)."""
        rows = sorted(self.items)
        lengths = [self.items[r][0].numel() for r in rows]
        width = max(lengths, default=0)
        tokens = torch.zeros(len(rows), width, dtype=torch.long)
        logp = torch.zeros(len(rows), width, dtype=torch.float32)
        for i, r in enumerate(rows):
            tok, lp = self.items[r]
            tokens[i, : tok.numel()] = tok
            logp[i, : lp.numel()] = lp
        return {
            "rows": torch.tensor(rows, dtype=torch.long),
            "lengths": torch.tensor(lengths, dtype=torch.long),
            "tokens": tokens,
            "logp": logp,
        }

    def load_state_dict(self, state: Mapping[str, Tensor]) -> None:
        if set(state) != {"rows", "lengths", "tokens", "logp"}:
            raise ValueError(
                f"resume: SPO's completion memory has tensors {sorted(state)}, expected logp, lengths, rows, tokens"
            )
        self.items = {
            int(r): (state["tokens"][i, :n].clone(), state["logp"][i, :n].to(torch.float32).clone())
            for i, (r, n) in enumerate(zip(state["rows"].tolist(), state["lengths"].tolist()))
        }
