"""ETR (outcome-guided Elastic Trust Regions; Zhang et al., 2026, arXiv 2601.03723): clip bounds that widen with the
signal's quality. Paper only: no public code was found, and the paper's functions g and h were not recovered (the
note anchors_text_grpo.md 2.14 marks the form ✖); the abstract gives the structure

    eps_i = eps_0 * g(|A_i|) * h(Var_q)

micro: wider for a high-|A| (high-confidence) sample; macro: wider for a group in the "optimal learning zone", by
its pass-rate variance p_q (1 - p_q). The forms below are ours, both >= 1 and bounded:

    g(|A|) = 1 + alpha * min(|A|, a_max)          h(v) = 1 + beta * 4 v   (4 v in [0, 1], 1 at p = 1/2)
    low = 1 - eps_low * g * h (at least 0),       high = 1 + eps_high * g * h

The bounds part sees each sample's advantage, not its group's rewards, so v is read from A: for 0 / 1 rewards and
GRPO's (r - mean) / (biased std), |A| = sqrt((1 - p) / p) for a success and sqrt(p / (1 - p)) for a failure, so
p (1 - p) = A^2 / (1 + A^2)^2 exactly (`pass_rate_variance`; recipe `etr` uses that estimator). With other rewards
or advantages it is the same function of A, a proxy that is largest at |A| = 1.
"""

from __future__ import annotations

from torch import Tensor

from .losses import BOUNDS, LossContext


def pass_rate_variance(adv: Tensor) -> Tensor:
    """p (1 - p) of a sample's group, from its GRPO advantage over 0 / 1 rewards (biased std): A^2 / (1 + A^2)^2."""
    a2 = adv.double() ** 2
    return (a2 / (1 + a2) ** 2).to(adv.dtype)


def etr_scale(adv: Tensor, *, alpha: float, beta: float, a_max: float) -> Tensor:
    """g(|A|) h(v): the factor on the base clip range of each sample (see the module doc)."""
    micro = 1 + alpha * adv.abs().clamp(max=a_max)
    macro = 1 + beta * 4 * pass_rate_variance(adv)
    return micro * macro


@BOUNDS.register("etr")
def etr(
    ctx: LossContext,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    alpha: float = 0.1,
    beta: float = 0.5,
    a_max: float = 3.0,
) -> tuple[Tensor, Tensor]:
    """ETR elastic bounds: [1 - eps_low s, 1 + eps_high s], s = (1 + alpha min(|A|, a_max)) (1 + beta 4 p(1 - p)),
    p(1 - p) the group's pass-rate variance read from A (0 / 1 rewards, GRPO advantages). g and h are ours (paper
    only, its forms not recovered)."""
    for name, value in (("eps_low", eps_low), ("eps_high", eps_high), ("alpha", alpha), ("beta", beta)):
        if value < 0:
            raise ValueError(f"etr: {name} must be >= 0, got {value}")
    scale = etr_scale(ctx.adv.detach().float(), alpha=alpha, beta=beta, a_max=a_max)
    return (1 - eps_low * scale).clamp_min(0.0), 1 + eps_high * scale
