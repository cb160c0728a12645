"""SPAE: Step Potential Advantage Estimation (per reasoning step).

"Step Potential Advantage Estimation: Harnessing Intermediate Confidence and Correctness for Efficient Mathematical
Reasoning"; public code cii030/SPAE-RL: README @ 98b2f46300d848ea1bfbc14f3fb6c6790af0ca45 and the probe example
inference/probe_mechanism_example.py @ 1f8c839df2965cb8dbf89111843b1c8d68c9acc4 (its training code, train/recipe/,
is not in the snapshot). Research note anchors_text_grpo.md 2.24.

From the source (✔):
- Steps: the chain of thought is split after each token that ends with ".\\n\\n" inside <think> ... </think>
  (`step_ends`).
- Probe: after step k the prefix is continued with "**Final Answer**\\n\\boxed{" and N short continuations are
  sampled (N = 5, temperature 0.6, 10 tokens). For each continuation s over the gold answer's K tokens:
  acc_s = exp(sum_k log p(gold_k)) / K and conf_s = exp(-sum_k H_k) / K (H_k the entropy at probe position k); acc
  and conf are their means over the N continuations (`probe_scores`).
- Step potential Phi_k = 1.5 acc conf + 0.5 acc - conf (in [-1, 2]); Delta Phi_0 = 0, Delta Phi_k = Phi_k -
  Phi_{k-1}; a potential above 0.9 counts as "solved" (the source's diagnostic threshold).
- Token advantage A_{i,j} = A_i^Group f(Phi_{i,M(j)}) + xi g(Delta Phi_{i,M(j)}), M(j) the step of token j.

Reconstructed (◐, the README names f, g and xi without defining them): f = `saturation_weight` (0.5, ours) for a
positive outcome advantage on the steps after the first step whose potential reaches `saturation` (0.9, the
source's threshold), 1 elsewhere (outcome credit for post-solution checking shrinks; negative credit is kept);
g = clip(Delta Phi, -`shaping_clip`, `shaping_clip`) (1.0, ours); xi = `shaping_coef` (0.1, ours). A^Group is
GRPO's group z-score of the outcome reward.

The estimator `spae` reads the outcome rewards and the step potentials (`step_rewards` [P, G, S], `step_mask`) and
gives one advantage per step ("step" level). Running the probes and spreading the step advantages over each step's
tokens (`token_steps`) are the text trainer's work (flowgrpo/text/step_probe.py, called by method `grpo`); its probe
teacher-forces the gold answer by default, or samples N continuations as the source does (see that module). The
probe's settings (`boundary`, `think_end`, `probe_suffix`, `answer_column`, `probe_batch_size`, `probe_samples`,
`probe_temperature`, `probe_max_tokens`) are settings of the estimator, so that a config states them in one place
and `flowgrpo list` shows them; neither the estimator nor the image trainer (whose probes are its plan's) reads them.
"""

from __future__ import annotations

from typing import Collection, Optional, Sequence

import torch
from torch import Tensor

from .advantages import ESTIMATORS, grpo
from .contracts import AdvantageResult, GroupBatch, given

PROBE = "**Final Answer**\n\\boxed{"  # appended after each step by the source's probe


def step_ends(token_ids: Sequence[int], boundary_ids: Collection[int], think_end_id: Optional[int] = None) -> list[int]:
    """Indices of the tokens that end a step: boundary tokens (those whose text ends with ".\\n\\n") before the first
    `think_end_id` (the whole sequence where there is none)."""
    ends = []
    for j, tok in enumerate(token_ids):
        if think_end_id is not None and tok == think_end_id:
            break
        if tok in boundary_ids:
            ends.append(j)
    return ends


def token_steps(length: int, ends: Sequence[int]) -> Tensor:
    """M(j) for each of `length` tokens: the step it belongs to (step k ends at ends[k], inclusive); tokens after the
    last end belong to the last step (ours, ◐: the source scores no potential after the last boundary)."""
    steps = torch.zeros(length, dtype=torch.long)
    start = 0
    for k, end in enumerate(ends):
        steps[start : end + 1] = k
        start = end + 1
    steps[start:] = max(len(ends) - 1, 0)
    return steps


