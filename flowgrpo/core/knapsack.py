"""Knapsack RL: per-prompt rollout budgets from a knapsack over the prompts' learning value, and ragged groups.

Li et al. 2025, "Knapsack RL: Unlocking Exploration of LLMs via Optimizing Budget Allocation", arXiv 2509.25849
(research note anchors_text_grpo.md 2.21; **paper-only**, no public code was found, ◐). Each prompt i of a step is an
item whose cost is its number of rollouts N_i and whose value is

    Value(N, p) = (1 - p^N - (1 - p)^N) * InfoGain(p),   InfoGain(p) = p (1 - p)^2

(the probability that a group of N 0 / 1 rewards has spread, i.e. a non-zero GRPO gradient, times the paper's
approximate gain in success probability). The budgets maximise sum_i Value(N_i, p_i) subject to
N_lo <= N_i <= N_hi and sum_i N_i = total (the step's compute stays fixed): an exact dynamic programme over the
budget (`allocate`). Budget the value cannot use (every marginal value 0: prompts with p = 0 or 1) goes to the
prompts with the lowest p first, each up to N_hi (the paper's "fallback" to unsolved prompts; our reading of it,
◐).

p_i comes from the run's `PromptTable` (prompt_state.py): the prompt's latest group mean reward (`rate`, a pass
rate for 0 / 1 rewards) where it was seen, else its offline prior where given, else `unknown` (0.5: ours, ◐). The
budgets are a pure float64 function of the table, so every rank computes the same ones, and a resumed run (the
table is checkpointed exactly) computes them again bit-identically.

Ragged groups: the core's group statistics already honour `GroupBatch.valid` (every estimator reads masked
statistics over the group axis), so prompt i's N_i samples are laid out in row i of a [P, max N_i] batch with the
rest masked (`ragged_groups`); each prompt is then normalised within its own group.

In a run: `prompt_sampling: {name: knapsack, low: 2, high: 32}` (the bounds' defaults are ours, ◐). Its rows are
the seeded permutation's; the text trainer's collector asks `knapsack_budgets` for each step's budgets with
total = prompts_per_iteration x group_size, samples N_i completions of prompt i and pads every group to the step's
largest N_i with masked rows (flowgrpo/text/collect.py). The image trainer samples exactly N_i images of prompt i
and leaves the rest of row i empty (flowgrpo/t2i/ragged.py).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor

from .prompt_state import BUDGET_SAMPLERS, PROMPT_SAMPLERS, PromptTable


def info_gain(p: Tensor) -> Tensor:
    """The paper's approximate gain in success probability from one GRPO step on a prompt of success rate p."""
    return p * (1 - p) ** 2


def task_value(n: Tensor, p: Tensor) -> Tensor:
    """Value(N, p) = (1 - p^N - (1 - p)^N) p (1 - p)^2, broadcast over n and p (float64)."""
    n, p = n.double(), p.double()
    return (1 - p**n - (1 - p) ** n) * info_gain(p)


def _check_bounds(num: int, total: int, low: int, high: int) -> None:
    if not 1 <= low <= high:
        raise ValueError(f"knapsack: expected 1 <= low <= high, got low={low}, high={high}")
    if not num * low <= total <= num * high:
        raise ValueError(
            f"knapsack: total={total} budget cannot be split over {num} prompts within [{low}, {high}] each "
            f"(valid totals: {num * low}..{num * high})"
        )


def allocate(p: Tensor, total: int, low: int, high: int) -> Tensor:
    """Budgets N_i (long [M]) in [low, high] with sum = total that maximise sum_i Value(N_i, p_i).

    Exact: a dynamic programme over the extra budget b = sum_i (N_i - low) in 0..total - M low, one item at a time;
    ties go to the smaller budget of the later item (argmax takes the first), so the result is deterministic.
    """
    p = torch.as_tensor(p, dtype=torch.float64).reshape(-1)
    M = p.numel()
    _check_bounds(M, total, low, high)
    if bool(((p < 0) | (p > 1) | torch.isnan(p)).any()):
        raise ValueError("knapsack: success rates must lie in [0, 1]")
    B, E = total - M * low, high - low
    extra = torch.arange(E + 1, dtype=torch.float64)
    gain = task_value(low + extra.unsqueeze(0), p.unsqueeze(1)) - task_value(torch.tensor(float(low)), p).unsqueeze(1)
    b = torch.arange(B + 1)
    src = b.unsqueeze(1) - torch.arange(E + 1).unsqueeze(0)  # [B + 1, E + 1]: budget before this item
    reachable = src >= 0
    best = torch.full((B + 1,), -torch.inf, dtype=torch.float64)
    best[0] = 0.0
    choice = torch.zeros(M, B + 1, dtype=torch.long)
    for i in range(M):
        cand = torch.where(reachable, best[src.clamp_min(0)] + gain[i].unsqueeze(0), -torch.inf)
        best, choice[i] = cand.max(dim=1)
    used = int(torch.argmax(best))  # the first (smallest) budget that reaches the best value
    budgets = torch.empty(M, dtype=torch.long)
    for i in range(M - 1, -1, -1):
        e = int(choice[i, used])
        budgets[i] = low + e
        used -= e
    return _fallback(budgets, p, total, high)


