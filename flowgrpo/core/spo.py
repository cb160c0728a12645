"""SPO (Single-stream Policy Optimization; Xu & Ding, 2025, arXiv 2509.13232) and ACE (asymmetric
confidence-aware error penalty, arXiv 2602.21420).

SPO replaces the group baseline with a persistent per-prompt Beta value tracker (the note anchors_text_grpo.md
2.17; the paper's method section; public code: volcengine/verl recipe/spo, whose trainer at
131ae726feeb4c9dee740f91bbdf0ef79fad0abf (recipe/spo/spo_ray_trainer.py) we read without finding the tracker, so
the formulas below are the paper's, paper-only ◐):

    v(x) = alpha_x / (alpha_x + beta_x)                      the baseline, read BEFORE this step's rewards
    A_i  = r_i - v(x_i), then (A - mean_B A) / (std_B A + eps) over the whole batch
    alpha_x <- rho alpha_x + r,  beta_x <- rho beta_x + (1 - r)   after the step, r in [0, 1]
    alpha_0 = N0 p0, beta_0 = N0 (1 - p0)                    at a prompt's first sight: p0 its offline success
                                                             rate (PromptTable prior) where given, else prior_value

rho: the paper's KL-adaptive forgetting clip(2^(-D / D_half), rho_min, 0.96) needs the stored log-probs of the
prompt's last response re-scored under the current policy; here rho is constant (the paper's `constant` type;
0.96, the adaptive one's value without drift). With G > 1 samples of a prompt in one step (the paper: G = 1) the
tracker takes them as G observations with one forgetting step. Prioritised sampling: prompt sampler `spo`
(prompt_state.py).

ACE: for a sample with A_i < 0, A_i <- A_i (1 + alpha softplus(c_i - offset)), c_i = log pi_theta(o_i | q) -
log pi_ref(o_i | q) summed over the sequence (the REFERENCE model's log-probs, as the paper's summary says: it
needs them even without a KL term); other samples are unchanged. alpha and any offset were not recovered from the
paper (◐): both are settings, alpha 1 and offset 0 ours.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .advantages import ESTIMATORS, _sample_result
from .contracts import AdvantageResult, GroupBatch, given
from .prompt_state import STATEFUL_ESTIMATORS, spo_value
from .stats import masked_mean, masked_std
from .transforms import TRANSFORMS


@ESTIMATORS.register("spo", requires=("prompt_ids", "prompt_state"))
def spo(
    batch: GroupBatch,
    *,
    rho: float = 0.96,
    prior_value: float = 0.5,
    prior_count: float = 2.0,
    low: float = 0.0,
    high: float = 1.0,
    normalize: bool = True,
    eps: float = 1e-8,
) -> AdvantageResult:
    """SPO: A = r - v(prompt), v the prompt's Beta tracker (alpha / (alpha + beta), before this step), whitened over
    the batch; then alpha <- rho alpha + r, beta <- rho beta + 1 - r. Rewards are mapped by (r - low) / (high - low)
    and must then lie in [0, 1]; a prompt's first sight starts it at alpha = prior_count p0,
    beta = prior_count (1 - p0), p0 its offline success rate (the table's prior) where known, else prior_value."""
    if not high > low:
        raise ValueError(f"spo: high must exceed low, got low={low}, high={high}")
    table = given(batch.prompt_state, "GroupBatch.prompt_state (SPO)")
    ids = given(batch.prompt_ids, "GroupBatch.prompt_ids (SPO)")
    r = batch.scalar_rewards()
    ok = batch.usable(r)
    scaled = (r.double() - low) / (high - low)
    if bool((ok & ((scaled < 0) | (scaled > 1))).any()):
        raise ValueError(f"spo: rewards must lie in [low, high] = [{low}, {high}] (set low / high to their range)")
    alpha, beta = table["alpha"], table["beta"]
    new = (alpha[ids] + beta[ids]) == 0
    p0 = table.first_value(prior_value)[ids[new]]
    alpha[ids[new]] = prior_count * p0
    beta[ids[new]] = prior_count * (1 - p0)
    baseline = spo_value(table)[ids]  # [P], before this step
    adv = torch.where(ok, scaled - baseline.unsqueeze(1), torch.zeros_like(scaled))
    for p, row in enumerate(ids.tolist()):  # in batch order: a prompt twice in a batch updates twice
        if bool(ok[p].any()):
            vals = scaled[p][ok[p]]
            alpha[row] = rho * alpha[row] + vals.sum()
            beta[row] = rho * beta[row] + (1 - vals).sum()
    if normalize:
        flat, flat_ok = adv.reshape(-1), ok.reshape(-1)
        mean = masked_mean(flat, flat_ok, dim=0)
        std = masked_std(flat, flat_ok, dim=0, unbiased=True)
        adv = (adv - mean) / (std + eps)
    metrics = {"spo/baseline_mean": float(baseline.mean()), "spo/new_prompts": float(new.sum())}
    return _sample_result(adv.to(r.dtype), ok, batch, **metrics)


STATEFUL_ESTIMATORS.add("spo")


@TRANSFORMS.register("ace", requires=("confidence",))
def ace(result: AdvantageResult, batch: GroupBatch, *, alpha: float = 1.0, offset: float = 0.0) -> AdvantageResult:
    """ACE: negative advantages times 1 + alpha softplus(c - offset), c = the sample's sequence log-prob under the
    policy minus under the reference model (overconfident errors are penalised more)."""
    if result.level != "sample":
        raise ValueError(f"ace: needs sample-level advantages, got {result.level}-level")
    c = given(batch.confidence, "GroupBatch.confidence (ACE)").double()
    factor = 1 + alpha * F.softplus(c - offset)
    adv = result.advantages
    scaled = torch.where(adv < 0, adv.double() * factor, adv.double()).to(adv.dtype)
    neg = (adv < 0) & (result.sample_weight > 0)
    result.metrics["ace/penalty_mean"] = float(factor[neg].mean()) if bool(neg.any()) else 1.0
    result.advantages = scaled
    return result
