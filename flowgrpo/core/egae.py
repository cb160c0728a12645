"""T-PPO's Extended GAE: per-token advantages of responses that may be cut off mid-generation.

Truncated PPO (arXiv 2506.15050; research note anchors_text_grpo.md 2.18, **paper-only**, ◐: the window length and
lambda / gamma defaults are not recovered) generates in fixed windows and updates the policy on the tokens of
responses that have not finished yet. Their advantages bootstrap from the critic's value at the cut:

    delta_t = r_t + gamma V(s_{t+1}) - V(s_t),   A_t = sum_{k=0}^{l-t-1} (gamma lambda)^k delta_{t+k}

over the l tokens of the window, where V(s_l) is the value at the cut for an unfinished response and 0 after the
last token of a finished one (there the outcome reward sits on that token). The value model trains only on
finished responses, towards their returns A_t + V(s_t) (`value_targets` marks which rows).

This is an estimator over a `TokenValueBatch` (a `GroupBatch` with the critic's values): per-token rewards in
`step_rewards` [P, G, T] (0 but at a finished response's last token), the token mask in `step_mask`, `values`
[P, G, T] = V(s_t), `last_value` [P, G] = V(s_l) and `finished` [P, G]. The text trainer runs it with `method: tppo`
(flowgrpo/text/tppo.py: the critic's values, per-token rewards, the critic's update on `value_targets`;
flowgrpo/text/critic.py: the value model); the tests check it against a float64 loop.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from .advantages import ESTIMATORS
from .contracts import AdvantageResult, GroupBatch, given


@dataclass
class TokenValueBatch(GroupBatch):
    """A GroupBatch with a critic's per-token values (see the module docstring for the shapes)."""

    values: Optional[Tensor] = None
    last_value: Optional[Tensor] = None
    finished: Optional[Tensor] = None

    def __post_init__(self) -> None:
        super().__post_init__()
        rewards = given(self.step_rewards, "TokenValueBatch.step_rewards (per-token rewards)")
        P, G, T = rewards.shape
        for name, want in (("values", (P, G, T)), ("last_value", (P, G)), ("finished", (P, G))):
            t = getattr(self, name)
            if t is None:
                raise ValueError(f"TokenValueBatch.{name} is missing (expected shape {list(want)})")
            if tuple(t.shape) != want:
                raise ValueError(f"TokenValueBatch.{name}: expected shape {list(want)}, got {list(t.shape)}")
        if given(self.finished, "finished").dtype != torch.bool:
            raise ValueError("TokenValueBatch.finished: expected a bool tensor")


def extended_gae(
    rewards: Tensor, values: Tensor, last_value: Tensor, finished: Tensor, mask: Tensor, gamma: float, lam: float
) -> Tensor:
    """Advantages [..., T] of left-aligned responses (mask: a prefix of each row's T slots): GAE whose last delta
    bootstraps from `last_value` where the response is unfinished and from 0 where it finished."""
    mask_f = mask.to(values.dtype)
    length = mask.sum(-1)
    T = rewards.shape[-1]
    adv = torch.zeros_like(values)
    running = torch.zeros_like(last_value)
    tail = torch.where(finished, torch.zeros_like(last_value), last_value)
    next_value = tail
    for t in range(T - 1, -1, -1):  # backwards: each row starts at its own last token
        last = length - 1 == t
        nxt = torch.where(last, tail, next_value)
        delta = rewards[..., t] + gamma * nxt - values[..., t]
        running = torch.where(last, delta, delta + gamma * lam * running) * mask_f[..., t]
        adv[..., t] = running
        next_value = values[..., t]
    return adv


def value_targets(adv: Tensor, values: Tensor, finished: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """The critic's targets A_t + V(s_t) and where they count: the tokens of finished responses only."""
    return adv + values, mask & finished.unsqueeze(-1)


@ESTIMATORS.register("egae", requires=("step_rewards",), reads="step_rewards")
def egae(batch: GroupBatch, *, gamma: float = 1.0, lam: float = 0.95, whiten: bool = False) -> AdvantageResult:
    """T-PPO's Extended GAE: per-token GAE that bootstraps from the critic's value at the cut of unfinished responses
    (needs a TokenValueBatch: the critic's values, the value at the cut and the finished flags)."""
    if not isinstance(batch, TokenValueBatch):
        raise ValueError(
            "advantage estimator 'egae' needs per-token critic values (a TokenValueBatch with values, last_value and "
            "finished); in the text trainer it runs with method tppo, whose critic gives them"
        )
    if not (0.0 <= gamma <= 1.0 and 0.0 <= lam <= 1.0):
        raise ValueError(f"egae: gamma and lam must lie in [0, 1], got gamma={gamma}, lam={lam}")
    mask = given(batch.step_mask, "step_mask") & batch.mask.unsqueeze(-1)
    if bool((mask[..., 1:] & ~mask[..., :-1]).any()):
        raise ValueError("egae: step_mask must be a prefix per response (tokens left-aligned)")
    rewards = torch.nan_to_num(given(batch.step_rewards, "step_rewards").double(), nan=0.0)
    values = given(batch.values, "values").double()
    last_value = given(batch.last_value, "last_value").double()
    finished = given(batch.finished, "finished")
    adv = extended_gae(rewards, values, last_value, finished, mask, gamma, lam)
    if whiten:  # PPO's batch whitening over the live tokens
        live = adv[mask]
        if live.numel() > 1:
            adv = torch.where(mask, (adv - live.mean()) / (live.std() + 1e-8), torch.zeros_like(adv))
    metrics = {
        "egae/unfinished_frac": float((~finished & batch.mask).sum() / batch.mask.sum().clamp_min(1)),
        "egae/adv_mean": float(adv[mask].mean()) if bool(mask.any()) else 0.0,
    }
    return AdvantageResult(adv.to(given(batch.values, "values").dtype), mask.float(), "step", metrics)