def _fallback(budgets: Tensor, p: Tensor, total: int, high: int) -> Tensor:
    """Give the budget the value did not use to the lowest p first, each up to `high` (ties: lower index)."""
    left = total - int(budgets.sum())
    for i in torch.argsort(p, stable=True).tolist():
        take = min(left, high - int(budgets[i]))
        budgets[i] += take
        left -= take
    return budgets


def success_rates(table: PromptTable, rows: Sequence[int], unknown: float = 0.5) -> Tensor:
    """Each row's estimated success rate: its latest group mean reward where seen, else its prior, else `unknown`."""
    if not 0.0 <= unknown <= 1.0:
        raise ValueError(f"knapsack: unknown must lie in [0, 1], got {unknown}")
    idx = torch.as_tensor(list(rows), dtype=torch.long)
    seen = table["seen"][idx] > 0
    rate = table["rate"][idx].clamp(0, 1)
    return torch.where(seen, rate, table.first_value(unknown)[idx])


def knapsack_budgets(
    table: PromptTable, rows: Sequence[int], total: int, low: int, high: int, unknown: float = 0.5
) -> list[int]:
    """The step's rollout budget of each prompt row (in the order given), from the table alone."""
    return [int(n) for n in allocate(success_rates(table, rows, unknown), total, low, high)]


@PROMPT_SAMPLERS.register("knapsack")
def knapsack(
    table: Optional[PromptTable], n: int, draw: int, seed: int, *, low: int = 2, high: int = 32, unknown: float = 0.5
) -> list[int]:
    """Knapsack RL: the step's rollouts split over its prompts by a knapsack on each prompt's learning value (its rows
    are the seeded permutation's; the trainer reads the budgets)."""
    return []


BUDGET_SAMPLERS.add("knapsack")


def check_budget_settings(group_size: int, low: int = 2, high: int = 32, unknown: float = 0.5) -> None:
    """Refuse bounds that cannot hold the step's P x group_size rollouts, before any model loads."""
    if not (isinstance(low, int) and isinstance(high, int) and 1 <= low <= group_size <= high):
        raise ValueError(
            f"prompt_sampling knapsack: expected integers 1 <= low <= group_size ({group_size}) <= high, "
            f"got low={low}, high={high}"
        )
    if not 0.0 <= unknown <= 1.0:
        raise ValueError(f"prompt_sampling knapsack: unknown must lie in [0, 1], got {unknown}")


def ragged_groups(values: Tensor, budgets: Sequence[int], fill: Optional[float] = None) -> tuple[Tensor, Tensor]:
    """Rows of `values` ([sum N_i, ...], prompt by prompt) as [P, max N_i, ...] groups and their `valid` mask [P,
    max N_i]; padding holds `fill` (NaN by default for floating values, 0 otherwise) and is masked."""
    sizes = [int(n) for n in budgets]
    if any(n < 1 for n in sizes) or sum(sizes) != values.shape[0]:
        raise ValueError(f"ragged_groups: budgets {sizes} must be >= 1 and sum to the {values.shape[0]} rows given")
    P, G = len(sizes), max(sizes)
    if fill is None:
        fill = float("nan") if values.is_floating_point() else 0
    out = torch.full((P, G, *values.shape[1:]), fill, dtype=values.dtype, device=values.device)
    valid = torch.zeros(P, G, dtype=torch.bool, device=values.device)
    start = 0
    for i, n in enumerate(sizes):
        out[i, :n] = values[start : start + n]
        valid[i, :n] = True
        start += n
    return out, valid


def flatten_ragged(grouped: Tensor, valid: Tensor) -> Tensor:
    """The inverse of `ragged_groups`: the valid entries of [P, G, ...] back as [sum N_i, ...], prompt by prompt."""
    return grouped[valid]
