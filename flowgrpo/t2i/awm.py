"""method: awm - Advantage Weighted Matching: the flow-matching (pretraining) loss on the policy's own clean
samples, weighted by their advantages. No SDE and no transition log-prob: any sampler (an ODE) rolls out.

For a clean sample x0 with advantage A, training times t (`awm.time_sampling`) and fresh noise eps:
    x_t = (1 - t) x0 + t eps,   err = mean_dims (v_theta(x_t, t) - (eps - x0))^2           (float64)
    logp = -W(err, t):  uniform: err | t: t err | t**2: t^2 err | huber: (sqrt(err + 1e-10) - 1e-5) t
                        ghuber: ((err + 1e-10)^p - (1e-10)^p) t / p
    r = exp(logp - logp_old),  A' = clip(A, +-adv_clip_max) / adv_clip_max * advantage_max
    L = mean_terms max(-A' r, -A' clip(r, 1 - clip_range, 1 + clip_range))
        + kl_coef * mean_terms mean_dims (v_theta - v_ref)^2 + ema_kl_coef * mean_terms mean_dims (v_theta - v_ema)^2
One term is one (sample, time); logp_old is the rollout weights' logp of the same term (on the first
mini-batch it is logp itself, detached: r = 1 and the gradient is A' dW/dtheta). The EMA policy is a second
LoRA adapter, theta_ema <- d theta_ema + (1 - d) theta after each iteration, d = min(ema_kl_decay, rate * clock)
("linear"; the authors: rate 0.001, clock = optimizer steps taken; Flow-Factory: rate 0.3 / 1000, clock = the
iteration's 0-based index) or ema_kl_decay ("constant").

Source: scxue/advantage_weighted_matching @ be51372, advantage_weighted_matching/scripts/train_sd3_awm.py:
compute_log_prob_awm (err, weightings), the training loop's time draws (time_type discrete / discrete_wo_init /
logit_normal), `exp_first` ratio, clipped surrogate and KL ('Uniform' kl_weight), the EMA adapter's decay;
config/dgx_awm.py (recipe values: 6 times, fraction 0.9, ghuber 0.25, clip_range 1, advantage_max 1).
Flow-Factory (X-GenGroup/Flow-Factory @ a0b2bc5, src/flow_factory/trainers/awm.py, compute_weighted_log_prob
and optimize) ships the same loss. Not ported: `sum_first` (the ratio of a sample's mean over its times), the
CFG training forward (the recipes train without CFG) and the ELBO KL weight.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Literal, Optional

import torch
from pydantic import Field
from torch import Tensor

from ..config import ConfigError
from ..core import StrictModel, compute_advantages
from ..run.update import MiniBatch, MicroLoss, pass_generator, record_update, run_update
from .methods import METHODS, ImageContext, ImageMethod, ScoredRollout, leaf_batch
from .extra_lora import active_lora, add_frozen_lora

TimeSampling = Literal["discrete", "discrete_wo_init", "logit_normal"]
EMA_ADAPTER = "awm_ema"


class MatchingTimes(StrictModel):
    """Where a forward-process method trains: `timesteps` times per sample, drawn per micro-batch."""

    timesteps: int = Field(6, ge=1)  # training times per sample (train_timesteps)
    time_sampling: TimeSampling = "discrete_wo_init"
    timestep_fraction: float = Field(0.9, gt=0, le=1)  # discrete: grid indices below int(steps * fraction)
    time_shift: float = Field(3.0, gt=0)  # logit_normal: t -> s t / (1 + (s - 1) t)


class AWMConfig(MatchingTimes):
    """Advantage Weighted Matching (method: awm)."""

    weighting: Literal["uniform", "t", "t**2", "huber", "ghuber"] = "ghuber"
    ghuber_power: float = Field(0.25, gt=0)
    clip_range: float = Field(1.0, ge=0)  # ratio clip [1 - c, 1 + c] (the authors' recipes: 1)
    adv_clip_max: float = Field(5.0, gt=0)
    advantage_max: Optional[float] = Field(1.0, gt=0)  # A -> A / adv_clip_max * advantage_max (None: keep A)
    kl_coef: float = Field(0.0, ge=0)  # |v - v_ref|^2 (recipes: 1e-4 .. 3e-3)
    ema_kl_coef: float = Field(0.0, ge=0)  # |v - v_ema|^2 (recipes: 1)
    ema_kl_decay: float = Field(0.3, ge=0, lt=1)
    ema_kl_decay_type: Literal["linear", "constant"] = "linear"
    # linear: d = min(ema_kl_decay, ema_kl_decay_rate * clock). The authors: 0.001 per optimizer step taken;
    # Flow-Factory: ema_decay / warmup_steps (0.3 / 1000) per iteration, counted before the iteration's update
    ema_kl_decay_rate: float = Field(0.001, gt=0)
    ema_kl_clock: Literal["optimizer_steps", "iterations"] = "optimizer_steps"


# --- the formulas --------------------------------------------------------------------------------


def matching_error(v: Tensor, eps: Tensor, x0: Tensor) -> Tensor:
    """mean_dims (v - (eps - x0))^2 per sample [B], float64 (the flow-matching loss of each sample)."""
    return ((v.double() - (eps.double() - x0.double())) ** 2).flatten(1).mean(1)


def weighted_log_prob(err: Tensor, t: Tensor, weighting: str, power: float = 0.25) -> Tensor:
    """AWM's log-likelihood surrogate -W(err, t) [B], float64."""
    t = t.double().view(-1)
    if weighting == "uniform":
        return -err
    if weighting == "t":
        return -err * t
    if weighting == "t**2":
        return -err * t**2
    if weighting == "huber":
        return -(torch.sqrt(err + 1e-10) - 1e-5) * t
    if weighting == "ghuber":
        tiny = torch.tensor(1e-10, dtype=err.dtype, device=err.device)
        return -(torch.pow(err + tiny, power) - torch.pow(tiny, power)) * t / power
    raise ValueError(f"awm.weighting: unknown {weighting!r}")


