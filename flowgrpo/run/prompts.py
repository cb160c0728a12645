"""The order in which prompts are drawn: epochs of seeded permutations, resumable from two integers; a policy hook
(a prompt sampler of flowgrpo.core.prompt_state: SPO's priorities, Prompt Replay) may choose part of each draw."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import torch


class PromptOrderError(ValueError):
    """A saved prompt order that does not fit this dataset."""


@dataclass
class PromptSampler:
    """Epochs over the rows, each a fresh permutation seeded by (seed, epoch); the state is two ints.

    Independent of the global RNG, so the data order never depends on what else drew random numbers.

    `policy(n, draw) -> rows`, when set, chooses up to n rows of draw number `draw` (counted over the run, saved
    with the state); the permutation fills the rest. The policy's own state is saved by its owner.
    """

    num_rows: int
    seed: int
    shuffle: bool = True
    epoch: int = 0
    position: int = 0
    _order: Optional[list[int]] = field(default=None, repr=False)
    policy: Optional[Callable[[int, int], list[int]]] = field(default=None, repr=False)
    draws: int = 0

    def _perm(self) -> list[int]:
        if self._order is None:
            if self.shuffle:
                g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
                self._order = torch.randperm(self.num_rows, generator=g).tolist()
            else:
                self._order = list(range(self.num_rows))
        return self._order

    def next(self, n: int) -> list[int]:
        out: list[int] = []
        if self.policy is not None:
            out = list(self.policy(n, self.draws))[:n]
            self.draws += 1
        while len(out) < n:
            if self.position >= self.num_rows:
                self.epoch, self.position, self._order = self.epoch + 1, 0, None
            take = min(n - len(out), self.num_rows - self.position)
            out.extend(self._perm()[self.position : self.position + take])
            self.position += take
        return out

    def state_dict(self) -> dict[str, int]:
        state = {"epoch": self.epoch, "position": self.position, "num_rows": self.num_rows}
        if self.policy is not None:  # only then: a run without a policy saves what it always saved
            state["draws"] = self.draws
        return state

    def load_state_dict(self, state: dict[str, int]) -> None:
        if state["num_rows"] != self.num_rows:
            raise PromptOrderError(
                f"resume: the checkpoint's dataset had {state['num_rows']} rows, this one has {self.num_rows}"
            )
        self.epoch, self.position, self._order = state["epoch"], state["position"], None
        self.draws = state.get("draws", 0)