def probe_scores(gold_logprob: Tensor, entropy: Tensor, valid: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """(acc, conf) of one probe point from N continuations over the gold answer's K tokens ([..., N, K] each): the
    source's per-continuation exp(sum log p(gold)) / K and exp(-sum H) / K, averaged over the N continuations.

    `valid` [..., N, K]: the positions each continuation reached (the source reads min(K, its length) of them and
    divides by that count; a continuation that reached none adds 0 to both means)."""
    lp, H = gold_logprob.double(), entropy.double()
    if valid is None:
        valid = torch.ones_like(lp, dtype=torch.bool)
    n = valid.sum(-1)
    zero = torch.zeros_like(lp)
    acc = torch.where(n > 0, torch.where(valid, lp, zero).sum(-1).exp() / n.clamp_min(1), torch.zeros_like(lp[..., 0]))
    conf = torch.where(n > 0, (-torch.where(valid, H, zero).sum(-1)).exp() / n.clamp_min(1), torch.zeros_like(acc))
    return acc.mean(-1), conf.mean(-1)


def step_potential(acc: Tensor, conf: Tensor) -> Tensor:
    """Phi = 1.5 acc conf + 0.5 acc - conf (the source's combination)."""
    return 1.5 * acc * conf + 0.5 * acc - conf


def potential_differences(phi: Tensor, mask: Tensor) -> Tensor:
    """Delta Phi [..., S]: 0 at the first step, Phi_k - Phi_{k-1} after, 0 where `mask` is False."""
    delta = torch.zeros_like(phi)
    delta[..., 1:] = phi[..., 1:] - phi[..., :-1]
    return torch.where(mask, delta, torch.zeros_like(delta))


@ESTIMATORS.register("spae", requires=("rewards", "step_rewards"), reads="step_rewards")
def spae(
    batch: GroupBatch,
    *,
    saturation: float = 0.9,
    saturation_weight: float = 0.5,
    shaping_coef: float = 0.1,
    shaping_clip: float = 1.0,
    eps: float = 1e-4,
    boundary: str = ".\n\n",
    think_end: str = "</think>",
    probe_suffix: str = PROBE,
    answer_column: Optional[str] = None,
    probe_batch_size: int = 0,
    probe_samples: int = 0,
    probe_temperature: float = 0.6,
    probe_max_tokens: int = 10,
) -> AdvantageResult:
    """SPAE: A_k = A^Group f(Phi_k) + xi clip(Delta Phi_k), per reasoning step; f shrinks positive outcome credit
    after the potential first reaches `saturation` (f, g and xi reconstructed). step_rewards = step potentials.

    The text trainer's probe reads the last eight (flowgrpo/text/step_probe.py): a step ends at a token whose text
    ends with `boundary`, before the token `think_end`; the probe appends `probe_suffix` and reads the gold answer
    (the data's `answer_column`; None: the task's own) teacher-forced (`probe_samples` 0), or along
    `probe_samples` continuations sampled at `probe_temperature`, `probe_max_tokens` long (the source: 5, 0.6, 10);
    `probe_batch_size` probe sequences per forward or generate call (0: the trainer's log-prob batch size, or
    generation.batch_size when sampled)."""
    if not 0.0 <= saturation_weight <= 1.0:
        raise ValueError(f"spae: saturation_weight must lie in [0, 1], got {saturation_weight}")
    if shaping_clip <= 0:
        raise ValueError(f"spae: shaping_clip must be > 0, got {shaping_clip}")
    phi = given(batch.step_rewards, "GroupBatch.step_rewards (SPAE step potentials)").double()
    ok_steps = given(batch.step_mask, "step_mask") & batch.mask.unsqueeze(-1) & torch.isfinite(phi)
    if bool((ok_steps[..., 1:] & ~ok_steps[..., :-1]).any()):
        raise ValueError("spae: the steps of each response must be a prefix of step_mask (no gaps, no NaN inside)")
    phi = torch.where(ok_steps, phi, torch.zeros_like(phi))
    outcome = grpo(batch, eps=eps)
    a_group = outcome.advantages.double().unsqueeze(-1)  # [P, G, 1], 0 for unusable samples
    reached = torch.cumsum((phi >= saturation) & ok_steps, dim=-1)
    after = (reached - ((phi >= saturation) & ok_steps).long()) > 0  # strictly after the first saturated step
    f = torch.where(after & (a_group > 0), torch.full_like(phi, saturation_weight), torch.ones_like(phi))
    g = potential_differences(phi, ok_steps).clamp(-shaping_clip, shaping_clip)
    ok = ok_steps & (outcome.sample_weight > 0).unsqueeze(-1)
    adv = torch.where(ok, a_group * f + shaping_coef * g, torch.zeros_like(phi))
    metrics = {
        "spae/saturated_frac": float((reached[..., -1:] > 0).squeeze(-1)[batch.mask].float().mean())
        if bool(batch.mask.any())
        else 0.0,
        "spae/damped_steps": float((after & ok & (a_group > 0)).sum()),
    }
    return AdvantageResult(adv.float(), ok.float(), "step", metrics)
