"""method: nft - DiffusionNFT: the forward-process objective, and the old policy's soft update.

Rollouts come from the old policy (LoRA adapter "old") with any sampler; only clean samples x0 are kept.
For a sample with optimality probability r in [0, 1] (the `nft_optimality` transform of its advantage)
and a noised x_t = (1 - t) x0 + t eps:
    v+ = beta v_theta + (1 - beta) v_old         v- = (1 + beta) v_old - beta v_theta
    L  = adv_max * mean_batch( r * L(v+) / beta + (1 - r) * L(v-) / beta ) + kl_coef * |v_theta - v_ref|^2
where L(v) = mean|x0_hat(v) - x0|^2 / sg(max(mean|x0_hat(v) - x0|, 1e-5)), x0_hat(v) = x_t - t v (adaptive
weighting; the weight in float64, floored at 1e-5, as NVlabs/DiffusionNFT scripts/train_nft_sd3.py).

CFG rollouts (sampler.cfg_mode full) are Flow-Factory's (X-GenGroup/Flow-Factory @ a0b2bc5,
src/flow_factory/trainers/nft.py): `_compute_nft_output` passes the training arguments (guidance_scale) and the
sample's negative prompt embeddings to the model adapter's forward, which returns the GUIDED velocity
v_u + w (v_c - v_u) with no detach (models/flux/flux2_klein.py `_forward`). So v_theta, v_old and v_ref above are
all guided velocities, both branches with gradient: sampler.train_cfg_mode full, the only mode accepted with CFG
rollouts. The NVlabs release is CFG-free in practice (its recipes sample at guidance 1.0; with guidance > 1 its
training loop concatenates the negative embeddings without doubling x_t: scripts/train_nft_sd3.py @ 24af555).
nft_gardo keeps the CFG-free refusal (its reference penalty runs the conditional velocity).

Training times (nft.time_sampling): "permutation", the release's int(steps * timestep_fraction) grid times per
sample in a fresh permutation each; "discrete", Flow-Factory's TimeSampler.discrete (utils/noise_schedule.py @
a0b2bc5): nft.timesteps grid times shared by a micro-batch (Flow-Factory's per-device batch), one per stratum of
the grid indices whose sigma is >= 1 - timestep_fraction (`timestep_range`). The old policy is Flow-Factory's EMA
(`off_policy: true`, piecewise_linear flat 0, ramp 0.001, max 0.5 = decay "linear"), stepped once per epoch
with step = the epoch's 0-based index (nft.decay_clock: iterations).
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any, ContextManager, Iterator

import torch
from torch import Tensor

from ..config import ConfigError
from ..core import TRANSFORMS, GroupBatch, compute_advantages
from ..core.group_filter import filter_metrics
from ..run.update import MiniBatch, MicroLoss, pass_generator, run_update
from .awm import stratified_indices
from .credit import saturated_group_mask
from .methods import METHODS, ImageContext, ImageMethod, ScoredRollout
from .extra_lora import active_lora, add_frozen_lora


def _adaptive_x0_loss(x0_hat: Tensor, x0: Tensor) -> Tensor:
    err = (x0_hat - x0).flatten(1)
    weight = err.detach().double().abs().mean(1).clamp_min(1e-5).float()
    return (err**2).mean(1) / weight


def nft_loss(
    v_theta: Tensor, v_old: Tensor, x_t: Tensor, x0: Tensor, t: Tensor, r: Tensor, *, beta: float, adv_max: float
) -> Tensor:
    """Per-sample NFT policy loss [B] (fp32). t, r: [B]."""
    v_theta, v_old, x_t, x0 = v_theta.float(), v_old.float(), x_t.float(), x0.float()
    tt = t.float().view(-1, *([1] * (x0.dim() - 1)))
    v_pos = beta * v_theta + (1 - beta) * v_old
    v_neg = (1 + beta) * v_old - beta * v_theta
    loss_pos = _adaptive_x0_loss(x_t - tt * v_pos, x0)
    loss_neg = _adaptive_x0_loss(x_t - tt * v_neg, x0)
    return adv_max * (r * loss_pos / beta + (1 - r) * loss_neg / beta)


def discrete_times(g: torch.Generator, sigmas: Tensor, count: int, fraction: float) -> Tensor:
    """`count` grid sigmas [count], stratum order: Flow-Factory's TimeSampler.discrete (include_init, no force_init).

    On the scheduler scale t = 1000 sigma, the grid indices with 1000 (1 - fraction) - 1e-3 <= t <= 1000 + 1e-3
    span [lo, hi]; stratum k is [floor(b_k), floor(b_k+1)) of b = linspace(lo, hi, count + 1), one index drawn
    uniformly in each (`awm.stratified_indices`, AWM's draw over another range)."""
    grid = sigmas[:-1].double() * 1000  # the scheduler's timesteps (the terminal sigma is no training time)
    valid = ((grid >= 1000 * (1 - fraction) - 1e-3) & (grid <= 1000 + 1e-3)).nonzero().squeeze(1)
    if valid.numel() == 0:
        raise ConfigError(
            f"nft.timestep_fraction {fraction} keeps no grid sigma >= {1 - fraction:g} (grid: {sigmas.tolist()})"
        )
    idx = stratified_indices(g, int(valid.min()), int(valid.max()), count).clamp(0, len(grid) - 1)
    return sigmas[idx].float()


def old_decay(steps: int, kind: str) -> float:
    """lambda of theta_old <- lambda theta_old + (1 - lambda) theta, after `steps` optimizer steps in all.

    The release's return_decay(global_step, decay_type): global_step counts optimizer steps, this
    epoch's included (decay types 1 = linear, 2 = delayed, 0 = on_policy).
    """
    if kind == "on_policy":
        return 0.0
    if kind == "linear":
        return min(0.001 * steps, 0.5)
    if kind == "delayed":  # the release's OCR schedule
        return 0.0 if steps < 75 else min(0.0075 * (steps - 75), 0.999)
    raise ValueError(f"nft.decay: expected on_policy, linear or delayed, got {kind!r}")


@torch.no_grad()
def soft_update(old: list[Tensor], new: list[Tensor], decay: float) -> None:
    for o, n in zip(old, new):
        o.mul_(decay).add_(n.detach().to(o.dtype), alpha=1 - decay)


@METHODS.register("nft")
class NFTMethod(ImageMethod):
    """DiffusionNFT: rollouts from the old policy, the forward-process objective on the clean samples (x0 = the
    leaves), then the old policy's soft update. The old policy is a second LoRA adapter, starting equal."""

    @staticmethod
    def prepare_model(adapter: Any, cfg: Any) -> None:
        """The old policy's adapter, frozen; the trained one stays active (before sharding: FSDP2 manages the
        parameters present when it wraps a block)."""
        add_frozen_lora(adapter, cfg.model.lora, "old")

    def __init__(self, ctx: ImageContext) -> None:
        super().__init__(ctx)
        self.old_params = ctx.adapter.lora_parameters("old")
        soft_update(self.old_params, ctx.params, 0.0)
        self._ref_rows = 0  # rows the reference ran in the last term (its forwards are counted as nfe_nograd)

    @staticmethod
    def needs_reference(cfg: Any) -> bool:
        return cfg.nft.kl_coef != 0

    @staticmethod
    def check_config(cfg: Any) -> None:
        if cfg.model.finetune != "lora":
            raise ValueError("method 'nft' keeps the old policy as a second LoRA adapter: finetune must be 'lora'")
        if cfg.plan.name not in ("ode_only", "full_sde", "window"):
            raise ValueError(f"method 'nft' trains on clean samples only; plan '{cfg.plan.name}' has no meaning for it")
        if cfg.sampler.cfg_mode != "none" and cfg.method != "nft":  # nft_gardo's reference runs the conditional
            raise ValueError(f"method '{cfg.method}' is CFG-free: set sampler.cfg_mode none")
        if cfg.sampler.cfg_mode != "none" and cfg.sampler.train_cfg_mode != "full":
            raise ValueError(
                "method 'nft' with CFG rollouts trains the guided velocity, both branches with gradient (Flow-Factory): "
                f"set sampler.train_cfg_mode full (got '{cfg.sampler.train_cfg_mode}'), or sampler.cfg_mode none "
                "(CFG-free)"
            )

    def train_cfg_mode(self) -> str:
        """The loss's CFG: the guided velocity under CFG rollouts (check_config: "full"), else the conditional."""
        sampler = self.ctx.cfg.sampler
        return "none" if sampler.cfg_mode == "none" else sampler.train_cfg_mode

    def rollout_policy(self) -> ContextManager[Any]:
        return active_lora(self.ctx.adapter, "old")

    def checkpoint_parts(self, parts: Any) -> None:
        parts.tensors["nft_old"] = {f"{i}": p.detach() for i, p in enumerate(self.old_params)}

    def restore(self, ckpt: Any) -> None:
        with torch.no_grad():
            for i, p in enumerate(self.old_params):
                p.copy_(ckpt.tensors["nft_old"][f"{i}"])

    def optimality(self, rollout: ScoredRollout, record: dict[str, Any]) -> tuple[Tensor, Tensor]:
        """(r, sample weight) of every sample, global order: advantages -> flowgrpo.core's nft_optimality."""
        cfg = self.ctx.cfg
        batch = self._groups(rollout)
        if rollout.prompt_state is not None:  # the per-prompt state (prompt_state.py): the estimator records each group
            batch = replace(
                batch, prompt_ids=rollout.prompt_ids, prompt_state=rollout.prompt_state, step=self.ctx.iteration + 1
            )
        result = compute_advantages(batch, cfg.advantage)
        record.update(result.metrics)
        result = TRANSFORMS.get("nft_optimality").fn(result, batch, adv_clip_max=cfg.nft.adv_max)
        return result.advantages.reshape(-1).float(), result.sample_weight.reshape(-1).float()

    def _groups(self, rollout: ScoredRollout) -> GroupBatch:
        """The rollout's rewards as groups [P, L, K], global order."""
        cfg, values = self.ctx.cfg, rollout.leaf_values
        return GroupBatch(
            rewards=values.view(-1, rollout.tree.leaves.shape[1], values.shape[-1]),
            reward_weights=[r.weight for r in cfg.rewards],
            reward_names=[r.label for r in cfg.rewards],
            head_nan_policy=cfg.advantage.head_nan_policy,
        )

    def update(self, rollout: ScoredRollout, record: dict[str, Any]) -> None:
        ctx = self.ctx
        cfg, nft, tree, adapter = ctx.cfg, ctx.cfg.nft, rollout.tree, ctx.adapter
        L = tree.leaves.shape[1]
        opt_r, weight = self.optimality(rollout, record)
        if cfg.edges.group_filter is not None:  # Edit-R1's mask: a saturated group's samples leave the loss, whose
            groups = saturated_group_mask(self._groups(rollout), cfg)  # mean then runs over the samples kept
            weight = weight * groups.repeat_interleave(L).to(weight.dtype)
            record.update(filter_metrics(groups))
        mine, _ = ctx.dist.localize(torch.arange(opt_r.numel()), cfg.rollout_prompts * L)
        weight, opt_r = weight[mine], opt_r[mine]  # this rank's samples, in local order
        x0 = tree.leaf_latents().flatten(0, 1)
        prompt_of = torch.arange(tree.num_prompts).repeat_interleave(L)
        keep = (weight > 0).nonzero().squeeze(1)
        schedule = tree.schedule
        sig = schedule.sigmas.float() if hasattr(schedule, "sigmas") else None
        if sig is None:
            raise ConfigError("method 'nft' needs a flow-matching model (sigma schedule)")
        discrete = nft.time_sampling == "discrete"
        n_t = nft.timesteps if discrete else max(1, int((len(sig) - 1) * nft.timestep_fraction))
        mode = self.train_cfg_mode()
        per_row = 1 if mode == "none" else 2  # denoiser rows per sample: CFG runs cond and uncond
        if mode == "none":
            embeds = adapter.encode_prompts(rollout.prompts)
        else:
            embeds = adapter.encode_prompts(rollout.prompts, cfg.sampler.negative_prompt)
        counters = ctx.sampler.counters
        total = max(ctx.dist.sum(float(keep.numel())) * int(n_t), 1.0)
        terms = {"sum": 0.0, "n": 0}

        def term_loss(micro: Tensor, time_: Tensor, eps: Tensor, r: Tensor) -> tuple[Tensor, Tensor]:
            """One forward-process term of `micro`'s samples at grid times `time_`: its loss and per-sample losses."""
            x_0 = x0[micro].float()
            time_ = time_.to(x_0.device)  # the grid times are drawn on the CPU generator
            tt = time_.view(-1, *([1] * (x_0.dim() - 1)))  # images [B, C, h, w] or video [B, C, F, h, w]
            x_t = (1 - tt) * x_0 + tt * eps.to(x_0.device)
            rows = embeds.index(prompt_of[micro])
            with torch.no_grad(), active_lora(adapter, "old") as old:
                v_old = self.velocity(old, x_t, time_, rows)
            v = self.velocity(adapter, x_t, time_, rows)
            per = nft_loss(v, v_old, x_t, x_0, time_, r.to(v.device), beta=nft.beta, adv_max=nft.adv_max)
            loss = per.sum() / total * cfg.train.mini_batches
            penalty, self._ref_rows = self.reference_penalty(v, x_t, time_, rows, micro, total)
            return loss + penalty, per.detach()

        def micro_loss(term: tuple[Tensor, Tensor, Tensor], norm: Any, on_policy: bool) -> MicroLoss:
            micro, time_, eps = term
            loss, per = term_loss(micro, time_, eps, opt_r[micro])
            counters.nfe_nograd += (micro.numel() + self._ref_rows) * per_row  # the old policy's rows, the reference's
            counters.nfe_grad += micro.numel() * per_row
            terms["sum"] += float(per.sum())
            terms["n"] += micro.numel()
            return MicroLoss(loss)

        def padding_loss(norm: Any) -> Tensor:
            zero = torch.zeros(1)
            return term_loss(torch.zeros(1, dtype=torch.long), sig[:1], torch.zeros_like(x0[:1]).float(), zero)[0]

        def passes() -> Iterator[list[MiniBatch]]:
            for epoch in range(cfg.train.inner_epochs):
                g = pass_generator(cfg.seed, ctx.iteration, epoch)
                order = keep[torch.randperm(keep.numel(), generator=g)]
                minis = list(order.chunk(cfg.train.mini_batches)) if keep.numel() else []
                minis += [keep[:0]] * (ctx.dist.most(len(minis)) - len(minis))  # every rank steps the optimizer alike
                draw = self._discrete_terms if discrete else self._terms
                yield [MiniBatch(draw(mini, g, x0, len(sig) - 1, n_t, sig)) for mini in minis]

        result = run_update(passes(), micro_loss, padding_loss, ctx.optimizer_step, ctx.dist)
        iterations = nft.decay_clock == "iterations"
        # optimizer steps so far, as the release's global_step; or Flow-Factory's epoch index
        decay = old_decay(ctx.iteration if iterations else ctx.optimizer_step.total, nft.decay)
        soft_update(self.old_params, ctx.params, decay)
        record.update(
            {
                "loss/policy": terms["sum"] / max(terms["n"], 1),
                "nft/old_decay": decay,
                "backward_passes": result.backward_passes,
                **({"padding_passes": result.padding_passes} if ctx.dist.lockstep else {}),
                "nft/mean_r": float(opt_r[keep].mean()) if keep.numel() else math.nan,
            }
        )

    def reference_penalty(
        self, v: Tensor, x_t: Tensor, t: Tensor, rows: Any, micro: Tensor, total: float
    ) -> tuple[Tensor | float, int]:
        """The reference term of a micro-batch's loss and the rows the reference ran: kl_coef mean_dims
        |v - v_ref|^2 summed / total (GARDO's plug-in overrides it: flowgrpo/t2i/gardo_methods.py)."""
        kl_coef = self.ctx.cfg.nft.kl_coef
        if not kl_coef:
            return 0.0, 0
        with torch.no_grad(), self.ctx.reference() as ref:
            v_ref = self.velocity(ref, x_t, t, rows)
        return kl_coef * ((v - v_ref) ** 2).flatten(1).mean(1).sum() / total, micro.numel()

    def velocity(self, model: Any, x_t: Tensor, t: Tensor, rows: Any) -> Tensor:
        """The velocity the loss trains: guided under CFG rollouts (both branches, as `model`'s grad mode), else
        the conditional one."""
        return model.model_output(x_t, t, rows, self.ctx.cfg.sampler.guidance_scale, self.train_cfg_mode())

    def _discrete_terms(
        self, mini: Tensor, g: torch.Generator, x0: Tensor, n_grid: int, n_t: int, sig: Tensor
    ) -> list[tuple[Tensor, Tensor, Tensor]]:
        """time_sampling discrete: per micro-batch, n_t grid times shared by its samples (discrete_times), then
        one fresh noise per time, as Flow-Factory's optimize draws them (times first, then each time's noise)."""
        out: list[tuple[Tensor, Tensor, Tensor]] = []
        for micro in mini.split(self.ctx.cfg.train.micro_batch_size) if mini.numel() else ():
            times = discrete_times(g, sig, n_t, self.ctx.cfg.nft.timestep_fraction)
            out += [
                (micro, times[j].expand(micro.numel()), torch.randn(x0[micro].shape, generator=g)) for j in range(n_t)
            ]
        return out

    def _terms(
        self, mini: Tensor, g: torch.Generator, x0: Tensor, n_grid: int, n_t: int, sig: Tensor
    ) -> list[tuple[Tensor, Tensor, Tensor]]:
        """A mini-batch's forward-process terms, one backward each: every sample of a micro-batch trains on n_t
        grid times, fresh noise every time (drawn in the release's order: a micro-batch's times, then its noises)."""
        out: list[tuple[Tensor, Tensor, Tensor]] = []
        for micro in mini.split(self.ctx.cfg.train.micro_batch_size) if mini.numel() else ():  # an empty mini: none
            times = torch.stack([torch.randperm(n_grid, generator=g)[:n_t] for _ in micro])
            for j in range(n_t):
                out.append((micro, sig[times[:, j]], torch.randn(x0[micro].shape, generator=g)))
        return out