def ema_kl_decay(s: AWMConfig, optimizer_steps: int, iteration: int) -> float:
    """The EMA policy's decay after an iteration: `optimizer_steps` taken so far, `iteration` its 0-based index."""
    if s.ema_kl_decay_type == "constant":
        return s.ema_kl_decay
    clock = optimizer_steps if s.ema_kl_clock == "optimizer_steps" else iteration
    return min(s.ema_kl_decay, s.ema_kl_decay_rate * clock)


def awm_advantage(adv: Tensor, adv_clip_max: float, advantage_max: Optional[float]) -> Tensor:
    a = adv.clamp(-adv_clip_max, adv_clip_max)
    return a if advantage_max is None else a / adv_clip_max * advantage_max


def awm_policy_loss(logp: Tensor, logp_old: Tensor, adv: Tensor, clip_range: float) -> tuple[Tensor, Tensor]:
    """Per-term clipped surrogate [B] and the ratio [B] (float64)."""
    ratio = torch.exp(logp - logp_old.detach())
    adv = adv.double().to(ratio.device)
    per = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - clip_range, 1 + clip_range))
    return per, ratio.detach()


def draw_times(g: torch.Generator, times: MatchingTimes, sigmas: Tensor) -> Tensor:
    """`times.timesteps` sigmas, stratified, in random order (one micro-batch's; every sample shares them).

    discrete: grid indices, one per stratum of [0, int(steps * fraction)); discrete_wo_init: of [1, ...);
    logit_normal: stratified normal quantiles -> sigmoid -> shift, floored at 0.01."""
    T, steps = times.timesteps, len(sigmas) - 1
    if times.time_sampling == "logit_normal":
        base = ((torch.arange(T) + torch.rand(T, generator=g)) / T).clamp(1e-7, 1 - 1e-7)
        u = torch.distributions.Normal(0.0, 1.0).icdf(base)[torch.randperm(T, generator=g)]
        t = torch.sigmoid(u)
        return (times.time_shift * t / (1 + (times.time_shift - 1) * t)).clamp_min(0.01)
    first = 0 if times.time_sampling == "discrete" else 1
    last = max(int(steps * times.timestep_fraction), first + 1)
    return sigmas[stratified_indices(g, first, last, T).clamp(0, steps - 1)].float()


def stratified_indices(g: torch.Generator, first: int, last: int, count: int) -> Tensor:
    """`count` grid indices, one drawn uniformly in each stratum [floor(b_k), floor(b_k+1)) of
    b = linspace(first, last, count + 1) (the stratum's start when it is empty), in stratum order."""
    bounds = torch.linspace(first, last, count + 1)
    low, high = bounds[:-1].long(), bounds[1:].long()
    return low + (torch.rand(count, generator=g) * (high - low)).long()


