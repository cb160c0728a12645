"""Policy losses composed from named parts: ratio -> bounds -> surrogate -> weights -> regularisers -> aggregation.

The action axis is tokens (text policies) or denoising steps (image policies): every tensor is
[N, T] with a mask, N sequences (or trajectories, or tree edges) of T actions. Each part is a small
function of a `LossContext` and its own settings, registered by name; `requires` names the optional
inputs it reads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace
from typing import Any, Callable, Optional

import torch
from torch import Tensor

from .contracts import given
from .registry import Registry

RATIOS = Registry("ratio")
BOUNDS = Registry("bounds")
SURROGATES = Registry("surrogate")
AGGREGATIONS = Registry("aggregation")
KL_ESTIMATORS = Registry("KL estimator")
STEP_WEIGHTINGS = Registry("step weighting")


@dataclass
class LossInputs:
    """Per-action tensors, all [N, T] unless noted.

    logp / logp_old:  log-prob of each action under the current / rollout policy (flows: Gaussian
                      transition log-prob, mean over latent dims).
    advantages:       [N] (broadcast over actions) or [N, T].
    mask:             bool, which actions count.
    sample_weight:    [N] or [N, T] multipliers; 0 removes the action from the mask (MC-GRPO pivot,
                      filtered groups), so it adds no policy, KL or entropy term and is not counted.
    logp_ref:         reference-policy log-prob (KL k1/k2/k3/k3+).
    entropy:          per-action entropy (entropy bonus).
    mean_sqdist_old:  mean over latent dims of (mean_new - mean_old)^2 (GRPO-Guard RatioNorm).
    mean_sqdist_ref:  mean over latent dims of (mean_new - mean_ref)^2 (closed-form Gaussian KL).
    std:              transition std of each step (flows).
    dt:               step size sigma_i - sigma_{i+1} of each step (flows).
    vocab_mean_logp:  mean over the vocabulary of log pi(. | s_t) at each action's state, current / rollout
    vocab_mean_logp_old: policy (ROVER's next-state term; text policies), no gradient.
    group_index:      [N] long, rows with the same value are samples of one group (REAL's exact group terms;
                      a micro-batch must then hold whole groups).
    """

    logp: Tensor
    logp_old: Tensor
    advantages: Tensor
    mask: Tensor
    sample_weight: Optional[Tensor] = None
    logp_ref: Optional[Tensor] = None
    entropy: Optional[Tensor] = None
    mean_sqdist_old: Optional[Tensor] = None
    mean_sqdist_ref: Optional[Tensor] = None
    std: Optional[Tensor] = None
    dt: Optional[Tensor] = None
    vocab_mean_logp: Optional[Tensor] = None
    vocab_mean_logp_old: Optional[Tensor] = None
    group_index: Optional[Tensor] = None

    def __post_init__(self) -> None:
        if not isinstance(self.logp, Tensor) or self.logp.dim() != 2:
            raise ValueError(f"logp: expected a [N, T] tensor, got {getattr(self.logp, 'shape', type(self.logp))}")
        shape = tuple(self.logp.shape)
        if self.mask.shape != shape:
            raise ValueError(f"mask: expected shape {list(shape)} (as logp), got {list(self.mask.shape)}")
        self.mask = self.mask.bool()
        if self.advantages.dim() == 1:
            self.advantages = self.advantages.unsqueeze(1)
        if self.advantages.shape not in (shape, (shape[0], 1)):
            raise ValueError(
                f"advantages: expected shape [{shape[0]}] or {list(shape)}, got {list(self.advantages.shape)}"
            )
        if self.sample_weight is not None:
            if self.sample_weight.dim() == 1:
                self.sample_weight = self.sample_weight.unsqueeze(1)
            if self.sample_weight.shape not in (shape, (shape[0], 1)):
                raise ValueError(
                    f"sample_weight: expected shape [{shape[0]}] or {list(shape)}, got {list(self.sample_weight.shape)}"
                )
            # weight 0 drops the action entirely: no policy term, no KL, and it is not counted by the normaliser
            self.mask = self.mask & (self.sample_weight != 0).expand(shape)
        per_action = ("logp_old", "logp_ref", "entropy", "mean_sqdist_old", "mean_sqdist_ref", "std", "dt")
        for name in (*per_action, "vocab_mean_logp", "vocab_mean_logp_old"):
            t = getattr(self, name)
            if t is not None and tuple(t.shape) != shape:
                raise ValueError(f"{name}: expected shape {list(shape)} (as logp), got {list(t.shape)}")
        if self.group_index is not None and tuple(self.group_index.shape) != shape[:1]:
            raise ValueError(
                f"group_index: expected shape [{shape[0]}] (one per row), got {list(self.group_index.shape)}"
            )

    def split(self, index: Tensor) -> "LossInputs":
        """The rows `index` of every tensor (a micro-batch)."""
        return replace(
            self, **{f.name: getattr(self, f.name)[index] for f in fields(self) if getattr(self, f.name) is not None}
        )


@dataclass
class LossNormalizer:
    """Global normalisers, counted over the whole optimisation batch (all micro-batches and ranks).

    Passing the same normaliser to every micro-batch makes the summed loss independent of how the
    batch is split. `from_inputs` counts a batch; `all_reduce` sums the counts over ranks.
    """

    num_tokens: float
    num_seqs: float
    const_len: Optional[float] = None
    pos_tokens: float = 0.0
    neg_tokens: float = 0.0
    pos_seqs: float = 0.0
    neg_seqs: float = 0.0
    std_sum: float = 0.0  # sum of the step std over masked actions (noise-aware weighting)

    @classmethod
    def from_inputs(cls, inputs: LossInputs, const_len: Optional[float] = None) -> "LossNormalizer":
        m = inputs.mask
        sign = torch.sign(inputs.advantages).expand_as(m)
        pos, neg = m & (sign > 0), m & (sign < 0)
        return cls(
            num_tokens=float(m.sum()),
            num_seqs=float(m.any(1).sum()),
            const_len=const_len if const_len is not None else float(m.shape[1]),  # the full batch's padded length
            pos_tokens=float(pos.sum()),
            neg_tokens=float(neg.sum()),
            pos_seqs=float(pos.any(1).sum()),
            neg_seqs=float(neg.any(1).sum()),
            std_sum=float(inputs.std[m].sum()) if inputs.std is not None else 0.0,
        )

    def all_reduce(self, reduce: Optional[Callable[[Tensor], Tensor]] = None) -> "LossNormalizer":
        """Sum the counts over data-parallel ranks (torch.distributed by default)."""
        names = ["num_tokens", "num_seqs", "pos_tokens", "neg_tokens", "pos_seqs", "neg_seqs", "std_sum"]
        t = torch.tensor([getattr(self, n) for n in names], dtype=torch.float64)
        if reduce is None:
            import torch.distributed as dist

            if not (dist.is_available() and dist.is_initialized()):
                return self
            dist.all_reduce(t)
        else:
            t = reduce(t)
        return replace(self, **{n: float(v) for n, v in zip(names, t.tolist())})


@dataclass
class LossContext:
    inputs: LossInputs
    norm: LossNormalizer
    raw_log_ratio: Tensor
    log_ratio_clamp: float
    ratio: Optional[Tensor] = None
    low: Tensor | float = 0.0
    high: Tensor | float = math.inf

    @property
    def adv(self) -> Tensor:
        return self.inputs.advantages

    @property
    def ratios(self) -> Tensor:
        """The ratio part's output (set before bounds, surrogate and metrics run)."""
        return given(self.ratio, "LossContext.ratio")

    def need(self, name: str) -> Tensor:
        """An optional LossInputs field that the running part `requires` (checked before any part runs)."""
        value: Optional[Tensor] = getattr(self.inputs, name)
        return given(value, f"LossInputs.{name}")


@dataclass
class LossOutput:
    loss: Tensor
    per_action: Tensor
    metrics: dict[str, float] = field(default_factory=dict)


def mean_over_mask(x: Tensor, mask: Tensor) -> Tensor:
    return torch.where(mask, x, torch.zeros_like(x)).sum() / mask.sum().clamp_min(1)


def _seq_mean(x: Tensor, mask: Tensor) -> Tensor:
    """Mean over the masked actions of each row, [N, 1]."""
    return torch.where(mask, x, torch.zeros_like(x)).sum(1, keepdim=True) / mask.sum(1, keepdim=True).clamp_min(1)


# --- ratio ---------------------------------------------------------------------------------------


@RATIOS.register("token")
def token_ratio(ctx: LossContext) -> Tensor:
    """pi / pi_old per action."""
    return ctx.raw_log_ratio.clamp(-ctx.log_ratio_clamp, ctx.log_ratio_clamp).exp()


@RATIOS.register("sequence")
def sequence_ratio(ctx: LossContext) -> Tensor:
    """GSPO: exp(mean log-ratio over the sequence), the same value for every action of a row."""
    lr = _seq_mean(ctx.raw_log_ratio, ctx.inputs.mask)
    return lr.clamp(-ctx.log_ratio_clamp, ctx.log_ratio_clamp).exp().expand_as(ctx.raw_log_ratio)


@RATIOS.register("sequence_token")
def sequence_token_ratio(ctx: LossContext) -> Tensor:
    """GSPO-token: value of the sequence ratio, gradient of each token's own log-prob."""
    seq = _seq_mean(ctx.raw_log_ratio, ctx.inputs.mask).detach()
    logp = ctx.inputs.logp
    return (seq.clamp(-ctx.log_ratio_clamp, ctx.log_ratio_clamp) + logp - logp.detach()).exp()


@RATIOS.register("ratio_norm", requires=("mean_sqdist_old", "std"))
def ratio_norm(ctx: LossContext) -> Tensor:
    """GRPO-Guard RatioNorm for Gaussian steps: exp(std * (log-ratio + |mu - mu_old|^2 / (2 std^2))).

    The normalised log-ratio equals mean_d(noise * (mu - mu_old)): zero mean over the sampling noise
    and the same scale at every step. The bias term keeps its gradient (it is not detached).
    """
    std = ctx.need("std")
    normed = std * (ctx.raw_log_ratio + ctx.need("mean_sqdist_old") / (2 * std**2))
    return normed.clamp(-ctx.log_ratio_clamp, ctx.log_ratio_clamp).exp()


def guard_log_ratio(logp: Tensor, logp_old: Tensor, mean_sqdist_old: Tensor, std: Tensor) -> Tensor:
    """The RatioNorm log-ratio on its own (diagnostics and tests)."""
    return std * (logp - logp_old + mean_sqdist_old / (2 * std**2))


# --- bounds --------------------------------------------------------------------------------------


@BOUNDS.register("symmetric")
def symmetric(ctx: LossContext, *, eps: float = 0.2) -> tuple[float, float]:
    """[1 - eps, 1 + eps] (PPO; Flow-GRPO uses eps = 1e-4)."""
    return 1 - eps, 1 + eps


@BOUNDS.register("asymmetric")
def asymmetric(ctx: LossContext, *, eps_low: float = 0.2, eps_high: float = 0.28) -> tuple[float, float]:
    """[1 - eps_low, 1 + eps_high] (DAPO clip-higher)."""
    return 1 - eps_low, 1 + eps_high


@BOUNDS.register("dcpo")
def dcpo(ctx: LossContext, *, eps_low: float = 0.16, eps_high: float = 0.2) -> tuple[Tensor, Tensor]:
    """DCPO probability-adaptive bounds from the old token probability q: wider for rare tokens."""
    q = ctx.inputs.logp_old.detach().exp().clamp_min(1e-12)
    low = 0.5 + 0.5 * torch.sqrt((1 - 4 * eps_low / q).clamp_min(0))
    high = 0.5 + 0.5 * torch.sqrt(1 + 4 * eps_high / q)
    return low, high


# --- surrogate -----------------------------------------------------------------------------------


@SURROGATES.register("ppo_clip")
def ppo_clip(ctx: LossContext, *, dual_clip: Optional[float] = None, delta: Optional[float] = None) -> Tensor:
    """max(-A r, -A clip(r, low, high)); `dual_clip` c caps the loss of A < 0 at -A c; `delta` caps r (two-sided)."""
    r, a = ctx.ratios, ctx.adv
    unclipped = -a * (r.clamp(max=delta) if delta is not None else r)
    loss = torch.maximum(unclipped, -a * torch.clamp(r, ctx.low, ctx.high))  # type: ignore[arg-type]  # tensor or number
    if dual_clip is not None:
        loss = torch.where(a < 0, torch.minimum(loss, -a * dual_clip), loss)
    return loss


@SURROGATES.register("sapo")
def sapo(ctx: LossContext, *, tau_pos: float = 1.0, tau_neg: float = 1.05) -> Tensor:
    """SAPO soft gate: -(4 / tau) sigmoid(tau (r - 1)) A; its gradient at r = 1 is the policy gradient."""
    tau = torch.where(ctx.adv > 0, torch.full_like(ctx.adv, tau_pos), torch.full_like(ctx.adv, tau_neg))
    return -(4 / tau) * torch.sigmoid(tau * (ctx.ratios - 1)) * ctx.adv


@SURROGATES.register("cispo")
def cispo(ctx: LossContext) -> Tensor:
    """CISPO: -sg(clip(r, low, high)) A log pi; clipped actions still get a gradient."""
    weight = torch.clamp(ctx.ratios, ctx.low, ctx.high).detach()  # type: ignore[arg-type]  # tensor or number
    return -weight * ctx.adv * ctx.inputs.logp


@SURROGATES.register("reinforce")
def reinforce(ctx: LossContext) -> Tensor:
    """Plain REINFORCE: -A log pi (no ratio, no clipping)."""
    return -ctx.adv * ctx.inputs.logp


# --- per-step weighting (image policies) ---------------------------------------------------------


@STEP_WEIGHTINGS.register("none")
def no_weighting(ctx: LossContext) -> float:
    """Every action weighs 1."""
    return 1.0


@STEP_WEIGHTINGS.register("inv_dt", requires=("dt",))
def inv_dt(ctx: LossContext) -> Tensor:
    """GRPO-Guard gradient reweighting: 1 / dt equalises the gradient scale across noise levels."""
    return 1.0 / ctx.need("dt")


@STEP_WEIGHTINGS.register("noise_aware", requires=("std",))
def noise_aware(ctx: LossContext) -> Tensor:
    """TempFlow-GRPO: std_i / mean std over the batch's trained steps (weights average 1)."""
    mean_std = ctx.norm.std_sum / max(ctx.norm.num_tokens, 1.0)
    return ctx.need("std") / mean_std


@STEP_WEIGHTINGS.register("std_over_dt", requires=("std", "dt"))
def std_over_dt(ctx: LossContext) -> Tensor:
    """Flow-GRPO's Wan 2.1 weight std_dev_t / sqrt(dt) = transition std / dt: yifan123/flow_grpo train_wan2_1.py@32b48fd
    scales each step's policy loss (not the KL) by std_dev_t.mean() / sqrt(dt).mean() over a batch sharing the step."""
    return ctx.need("std") / ctx.need("dt")


# --- KL to the reference policy ------------------------------------------------------------------


def _ref_gap(ctx: LossContext) -> Tensor:
    return ctx.need("logp_ref") - ctx.inputs.logp  # log(pi_ref / pi)


@KL_ESTIMATORS.register("k1", requires=("logp_ref",))
def k1(ctx: LossContext) -> Tensor:
    """log pi - log pi_ref."""
    return -_ref_gap(ctx)


@KL_ESTIMATORS.register("k2", requires=("logp_ref",))
def k2(ctx: LossContext) -> Tensor:
    """(log pi - log pi_ref)^2 / 2: its gradient is the unbiased gradient of KL(pi || pi_ref)."""
    return 0.5 * _ref_gap(ctx) ** 2


@KL_ESTIMATORS.register("k3", requires=("logp_ref",))
def k3(ctx: LossContext) -> Tensor:
    """exp(ref - logp) - (ref - logp) - 1 (low variance, non-negative)."""
    gap = _ref_gap(ctx)
    return gap.exp() - gap - 1


@KL_ESTIMATORS.register("k3+", requires=("logp_ref",))
def k3_plus(ctx: LossContext) -> Tensor:
    """Straight-through: the value of k3 with the gradient of k2."""
    value, grad = k3(ctx), k2(ctx)
    return value.detach() + grad - grad.detach()


@KL_ESTIMATORS.register("gaussian", requires=("mean_sqdist_ref", "std"))
def gaussian_kl(ctx: LossContext) -> Tensor:
    """Closed-form KL of two Gaussian transitions with equal std: mean_d |mu - mu_ref|^2 / (2 std^2).

    The exact per-dimension KL(N(mu, std^2) || N(mu_ref, std^2)) of one step, std the transition std
    (Flow-GRPO SDE: std = std_dev_t * sqrt(dt)). Per step it is 1/dt times the `flow_grpo` form.
    """
    return ctx.need("mean_sqdist_ref") / (2 * ctx.need("std") ** 2)


@KL_ESTIMATORS.register("flow_grpo", requires=("mean_sqdist_ref", "std", "dt"))
def flow_grpo_kl(ctx: LossContext) -> Tensor:
    """Flow-GRPO's KL: mean_d |mu - mu_ref|^2 / (2 std_dev_t^2), std_dev_t = std / sqrt(dt).

    yifan123/flow_grpo scripts/train_sd3.py divides by the kernel's noise level std_dev_t =
    a*sqrt(sigma/(1-sigma)) (sigmas[1] in the denominator at sigma = 1), not by the transition variance
    std_dev_t^2 * dt, so it equals the exact `gaussian` KL times dt. Published betas (Flow-GRPO 0.04 /
    0.01, GRPO-Guard, ...) are on this scale. For DDIM edges dt is 1 and both forms coincide.
    """
    return ctx.need("mean_sqdist_ref") * ctx.need("dt") / (2 * ctx.need("std") ** 2)


# --- aggregation ---------------------------------------------------------------------------------


def _masked_sum(x: Tensor, mask: Tensor) -> Tensor:
    return torch.where(mask, x, torch.zeros_like(x)).sum()


@AGGREGATIONS.register("token_mean")
def token_mean(values: Tensor, ctx: LossContext, *, scale: float = 1.0) -> Tensor:
    """Sum over actions / the global action count (DAPO; invariant to micro-batching), times `scale`.

    `scale` is a constant factor on the loss, seen only through the grad-norm clip and AdamW's eps: BranchGRPO
    divides each edge's loss by (gradient_accumulation_steps x edges per tree), i.e. the mean x 1 / 218.
    """
    if scale <= 0:
        raise ValueError(f"token_mean: scale must be > 0, got {scale}")
    return _masked_sum(values, ctx.inputs.mask) / max(ctx.norm.num_tokens, 1.0) * scale


@AGGREGATIONS.register("local_token_mean")
def local_token_mean(values: Tensor, ctx: LossContext) -> Tensor:
    """Sum / this micro-batch's action count (TRL bnpo; NOT invariant to micro-batching)."""
    return _masked_sum(values, ctx.inputs.mask) / ctx.inputs.mask.sum().clamp_min(1)


@AGGREGATIONS.register("seq_mean_token_mean")
def seq_mean_token_mean(values: Tensor, ctx: LossContext) -> Tensor:
    """Mean over each sequence's actions, then sum / the global sequence count (GRPO, GSPO, SAPO)."""
    m = ctx.inputs.mask
    return _seq_mean(values, m)[m.any(1)].sum() / max(ctx.norm.num_seqs, 1.0)


@AGGREGATIONS.register("seq_mean_token_sum")
def seq_mean_token_sum(values: Tensor, ctx: LossContext) -> Tensor:
    """Sum over each sequence's actions, then / the global sequence count (DCPO OTM)."""
    return _masked_sum(values, ctx.inputs.mask) / max(ctx.norm.num_seqs, 1.0)


@AGGREGATIONS.register("seq_mean_token_sum_norm")
def seq_mean_token_sum_norm(values: Tensor, ctx: LossContext) -> Tensor:
    """Dr. GRPO: sum / (global sequence count * a constant length; default the padded length T)."""
    length = ctx.norm.const_len or values.shape[1]
    return _masked_sum(values, ctx.inputs.mask) / (max(ctx.norm.num_seqs, 1.0) * length)


@AGGREGATIONS.register("balanced")
def balanced(values: Tensor, ctx: LossContext) -> Tensor:
    """Balanced aggregation: token means of the positive and negative subsets, weighted by sequence counts.

    The subsets are split by the sign of each action's advantage; actions with A = 0 are in neither.
    (Batch scope; the paper's group-vs-batch scope is unverified.)
    """
    m = ctx.inputs.mask
    sign = torch.sign(ctx.adv).expand_as(m)
    n = ctx.norm
    total_seqs = max(n.pos_seqs + n.neg_seqs, 1.0)
    pos = _masked_sum(values, m & (sign > 0)) / max(n.pos_tokens, 1.0)
    neg = _masked_sum(values, m & (sign < 0)) / max(n.neg_tokens, 1.0)
    return (n.pos_seqs * pos + n.neg_seqs * neg) / total_seqs


# --- the loss ------------------------------------------------------------------------------------

PRESETS: dict[str, dict[str, Any]] = {
    # named like TRL's `loss_type`, so numbers can be cross-checked against TRL
    "grpo": {"bounds": {"name": "symmetric", "eps": 0.2}, "aggregation": "seq_mean_token_mean"},
    "bnpo": {"bounds": {"name": "symmetric", "eps": 0.2}, "aggregation": "local_token_mean"},
    "dr_grpo": {"bounds": {"name": "symmetric", "eps": 0.2}, "aggregation": "seq_mean_token_sum_norm"},
    "dapo": {"bounds": {"name": "asymmetric", "eps_low": 0.2, "eps_high": 0.28}, "aggregation": "token_mean"},
    "gspo": {
        "ratio": "sequence",
        "bounds": {"name": "asymmetric", "eps_low": 3e-4, "eps_high": 4e-4},
        "aggregation": "seq_mean_token_mean",
    },
    "sapo": {"surrogate": "sapo", "aggregation": "seq_mean_token_mean"},
    # TRL caps the CISPO weight from above only, at epsilon_high = 5: bounds [0, 5]
    "cispo": {
        "surrogate": "cispo",
        "bounds": {"name": "asymmetric", "eps_low": 1.0, "eps_high": 4.0},
        "aggregation": "token_mean",
    },
    # image policies
    # image policies: Flow-GRPO's KL form (beta / (2 std_dev_t^2), see flow_grpo_kl) at its published betas
    "flow_grpo": {
        "bounds": {"name": "symmetric", "eps": 1e-4},
        "aggregation": "token_mean",
        "kl": {"estimator": "flow_grpo", "coef": 0.0},
    },
    "grpo_guard": {
        "ratio": "ratio_norm",
        "bounds": {"name": "symmetric", "eps": 1e-4},
        "aggregation": "token_mean",
        "step_weighting": "inv_dt",
        "kl": {"estimator": "flow_grpo", "coef": 0.0},
    },
}


@torch.no_grad()
def ratio_metrics(ctx: LossContext) -> dict[str, Tensor]:
    """Clip fractions (low side with A < 0, high side with A > 0), ratio range and approximate KL to old, as
    0-dim tensors (policy_loss reads every metric in one transfer); none when no action is unmasked."""
    m = ctx.inputs.mask
    if not bool(m.any()):
        return {}
    r = ctx.ratios.detach()
    a = ctx.adv.expand_as(r)
    low = torch.as_tensor(ctx.low, dtype=r.dtype, device=r.device).expand_as(r)
    high = torch.as_tensor(ctx.high, dtype=r.dtype, device=r.device).expand_as(r)
    clip_low = (a < 0) & (r < low)
    clip_high = (a > 0) & (r > high)
    lr = ctx.raw_log_ratio.detach()
    return {
        "clip/low_frac": mean_over_mask(clip_low.float(), m),
        "clip/high_frac": mean_over_mask(clip_high.float(), m),
        "clip/frac": mean_over_mask((clip_low | clip_high).float(), m),
        # masked reductions without boolean indexing (no data-dependent shape: no device sync on a GPU)
        "ratio/min": torch.where(m, r, torch.full_like(r, math.inf)).min(),
        "ratio/mean": mean_over_mask(r, m),
        "ratio/max": torch.where(m, r, torch.full_like(r, -math.inf)).max(),
        "approx_kl": mean_over_mask(0.5 * lr**2, m),
    }
