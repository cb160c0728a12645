"""Per-prompt state that lives across training steps, and the prompt samplers that read it.

A `PromptTable` holds float64 columns over the dataset's rows (one value per prompt). It is the state of the
stateful parts: the SPO value tracker (estimator `spo`, spo.py) and the prompt samplers registered here
(`PROMPT_SAMPLERS`). A trainer builds one table per run (`build_prompt_state`: none when no part needs it), hands it
to the estimator through `GroupBatch.prompt_state` with the batch's `GroupBatch.prompt_ids`, and checkpoints it
as tensors (`state_dict`: exact, float64). `compute_advantages` records, after the estimator, each observed prompt's
latest group statistics (`PromptTable.observe`): its mean reward, whether its rewards varied, and the step.

A prompt sampler is a function `fn(table, n, draw, seed, *, settings) -> rows`: the rows (at most n) it chooses for
draw number `draw` of the run; the trainer's prompt order (flowgrpo.run.prompts.PromptSampler) fills the rest of
the batch from its seeded permutation. Every rank holds the same table (advantages are computed on every rank
from the whole batch), so every rank draws the same rows, for any number of ranks and after a resume.

Prompt Replay ("Prompt Replay: ...", the note anchors_text_grpo.md 2.22; abstract only, paper-only and ◐: the
priority, cooldown and reuse bound are the abstract's, their defaults here are ours and unverified): prompts whose
latest group had reward spread (a non-zero advantage) wait in a buffer, by closeness of their mean reward (a pass
rate for 0 / 1 rewards) to `target` 0.5; a `fraction` of each batch is re-served from it (fresh rollouts of the
prompt, not stored trajectories), at most `max_reuse` times per prompt and not before `cooldown` steps after its
latest rollout. Edit-R1's prompt ban (`ban_saturated`: prompts whose latest group was saturated are never drawn
again) lives in group_filter.py and is registered here.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Mapping, Optional

import torch
from torch import Tensor

from .group_filter import ban_saturated
from .registry import Registry

PROMPT_SAMPLERS = Registry("prompt sampler")

# seen: groups observed; alpha / beta: the SPO Beta tracker; prior: an offline success rate per prompt (-1: none, as
# a checkpoint refuses NaN; SPO starts its tracker there); rate / spread / observed_at: the latest group's mean reward, 1 if its rewards varied,
# its step; replays / replayed_at: Prompt Replay's reuse count and last replay step; std: the latest group's biased
# reward std (ban_saturated, group_filter.py)
COLUMNS = ("seen", "alpha", "beta", "prior", "rate", "spread", "observed_at", "replays", "replayed_at", "std")
# columns added after checkpoints were written: a checkpoint without one resumes with this value (-1: unknown)
LATER_COLUMNS = {"std": -1.0}


class PromptStateError(ValueError):
    """A saved prompt state that does not fit this dataset."""


class PromptTable:
    """float64 columns (COLUMNS) of one value per dataset row, all zero at the start but `prior` (-1: unknown, or
    the offline success rates given, each in [0, 1] or NaN for unknown)."""

    def __init__(self, num_rows: int, prior: Optional[Tensor] = None) -> None:
        self.num_rows = num_rows
        self.columns: dict[str, Tensor] = {c: torch.zeros(num_rows, dtype=torch.float64) for c in COLUMNS}
        self.columns["prior"] = torch.full((num_rows,), -1.0, dtype=torch.float64)
        if prior is not None:
            p = torch.as_tensor(prior, dtype=torch.float64)
            if p.shape != (num_rows,) or bool(((p < 0) | (p > 1)).any()):
                raise ValueError(f"prior: expected {num_rows} success rates in [0, 1] (NaN: unknown)")
            self.columns["prior"] = torch.nan_to_num(p, nan=-1.0)

    def __getitem__(self, name: str) -> Tensor:
        return self.columns[name]

    @property
    def latest_step(self) -> float:
        """The newest step observed (0 before any)."""
        return float(self.columns["observed_at"].max()) if self.num_rows else 0.0

    def observe(self, prompt_ids: Tensor, rewards: Tensor, usable: Tensor, step: int) -> None:
        """Record each group's mean usable reward, their biased std, whether they varied, and the step (groups in
        batch order: a prompt twice in one batch keeps its later group). Groups without a usable reward are
        left out."""
        ids = prompt_ids.tolist()
        r = rewards.double()
        for p, row in enumerate(ids):
            ok = usable[p]
            if not bool(ok.any()):
                continue
            vals = r[p][ok]
            self.columns["seen"][row] += 1
            self.columns["rate"][row] = vals.mean()
            self.columns["spread"][row] = float(bool(vals.max() > vals.min()))
            self.columns["std"][row] = vals.std(correction=0)
            self.columns["observed_at"][row] = float(step)

    def state_dict(self) -> dict[str, Tensor]:
        return {k: v.clone() for k, v in self.columns.items()}

    def load_state_dict(self, state: Mapping[str, Tensor]) -> None:
        missing = set(COLUMNS) - set(state)
        if set(state) - set(COLUMNS) or missing - set(LATER_COLUMNS):
            raise PromptStateError(f"resume: the prompt state has columns {sorted(state)}, expected {sorted(COLUMNS)}")
        for name in missing:
            self.columns[name] = torch.full((self.num_rows,), LATER_COLUMNS[name], dtype=torch.float64)
        for name, value in state.items():
            if value.shape != (self.num_rows,):
                raise PromptStateError(
                    f"resume: the checkpoint's prompt state covers {value.shape[0]} rows, this dataset has "
                    f"{self.num_rows}"
                )
            self.columns[name] = value.to(torch.float64).clone()

    def first_value(self, default: float) -> Tensor:
        """Each row's value before its first observation: its prior where known, else `default`."""
        prior = self.columns["prior"]
        return torch.where(prior < 0, torch.full_like(prior, default), prior)