# --- the EMA policy: a second LoRA adapter (this module is imported by the config: no t2i.model import) ---


@torch.no_grad()
def blend(target: list[Tensor], source: list[Tensor], decay: float) -> None:
    """target <- decay target + (1 - decay) source."""
    for t, s in zip(target, source):
        t.lerp_(s.detach().to(t.dtype), 1 - decay)


# --- the plug-in ---------------------------------------------------------------------------------


@dataclass
class Term:
    """Samples `rows` (local ids) at time t (shared) with noise eps: one forward, one backward."""

    rows: Tensor
    t: Tensor  # [B]
    eps: Tensor
    logp_old: Optional[Tensor] = None  # AWM: filled before the first optimizer step


class MatchingMethod(ImageMethod):
    """A forward-process method over the clean samples of the rollout: per sample a coefficient (AWM: its
    advantage, SFT: its weight), per (sample, time) a term; subclasses give the coefficients and the loss."""

    section = ""  # the config section (its MatchingTimes and kl_coef)
    uses_ratio = False

    @classmethod
    def settings(cls, cfg: Any) -> Any:
        return getattr(cfg, cls.section)

    @staticmethod
    def check_config(cfg: Any) -> None:
        if cfg.plan.name not in ("ode_only", "full_sde", "window"):
            raise ValueError(
                f"method '{cfg.method}' trains on clean samples only; plan '{cfg.plan.name}' means nothing"
            )
        if cfg.sampler.cfg_mode != "none":
            raise ValueError(f"method '{cfg.method}' trains the CFG-free velocity: set sampler.cfg_mode none")

    @classmethod
    def needs_reference(cls, cfg: Any) -> bool:
        return cls.settings(cfg).kl_coef != 0

    def coefficients(self, rollout: ScoredRollout, record: dict[str, Any]) -> tuple[Tensor, Tensor]:
        """(coefficient, normaliser weight) of every sample, global order."""
        raise NotImplementedError

    def term_loss(self, v: Tensor, term: Term, x0: Tensor, coef: Tensor) -> tuple[Tensor, dict[str, float]]:
        """The per-term numerators [B] (the mini-batch normaliser divides them) and metrics."""
        raise NotImplementedError

    def extra_velocities(self) -> list[tuple[float, Callable[[], ContextManager[Any]], str]]:
        """(coefficient, policy, metric) of each velocity-space penalty mean_dims |v - v_other|^2."""
        s = self.settings(self.ctx.cfg)
        return [(s.kl_coef, self.ctx.reference, "kl/ref_mean")] if s.kl_coef else []  # type: ignore[list-item]

    def group_rewards(self, rollout: ScoredRollout, record: dict[str, Any]) -> tuple[Tensor, Tensor]:
        """(advantages [P * L], weighted rewards [P, L]) of every sample, global order; NaN rewards -> A = 0."""
        cfg = self.ctx.cfg
        batch = leaf_batch(rollout, cfg)
        result = compute_advantages(batch, cfg.advantage)
        record.update(result.metrics)
        weights = torch.tensor([r.weight for r in cfg.rewards], dtype=batch.rewards.dtype)
        return result.advantages.reshape(-1).float(), (batch.rewards * weights).sum(-1)

    def update(self, rollout: ScoredRollout, record: dict[str, Any]) -> None:
        ctx = self.ctx
        cfg, dist, tree, adapter = ctx.cfg, ctx.dist, rollout.tree, ctx.adapter
        s = self.settings(cfg)
        schedule = tree.schedule
        if not hasattr(schedule, "sigmas"):
            raise ConfigError(f"method '{cfg.method}' needs a flow-matching model (sigma schedule)")
        sig = schedule.sigmas.float().cpu()
        L = tree.leaves.shape[1]
        coef, norm_w = self.coefficients(rollout, record)
        mine, _ = dist.localize(torch.arange(coef.numel()), cfg.rollout_prompts * L)
        coef, norm_w = coef[mine], norm_w[mine]
        x0 = tree.leaf_latents().flatten(0, 1)
        prompt_of = torch.arange(tree.num_prompts).repeat_interleave(L)
        keep = (norm_w > 0).nonzero().squeeze(1)
        embeds = adapter.encode_prompts(rollout.prompts)
        counters = ctx.sampler.counters
        penalties = self.extra_velocities()

        def velocity(policy: Any, term: Term) -> tuple[Tensor, Tensor]:
            x_0 = x0[term.rows].float()
            t = term.t.to(x_0.device)
            tt = t.view(-1, *([1] * (x_0.dim() - 1)))
            x_t = (1 - tt) * x_0 + tt * term.eps.to(x_0.device)
            rows = embeds.index(prompt_of[term.rows])
            return policy.model_output(x_t, t, rows, cfg.sampler.guidance_scale, "none"), x_0

        def loss_of(term: Term, norm: float, c: Tensor) -> tuple[Tensor, dict[str, float]]:
            v, x_0 = velocity(adapter, term)
            counters.nfe_grad += term.rows.numel()
            per, metrics = self.term_loss(v, term, x_0, c.to(v.device))
            loss = per.sum().float() / norm
            metrics["loss/policy"] = float(loss.detach())
            for beta, policy, name in penalties:
                with torch.no_grad(), policy() as other:
                    v_other = velocity(other, term)[0]
                counters.nfe_nograd += term.rows.numel()
                gap = ((v.float() - v_other.float()) ** 2).flatten(1).mean(1)
                loss = loss + beta * gap.sum() / norm
                metrics[name] = float(gap.detach().mean())
            return loss, metrics

        layout = self._layout(keep, norm_w, x0, sig, s)
        if self.uses_ratio:
            self._old_log_probs(layout, lambda term: velocity(adapter, term))

        def micro_loss(term: Term, norm: float, on_policy: bool) -> MicroLoss:
            loss, metrics = loss_of(term, norm, coef[term.rows])
            return MicroLoss(loss, metrics, term.rows.numel())

        def padding_loss(norm: float) -> Tensor:  # a sharded run's extra pass: the same forwards, coefficient 0
            term = Term(torch.zeros(1, dtype=torch.long), sig[:1], torch.zeros_like(x0[:1]).float())
            return loss_of(term, 1.0, torch.zeros(1))[0]

        result = run_update(iter(layout), micro_loss, padding_loss, ctx.optimizer_step, dist)
        record_update(record, result, len(ctx.optimizer_step.norms), dist.lockstep)
        record[f"{self.section}/samples"] = int(dist.sum(float(keep.numel())))
        self.after_update(record)

    def after_update(self, record: dict[str, Any]) -> None:
        """After the iteration's optimizer steps (AWM: the EMA adapter's soft update)."""

    def _layout(self, keep: Tensor, norm_w: Tensor, x0: Tensor, sig: Tensor, s: Any) -> list[list[MiniBatch]]:
        """Per inner epoch, the mini-batches: the kept samples in a seeded order, micro-batches of samples, each
        at `s.timesteps` times (one term each, fresh noise); the normaliser is the mini-batch's global sum of
        normaliser weights x times."""
        cfg, dist = self.ctx.cfg, self.ctx.dist
        out = []
        for epoch in range(cfg.train.inner_epochs):
            g = pass_generator(cfg.seed, self.ctx.iteration, epoch)
            order = keep[torch.randperm(keep.numel(), generator=g)]
            minis = list(order.chunk(cfg.train.mini_batches)) if keep.numel() else []
            minis += [keep[:0]] * (dist.most(len(minis)) - len(minis))  # every rank steps the optimizer alike
            epoch_minis = []
            for mini in minis:
                terms = []
                for micro in mini.split(cfg.train.micro_batch_size) if mini.numel() else ():
                    for t in draw_times(g, s, sig):
                        eps = torch.randn(x0[micro].shape, generator=g)
                        terms.append(Term(micro, t.expand(micro.numel()).clone(), eps))
                norm = dist.sum(float(norm_w[mini].sum()) * s.timesteps)
                epoch_minis.append(MiniBatch(terms, max(norm, 1e-12)))
            out.append(epoch_minis)
        return out

    def _old_log_probs(self, layout: list[list[MiniBatch]], forward: Callable[[Term], tuple[Tensor, Tensor]]) -> None:
        """logp_old of every term trained after the first optimizer step, under the rollout weights (no grad);
        the first mini-batch's terms take theirs from their own forward (on policy: r = 1)."""
        counters = self.ctx.sampler.counters
        first = True
        for minis in layout:
            for mini in minis:
                if not first:
                    for term in mini.micros:
                        with torch.no_grad():
                            v, x_0 = forward(term)
                        counters.nfe_nograd += term.rows.numel()
                        term.logp_old = self.log_prob(v, term, x_0).detach()
                first = False

    def log_prob(self, v: Tensor, term: Term, x0: Tensor) -> Tensor:
        raise NotImplementedError


