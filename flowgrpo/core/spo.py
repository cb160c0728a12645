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

rho: `rho_type: constant` (the default) forgets by the constant `rho` (0.96). `rho_type: kl` is the KL-adaptive
forgetting factor of the public code (verl-project/verl-recipe spo/spo_ray_trainer.py @
550d42f53169e41b36921faef86336fdfc558820, `_get_spo_rho`, ✔): per prompt, D = the token mean of
|log pi_stored - log pi_current| over the prompt's last stored response (`kl_drift`), and
rho = clip(2^(-D / d_half), rho_min, rho) with d_half 0.06, rho_min 0.875 (its scripts' SPO_RHO_CLIP_LOWER) and
the upper clip `rho` 0.96 (`kl_adaptive_rho`); a prompt seen for the first time has D = 0. It reads the drift per
group from `GroupBatch.drift` [P], which the text trainer fills (flowgrpo/text/drift.py: it stores each prompt's
last response with its log-probs and re-scores it under the current policy before the advantages); the source
computes D after the step's update, the trainer before it (one update earlier, ◐). With G > 1 samples of a prompt in one step (the paper:
G = 1) the tracker takes them as G observations with one forgetting step. Prioritised sampling: prompt sampler
`spo` (prompt_state.py).

ACE: for a sample with A_i < 0, A_i <- A_i (1 + alpha softplus(c_i - offset)), c_i = log pi_theta(o_i | q) -
log pi_ref(o_i | q) summed over the sequence (the REFERENCE model's log-probs, as the paper's summary says: it
needs them even without a KL term); other samples are unchanged. alpha and any offset were not recovered from the
paper (◐): both are settings, alpha 1 and offset 0 ours.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

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
    rho_type: str = "constant",
    d_half: float = 0.06,
    rho_min: float = 0.875,
) -> AdvantageResult:
    """SPO: A = r - v(prompt), v the prompt's Beta tracker (alpha / (alpha + beta), before this step), whitened over
    the batch; then alpha <- rho alpha + r, beta <- rho beta + 1 - r. Rewards are mapped by (r - low) / (high - low)
    and must then lie in [0, 1]; a prompt's first sight starts it at alpha = prior_count p0,
    beta = prior_count (1 - p0), p0 its offline success rate (the table's prior) where known, else prior_value.
    rho_type 'kl': rho per prompt = clip(2^(-D / d_half), rho_min, rho), D from GroupBatch.drift."""
    if not high > low:
        raise ValueError(f"spo: high must exceed low, got low={low}, high={high}")
    rhos = _forgetting(batch, rho, rho_type, d_half, rho_min)
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
            alpha[row] = rhos[p] * alpha[row] + vals.sum()
            beta[row] = rhos[p] * beta[row] + (1 - vals).sum()
    if normalize:
        flat, flat_ok = adv.reshape(-1), ok.reshape(-1)
        mean = masked_mean(flat, flat_ok, dim=0)
        std = masked_std(flat, flat_ok, dim=0, unbiased=True)
        adv = (adv - mean) / (std + eps)
    metrics = {
        "spo/baseline_mean": float(baseline.mean()),
        "spo/new_prompts": float(new.sum()),
        "spo/rho": float(rhos.mean()),
    }
    return _sample_result(adv.to(r.dtype), ok, batch, **metrics)


STATEFUL_ESTIMATORS.add("spo")


def kl_drift(stored_logp: Tensor, current_logp: Tensor, mask: Tensor) -> Tensor:
    """D per response [M]: the mean over its tokens (`mask`) of |log pi_stored - log pi_current| ([M, T] each)."""
    m = mask.to(torch.float64)
    diff = (stored_logp.double() - current_logp.double()).abs() * m
    return diff.sum(-1) / m.sum(-1).clamp_min(1)


def kl_adaptive_rho(drift: Tensor, d_half: float = 0.06, rho_min: float = 0.875, rho_max: float = 0.96) -> Tensor:
    """SPO's KL-adaptive forgetting factor clip(2^(-D / d_half), rho_min, rho_max), float64."""
    if not (d_half > 0 and 0.0 <= rho_min <= rho_max <= 1.0):
        raise ValueError(
            f"spo: expected d_half > 0 and 0 <= rho_min <= rho <= 1, got d_half={d_half}, rho_min={rho_min}, "
            f"rho={rho_max}"
        )
    return torch.pow(2.0, -drift.double() / d_half).clamp(rho_min, rho_max)


def _forgetting(batch: GroupBatch, rho: float, rho_type: str, d_half: float, rho_min: float) -> Tensor:
    """rho per group [P]: the constant, or the KL-adaptive one from the batch's per-group drift."""
    P = batch.num_groups
    if rho_type == "constant":
        return torch.full((P,), float(rho), dtype=torch.float64)
    if rho_type != "kl":
        raise ValueError(f"spo: rho_type must be 'constant' or 'kl', got {rho_type!r}")
    drift = batch.drift  # the trainer's per-group D
    if drift is None:
        raise ValueError(
            "spo: rho_type 'kl' needs GroupBatch.drift [P] (each prompt's mean |stored - current| token log-prob "
            "over its last response, 0 at first sight), which the text trainer records; elsewhere use rho_type "
            "'constant'"
        )
    drift = torch.as_tensor(drift, dtype=torch.float64).reshape(-1)
    if drift.shape != (P,) or bool((drift < 0).any()) or not bool(torch.isfinite(drift).all()):
        raise ValueError(f"spo: GroupBatch.drift must hold {P} finite values >= 0, got {drift.tolist()}")
    return kl_adaptive_rho(drift, d_half, rho_min, rho)


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