def _generator(seed: int, draw: int) -> torch.Generator:
    """The generator of one draw: independent of the global RNG and of the permutation's seeds."""
    return torch.Generator().manual_seed((seed * 1_000_033 + 7919 * draw + 104_729) % (2**63))


@PROMPT_SAMPLERS.register("uniform")
def uniform(table: Optional[PromptTable], n: int, draw: int, seed: int) -> list[int]:
    """The seeded epoch permutation (the default): this sampler chooses no rows itself."""
    return []


def spo_value(table: PromptTable) -> Tensor:
    """The SPO tracker's value estimate alpha / (alpha + beta) per row; for rows never seen, the prior where known,
    else 0.5 (unknown)."""
    a, b = table["alpha"], table["beta"]
    total = a + b
    return torch.where(total > 0, a / total.clamp_min(1e-300), table.first_value(0.5))


@PROMPT_SAMPLERS.register("spo")
def spo_priority(table: Optional[PromptTable], n: int, draw: int, seed: int, *, floor: float = 0.05) -> list[int]:
    """SPO's prioritised sampling: rows drawn without replacement with weight sqrt(v (1 - v)) + floor, v the
    tracker's value (for prompts not yet seen: their prior, or 0.5, so that those come first). The floor's value is unverified (◐); with
    floor 0, prompts of weight 0 are never drawn here (the permutation fills the batch)."""
    state = _table(table, "spo")
    v = spo_value(state)
    weights = (v * (1 - v)).clamp_min(0).sqrt() + floor
    k = min(n, int((weights > 0).sum()))  # without a floor, solved prompts (v = 0 or 1) are never drawn
    if k == 0:
        return []
    return [int(i) for i in torch.multinomial(weights, k, replacement=False, generator=_generator(seed, draw))]


@PROMPT_SAMPLERS.register("replay")
def replay(
    table: Optional[PromptTable],
    n: int,
    draw: int,
    seed: int,
    *,
    fraction: float = 0.5,
    target: float = 0.5,
    cooldown: int = 1,
    max_reuse: int = 2,
) -> list[int]:
    """Prompt Replay: up to floor(fraction n) rows from the buffer of prompts whose latest group had reward spread,
    closest to `target` first (ties: the lower row), each at most max_reuse times and >= cooldown steps after its
    latest rollout."""
    state = _table(table, "replay")
    k = math.floor(fraction * n)
    latest = state.latest_step
    eligible = (
        (state["spread"] > 0)
        & (state["replays"] < max_reuse)
        & (latest - state["observed_at"] >= cooldown)
        & (state["replayed_at"] < latest)  # not twice for the same step (dynamic sampling's extra rounds)
    )
    rows = torch.nonzero(eligible).flatten()
    if k <= 0 or rows.numel() == 0:
        return []
    closeness = (state["rate"][rows] - target).abs()
    chosen = rows[torch.sort(closeness, stable=True).indices[:k]]
    state["replays"][chosen] += 1
    state["replayed_at"][chosen] = latest
    return [int(i) for i in chosen]


# Edit-R1's prompt ban (group_filter.py: it reads the table's columns by name, so it imports nothing from here)
PROMPT_SAMPLERS.register("ban_saturated")(ban_saturated)


def _table(table: Optional[PromptTable], name: str) -> PromptTable:
    if table is None:
        raise ValueError(f"prompt sampler '{name}' needs the run's prompt state (build_prompt_state)")
    return table


# what reads the table: estimators by name (spo.py adds its own) and every sampler but uniform
STATEFUL_ESTIMATORS: set[str] = set()
# samplers that set each prompt's number of rollouts (knapsack.py adds its own): only a trainer that lays out ragged
# groups reads them, so prompt_policy refuses them elsewhere instead of ignoring them
BUDGET_SAMPLERS: set[str] = set()


def build_prompt_state(
    num_rows: int, estimator: str, sampler: str, prior: Optional[Tensor] = None
) -> Optional[PromptTable]:
    """The run's prompt table, or None when neither the estimator nor the prompt sampler reads one (the run then
    stays exactly what it was without this module). `prior`: offline success rates per row (SPO), NaN = unknown."""
    PROMPT_SAMPLERS.get(sampler)  # an unknown name fails with the valid ones
    if estimator in STATEFUL_ESTIMATORS or sampler != "uniform":
        return PromptTable(num_rows, prior)
    if prior is not None:
        raise ValueError(
            f"a prompt prior is read by the estimators {sorted(STATEFUL_ESTIMATORS)} only, not '{estimator}'"
        )
    return None


def prompt_policy(
    table: Optional[PromptTable], sampler: str, settings: Mapping[str, Any], seed: int, reads_budgets: bool = False
) -> Optional[Callable[[int, int], list[int]]]:
    """The hook a prompt order calls as hook(n, draw) -> rows, or None for `uniform` and for a budget sampler (its
    rows are the permutation's; `reads_budgets`: the trainer reads the budgets itself, else such a sampler is
    refused)."""
    entry = PROMPT_SAMPLERS.get(sampler)
    entry.check_settings(settings, "prompt sampler")
    if sampler in BUDGET_SAMPLERS:
        if not reads_budgets:
            raise ValueError(
                f"prompt sampler '{sampler}' sets per-prompt rollout budgets (ragged groups), which this trainer "
                "does not lay out; the text and image trainers do"
            )
        _table(table, sampler)
        return None
    if sampler == "uniform":
        return None
    state = _table(table, sampler)

    def hook(n: int, draw: int) -> list[int]:
        rows: list[int] = entry.fn(state, n, draw, seed, **settings)
        return rows

    return hook