@METHODS.register("awm")
class AWMMethod(MatchingMethod):
    """Advantage Weighted Matching: the advantage-weighted flow-matching loss, PPO-clipped, on clean samples."""

    section = "awm"
    uses_ratio = True

    @staticmethod
    def prepare_model(adapter: Any, cfg: Any) -> None:
        """The EMA policy of the EMA-KL term: a second LoRA adapter, frozen (before sharding)."""
        if cfg.awm.ema_kl_coef == 0:
            return
        add_frozen_lora(adapter, cfg.model.lora, EMA_ADAPTER)

    @staticmethod
    def check_config(cfg: Any) -> None:
        MatchingMethod.check_config(cfg)
        if cfg.awm.ema_kl_coef and cfg.model.finetune != "lora":
            raise ValueError("awm.ema_kl_coef keeps the EMA policy as a second LoRA adapter: finetune must be 'lora'")

    def __init__(self, ctx: ImageContext) -> None:
        super().__init__(ctx)
        self.ema_params = ctx.adapter.lora_parameters(EMA_ADAPTER) if ctx.cfg.awm.ema_kl_coef else []
        blend(self.ema_params, ctx.params, 0.0)

    def extra_velocities(self) -> list[tuple[float, Callable[[], ContextManager[Any]], str]]:
        out = super().extra_velocities()
        s = self.ctx.cfg.awm
        if s.ema_kl_coef:
            out.append((s.ema_kl_coef, lambda: active_lora(self.ctx.adapter, EMA_ADAPTER), "awm/ema_kl_mean"))
        return out

    def coefficients(self, rollout: ScoredRollout, record: dict[str, Any]) -> tuple[Tensor, Tensor]:
        s = self.ctx.cfg.awm
        adv = awm_advantage(self.group_rewards(rollout, record)[0], s.adv_clip_max, s.advantage_max)
        penalised = s.kl_coef != 0 or s.ema_kl_coef != 0  # a zero-advantage sample still carries the KL terms
        return adv, ((adv != 0) | penalised).float()

    def log_prob(self, v: Tensor, term: Term, x0: Tensor) -> Tensor:
        s = self.ctx.cfg.awm
        err = matching_error(v, term.eps.to(v.device), x0)
        return weighted_log_prob(err, term.t.to(v.device), s.weighting, s.ghuber_power)

    def term_loss(self, v: Tensor, term: Term, x0: Tensor, coef: Tensor) -> tuple[Tensor, dict[str, float]]:
        logp = self.log_prob(v, term, x0)
        old = logp.detach() if term.logp_old is None else term.logp_old.to(logp.device)
        per, ratio = awm_policy_loss(logp, old, coef, self.ctx.cfg.awm.clip_range)
        c = self.ctx.cfg.awm.clip_range
        metrics = {
            "ratio/mean": float(ratio.mean()),
            "ratio/min": float(ratio.min()),
            "ratio/max": float(ratio.max()),
            "clip/frac": float(((ratio - 1).abs() > c).double().mean()),
            "awm/matching_loss": float(-logp.detach().mean()),
        }
        return per, metrics

    def after_update(self, record: dict[str, Any]) -> None:
        s = self.ctx.cfg.awm
        if not s.ema_kl_coef:
            return
        decay = ema_kl_decay(s, self.ctx.optimizer_step.total, self.ctx.iteration)
        blend(self.ema_params, self.ctx.params, decay)
        record["awm/ema_decay"] = decay

    def checkpoint_parts(self, parts: Any) -> None:
        if self.ema_params:
            parts.tensors["awm_ema"] = {f"{i}": p.detach() for i, p in enumerate(self.ema_params)}

    def restore(self, ckpt: Any) -> None:
        with torch.no_grad():
            for i, p in enumerate(self.ema_params):
                p.copy_(ckpt.tensors["awm_ema"][f"{i}"])


def term_count(layout: list[list[MiniBatch]]) -> int:
    """Terms (forward + backward passes) of a layout (tests, cost notes)."""
    return sum(len(m.micros) for minis in layout for m in minis)


__all__ = [
    "AWMConfig",
    "AWMMethod",
    "MatchingMethod",
    "MatchingTimes",
    "awm_advantage",
    "awm_policy_loss",
    "draw_times",
    "ema_kl_decay",
    "matching_error",
    "weighted_log_prob",
    "term_count",
]
