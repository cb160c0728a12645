"""method: diffusion_dpo - Diffusion-DPO, online or offline: the velocity form (flow matching) and the
noise-prediction form (family sd15: DiffusionDPO's own SD1.5 run).

A pair (chosen w, rejected l) of clean latents of one prompt shares a training time sigma and a noise eps:
    x_t = (1 - sigma) x0 + sigma eps,      err(v, x0) = mean_dims (v(x_t, sigma) - (eps - x0))^2   (float32)
    inside = -beta / 2 * ((err_w(theta) - err_w(ref)) - (err_l(theta) - err_l(ref)))
    L = mean_terms [-log sigmoid(inside) + sft_coef * err_w(theta)]      (implicit accuracy: inside > 0)
The reference is the base model (LoRA disabled; a frozen copy when fully fine-tuned), the conditional velocity
without CFG (rollouts may use CFG, as flow_grpo's). One term = one pair at one (sigma, eps): 2 rows with gradient,
2 without. sigma: logit-normal u = sigmoid(N(logit_mean, logit_std)) (or uniform u), sigma = s (1 - u) /
(1 + (s - 1)(1 - u)) with s = time_shift (the SD3 training scheduler's shift that flow_grpo's index into
`noise_scheduler.timesteps` applies), floored at 1e-3 (its 1000-step grid).
Noise-prediction models (adapter.prediction "epsilon": sd15) take DiffusionDPO's form instead: an integer
timestep t = floor(u T) of the scheduler's T = 1000 training steps (time_sampling uniform: its randint(0, T)),
x_t = sqrt(abar_t) x0 + sqrt(1 - abar_t) eps, err = mean_dims (eps_theta(x_t, t) - eps)^2; the rest is the same.

sft_coef (default 0: the published Diffusion-DPO) adds the chosen image's own denoising loss, the diffusion form of
RPO's NLL term on the chosen response (Pang et al. 2024, "Iterative Reasoning Preference Optimization",
arXiv 2404.19733, L_DPO+NLL). Without it, offline pairs far from the policy's samples are "preferred" by raising
the policy's error on both images, the rejected one faster (likelihood displacement): the implicit accuracy reaches
1 while the policy moves toward neither (docs/benchmarks.md, issue 28); the term keeps the chosen error falling.

Pairs. Online (`dpo.data` unset): from each group's rewards (weighted scalar; NaN never paired):
  best_worst: the best and the worst sample of the group (ties: the earlier); a group whose rewards are all
              equal gives no pair (Flow-Factory pairs a sample with itself, which has zero gradient), or with
              `tied_groups: first_two` flow_grpo's pair (chosen sample 1, rejected sample 0: no real preference,
              but GenEval's 0 / 1 scores tie whole groups often, so its run trains many such pairs);
  margin:     every (i, j) with R_i - R_j > margin (more pairs per group, each a real preference).
Offline (`dpo.data: pairs.jsonl`, flowgrpo/t2i/pair_data.py): `dpo.pairs_per_iteration` dataset pairs per
iteration (seeded epochs), encoded by the VAE once (`dpo.encode: once`, kept on the CPU) or when drawn
(`per_iteration`: DiffusionDPO encodes every step; Pick-a-Pic v2's ~1M pairs do not fit in memory encoded);
`empty_prompt_fraction` of their prompts become "" (DiffusionDPO's proportion_empty_prompts). The rollout is still
sampled and scored, so reward_mean tracks the policy (its cost is the rollout's: keep group_size and
sampler.num_steps small).

Sources. Loss: SalesforceAIResearch/DiffusionDPO @ 5233e75, train.py (model_losses_w/l, ref_diff, inside_term =
-0.5 * beta_dpo * (model_diff - ref_diff), loss = -logsigmoid(inside_term).mean(): the noise-prediction form,
beta_dpo 5000, shared noise and timestep per pair); the velocity form followed here: yifan123/flow_grpo @ ac4c86e,
scripts/train_sd3_dpo.py (target = noise - model_input, per-sample mean-square error, logit_normal(0, 1) indices
into the scheduler's timesteps, shared noise and time per pair, PerPromptStatTracker type 'dpo' = argmax /
argmin pairs) with config/dpo.py (beta 100, rollouts by the "ref" adapter, ref_update_step 1e7 = never);
X-GenGroup/Flow-Factory @ a0b2bc5, src/flow_factory/trainers/dpo.py DPOTrainer.optimize (the same loss, policy
rollouts, best / worst per group) with examples/dpo/lora/sd3_5/default.yaml (beta 100, lr 1e-5, 1 time / pair).
Not ported: flow_grpo's periodic reference refresh (its recipes never refresh), DiffusionDPO's image augmentation
(random horizontal flip, resize + centre crop: pair_data resizes to the sampler's size) and its VAE posterior
samples (pair_data encodes the posterior's mode); v-prediction models (SD2-style: no published DPO run).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Literal, Optional

import torch
import torch.nn.functional as F
from pydantic import Field, model_validator
from torch import Tensor

from ..config import ConfigError
from ..core import StrictModel, compute_advantages
from ..run.prompts import PromptSampler
from ..run.update import MiniBatch, MicroLoss, pass_generator, record_update, run_update
from .methods import METHODS, ImageContext, ImageMethod, ScoredRollout, leaf_batch


class DPOConfig(StrictModel):
    """Diffusion-DPO (method: diffusion_dpo)."""

    beta: float = Field(100.0, gt=0)  # flow_grpo config/dpo.py, Flow-Factory; DiffusionDPO (eps form): 5000
    pairs: Literal["best_worst", "margin"] = "best_worst"
    tied_groups: Literal["skip", "first_two"] = "skip"  # best_worst, all rewards equal: first_two = flow_grpo's
    margin: float = Field(0.0, ge=0)  # pairs: margin -> every (i, j) with R_i - R_j > margin
    timesteps: int = Field(1, ge=1)  # terms per pair per epoch, fresh (sigma, eps) each (flow_grpo: 39)
    time_sampling: Literal["logit_normal", "uniform"] = "logit_normal"
    logit_mean: float = 0.0
    logit_std: float = Field(1.0, gt=0)
    time_shift: float = Field(3.0, gt=0)  # SD3.5's scheduler shift
    sample_with: Literal["policy", "reference"] = "policy"  # flow_grpo: reference; Flow-Factory: policy
    data: Optional[str] = None  # offline preference pairs (.jsonl); unset: online pairs from the rollout
    pairs_per_iteration: int = Field(8, ge=1)  # offline: dataset pairs per iteration (all ranks)
    sft_coef: float = Field(0.0, ge=0)  # RPO's supervised term on the chosen side: + sft_coef * err_w(theta)
    encode: Literal["once", "per_iteration"] = "once"  # offline: VAE-encode the whole file once, or the drawn pairs
    empty_prompt_fraction: float = Field(0.0, ge=0, lt=1)  # offline: prompts dropped to "" (DiffusionDPO: 0.2)

    @model_validator(mode="after")
    def _offline_only(self) -> "DPOConfig":
        if self.empty_prompt_fraction and not self.data:
            raise ValueError(
                f"dpo.empty_prompt_fraction {self.empty_prompt_fraction} applies to offline pairs; set dpo.data "
                "or leave it 0"
            )
        return self


# --- the formulas --------------------------------------------------------------------------------


def dpo_loss(
    err_w: Tensor, err_l: Tensor, ref_w: Tensor, ref_l: Tensor, beta: float, sft_coef: float = 0.0
) -> tuple[Tensor, Tensor]:
    """Per-pair loss -log sigmoid(inside) + sft_coef * err_w [B] and inside [B] (the reference errors carry no
    gradient; sft_coef > 0: RPO's supervised term on the chosen side)."""
    inside = -0.5 * beta * ((err_w - ref_w.detach()) - (err_l - ref_l.detach()))
    loss = -F.logsigmoid(inside)
    if sft_coef:
        loss = loss + sft_coef * err_w
    return loss, inside.detach()


def velocity_error(v: Tensor, eps: Tensor, x0: Tensor) -> Tensor:
    """mean_dims (v - (eps - x0))^2 per row [B] (float32, as both velocity-form sources)."""
    return prediction_error(v, eps.float() - x0.float())


def prediction_error(pred: Tensor, target: Tensor) -> Tensor:
    """mean_dims (pred - target)^2 per row [B] (float32, as every source)."""
    return ((pred.float() - target.float()) ** 2).flatten(1).mean(1)


def preference_pairs(rewards: Tensor, mode: str = "best_worst", margin: float = 0.0, tied: str = "skip") -> Tensor:
    """(chosen, rejected) flat sample ids [M, 2] (row p * G + i) from rewards [P, G]; NaN never pairs. `tied`
    first_two: a best_worst group whose scored rewards all tie pairs its first two scored samples (2nd chosen)."""
    P, G = rewards.shape
    out: list[tuple[int, int]] = []
    for p in range(P):
        r = rewards[p].double()
        ok = torch.isfinite(r).nonzero().squeeze(1)
        if ok.numel() < 2:
            continue
        if mode == "best_worst":
            vals = r[ok]
            best, worst = ok[int(vals.argmax())], ok[int(vals.argmin())]  # argmax / argmin: the first of ties
            if r[best] > r[worst]:
                out.append((p * G + int(best), p * G + int(worst)))
            elif tied == "first_two":  # stat_tracking.py: max_idx == min_idx -> min_idx = 0, max_idx = 1
                out.append((p * G + int(ok[1]), p * G + int(ok[0])))
        elif mode == "margin":
            for i in ok.tolist():
                for j in ok.tolist():
                    if r[i] - r[j] > margin:
                        out.append((p * G + i, p * G + j))
        else:
            raise ValueError(f"dpo.pairs: expected best_worst or margin, got {mode!r}")
    return torch.tensor(out, dtype=torch.long).view(-1, 2)


def _draw_u(g: torch.Generator, n: int, s: DPOConfig) -> Tensor:
    if s.time_sampling == "logit_normal":
        return torch.sigmoid(s.logit_mean + s.logit_std * torch.randn(n, generator=g))
    return torch.rand(n, generator=g)


def draw_sigmas(g: torch.Generator, n: int, s: DPOConfig) -> Tensor:
    """n training sigmas: flow_grpo's logit-normal index into the shifted 1000-step grid (or uniform)."""
    t = (1 - _draw_u(g, n, s)).clamp(1e-3, 1.0)
    return s.time_shift * t / (1 + (s.time_shift - 1) * t)


def draw_timesteps(g: torch.Generator, n: int, s: DPOConfig, num_train_timesteps: int) -> Tensor:
    """n integer training timesteps floor(u T) in [0, T) (float32): uniform u is DiffusionDPO's randint(0, T)."""
    return (_draw_u(g, n, s) * num_train_timesteps).long().clamp(0, num_train_timesteps - 1).float()


def noised(x0: Tensor, eps: Tensor, t: Tensor, alphas_cumprod: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    """(x_t, regression target) of clean x0 [B, ...] at times t [B]: the flow path ((1 - t) x0 + t eps, target
    eps - x0) without alphas_cumprod, else the DDPM one (sqrt(abar) x0 + sqrt(1 - abar) eps, target eps)."""
    shape = (-1, *([1] * (x0.dim() - 1)))
    if alphas_cumprod is None:
        tt = t.view(shape)
        return (1 - tt) * x0 + tt * eps, eps - x0
    abar = alphas_cumprod.to(x0.device, torch.float32)[t.long()].view(shape)
    return abar.sqrt() * x0 + (1 - abar).sqrt() * eps, eps


# --- the plug-in ---------------------------------------------------------------------------------


@dataclass
class PairSet:
    """This rank's pairs: clean latents of each side, the prompt row of each pair, the prompts' embeddings."""

    chosen: Tensor  # [M, ...]
    rejected: Tensor
    rows: Tensor  # [M] index into embeds
    embeds: Any
    reward_gap: Optional[Tensor] = None  # [M] R_w - R_l (online)


@dataclass
class PairTerm:
    pairs: Tensor  # [B] indices into the PairSet
    sigma: Tensor  # [B]
    eps: Tensor  # [B, ...] shared by both sides


@METHODS.register("diffusion_dpo")
class DiffusionDPOMethod(ImageMethod):
    """Diffusion-DPO on (chosen, rejected) pairs: online from the group's ranking, or offline from a dataset."""

    def __init__(self, ctx: ImageContext) -> None:
        super().__init__(ctx)
        s = ctx.cfg.dpo
        self.data: Any = None  # offline pairs, encoded on the first update (the VAE is on its device by then)
        self.alphas: Optional[Tensor] = None  # noise-prediction models: the scheduler's alphas_cumprod
        self.order: Optional[PromptSampler] = None
        if s.data:
            from .pair_data import load_pairs

            self.pair_records = load_pairs(s.data)  # fails before any rollout: file:line of a bad pair
            self.order = PromptSampler(len(self.pair_records), ctx.cfg.seed)

    @staticmethod
    def needs_reference(cfg: Any) -> bool:
        return True

    @staticmethod
    def check_config(cfg: Any) -> None:
        if cfg.plan.name not in ("ode_only", "full_sde", "window"):
            raise ValueError(
                f"method 'diffusion_dpo' trains on clean samples only; plan '{cfg.plan.name}' means nothing"
            )

    def rollout_policy(self) -> Any:
        if self.ctx.cfg.dpo.sample_with == "reference":
            return self.ctx.reference()
        return contextlib.nullcontext(self.ctx.adapter)

    def checkpoint_parts(self, parts: Any) -> None:
        if self.order is not None:
            parts.state["dpo_pairs"] = self.order.state_dict()

    def restore(self, ckpt: Any) -> None:
        if self.order is not None and "dpo_pairs" in ckpt.state:
            self.order.load_state_dict(ckpt.state["dpo_pairs"])

    # --- pairs ---

    def _rewards(self, rollout: ScoredRollout, record: dict[str, Any]) -> Tensor:
        """Weighted rewards [P, L] of every group, global order (the advantage metrics are logged alike)."""
        cfg = self.ctx.cfg
        batch = leaf_batch(rollout, cfg)
        record.update(compute_advantages(batch, cfg.advantage).metrics)
        return batch.scalar_rewards()

    def online_pairs(self, rollout: ScoredRollout, record: dict[str, Any]) -> PairSet:
        ctx, s = self.ctx, self.ctx.cfg.dpo
        tree = rollout.tree
        L = tree.leaves.shape[1]
        rewards = self._rewards(rollout, record)
        mine, _ = ctx.dist.localize(torch.arange(rewards.numel()), ctx.cfg.rollout_prompts * L)
        local = rewards.reshape(-1)[mine].view(-1, L)  # this rank's groups, local order
        pairs = preference_pairs(local, s.pairs, s.margin, s.tied_groups)
        x0 = tree.leaf_latents().flatten(0, 1)
        flat = local.reshape(-1)
        gap = (flat[pairs[:, 0]] - flat[pairs[:, 1]]).float() if pairs.numel() else torch.zeros(0)
        embeds = ctx.adapter.encode_prompts(rollout.prompts)
        return PairSet(x0[pairs[:, 0]], x0[pairs[:, 1]], pairs[:, 0] // L, embeds, gap)

    def offline_pairs(self, rollout: ScoredRollout, record: dict[str, Any]) -> PairSet:
        from .pair_data import encode_pairs

        ctx, cfg, s = self.ctx, self.ctx.cfg, self.ctx.cfg.dpo
        H, W = cfg.sampler.height, cfg.sampler.width
        self._rewards(rollout, record)  # the policy's own rewards: the run's reward curve
        assert self.order is not None
        ids = torch.tensor(self.order.next(s.pairs_per_iteration))
        ids = ids[torch.arange(ids.numel()) % ctx.dist.world_size == ctx.dist.rank]  # pair k on rank k % world
        if s.encode == "once":
            if self.data is None:
                self.data = encode_pairs(ctx.adapter, self.pair_records, H, W)
            data, rows = self.data, ids
        elif ids.numel():  # only this iteration's pairs, encoded now
            data = encode_pairs(ctx.adapter, [self.pair_records[i] for i in ids.tolist()], H, W)
            rows = torch.arange(ids.numel())
        else:  # fewer pairs than ranks: this rank only pads
            return PairSet(torch.zeros(0), torch.zeros(0), torch.zeros(0, dtype=torch.long), None)
        prompts = [data.prompts[i] for i in rows.tolist()]
        if s.empty_prompt_fraction and prompts:  # seeded by (seed, iteration): the same on a resumed run
            g = torch.Generator().manual_seed(cfg.seed * 1_000_003 + ctx.iteration)
            drop = torch.rand(len(prompts), generator=g) < s.empty_prompt_fraction
            prompts = ["" if d else p for p, d in zip(prompts, drop.tolist())]
        embeds = ctx.adapter.encode_prompts(prompts) if prompts else None
        return PairSet(data.chosen[rows], data.rejected[rows], torch.arange(rows.numel()), embeds)

    # --- the update ---

    def update(self, rollout: ScoredRollout, record: dict[str, Any]) -> None:
        ctx = self.ctx
        cfg, dist, adapter, s = ctx.cfg, ctx.dist, ctx.adapter, ctx.cfg.dpo
        if adapter.prediction == "epsilon":
            sched = adapter.pipe.scheduler
            if getattr(sched.config, "prediction_type", "epsilon") != "epsilon":
                raise ConfigError(
                    f"method 'diffusion_dpo': prediction_type '{sched.config.prediction_type}' is not supported; "
                    "valid: epsilon (sd15) or a flow-matching family"
                )
            self.alphas = sched.alphas_cumprod.float()
        elif not hasattr(rollout.tree.schedule, "sigmas"):
            raise ConfigError("method 'diffusion_dpo' needs a flow-matching model (sigma schedule) or sd15")
        data = self.offline_pairs(rollout, record) if s.data else self.online_pairs(rollout, record)
        M = data.chosen.shape[0]
        counters = ctx.sampler.counters
        guidance = cfg.sampler.guidance_scale
        stats = {"acc": 0.0, "n": 0.0}

        def loss_of(term: PairTerm, norm: float, scale: float) -> tuple[Tensor, dict[str, float]]:
            x_w, x_l = data.chosen[term.pairs], data.rejected[term.pairs]
            dev = adapter.device
            x0 = torch.cat([x_w, x_l]).to(dev).float()
            eps = term.eps.to(dev).float().repeat(2, *([1] * (x0.dim() - 1)))
            sigma = term.sigma.to(dev).float().repeat(2)  # sigma, or the integer timestep (noise prediction)
            x_t, target = noised(x0, eps, sigma, self.alphas)
            rows = data.embeds.index(data.rows[term.pairs].repeat(2))
            v = adapter.model_output(x_t, sigma, rows, guidance, "none")
            with torch.no_grad(), ctx.reference() as ref:
                v_ref = ref.model_output(x_t, sigma, rows, guidance, "none")
            B = term.pairs.numel()
            counters.nfe_grad += 2 * B
            counters.nfe_nograd += 2 * B
            err, ref_err = prediction_error(v, target), prediction_error(v_ref, target)
            per, inside = dpo_loss(err[:B], err[B:], ref_err[:B], ref_err[B:], s.beta, s.sft_coef)
            loss = per.sum() * scale / norm
            metrics = {
                "loss/policy": float(loss.detach()),  # this micro-batch's share: the step's loss sums them
                "dpo/implicit_acc": float((inside > 0).float().mean()),
                "dpo/err_chosen": float(err[:B].detach().mean()),
                "dpo/err_rejected": float(err[B:].detach().mean()),
                "dpo/ref_err_chosen": float(ref_err[:B].mean()),
                "dpo/ref_err_rejected": float(ref_err[B:].mean()),
            }
            stats["acc"] += float((inside > 0).float().sum())
            stats["n"] += B
            return loss, metrics

        def micro_loss(term: PairTerm, norm: float, on_policy: bool) -> MicroLoss:
            loss, metrics = loss_of(term, norm, 1.0)
            return MicroLoss(loss, metrics, term.pairs.numel())

        def padding_loss(norm: float) -> Tensor:  # a sharded run's extra pass: a real forward, coefficient 0
            if M == 0:
                raise RuntimeError(f"rank {dist.rank} holds no preference pair this iteration; nothing to pad with")
            t = 500.0 if self.alphas is not None else 0.5  # a mid time on either scale
            term = PairTerm(torch.zeros(1, dtype=torch.long), torch.full((1,), t), torch.zeros_like(data.chosen[:1]))
            return loss_of(term, 1.0, 0.0)[0]

        result = run_update(self._layout(M, data.chosen), micro_loss, padding_loss, ctx.optimizer_step, dist)
        record_update(record, result, len(ctx.optimizer_step.norms), dist.lockstep)
        record["dpo/pairs"] = int(dist.sum(float(M)))
        if data.reward_gap is not None and data.reward_gap.numel():
            record["dpo/reward_gap"] = float(data.reward_gap.mean())

    def _layout(self, M: int, chosen: Tensor) -> list[list[MiniBatch]]:
        """Per inner epoch, the mini-batches: this rank's pairs in a seeded order, micro-batches of
        `train.micro_batch_size` pairs, each at `dpo.timesteps` fresh (sigma, eps); the normaliser is the
        mini-batch's global count of pair-terms."""
        ctx, cfg, dist, s = self.ctx, self.ctx.cfg, self.ctx.dist, self.ctx.cfg.dpo
        out = []
        for epoch in range(cfg.train.inner_epochs):
            g = pass_generator(cfg.seed, ctx.iteration, epoch)
            order = torch.randperm(M, generator=g)
            minis = list(order.chunk(cfg.train.mini_batches)) if M else []
            minis += [order[:0]] * (dist.most(len(minis)) - len(minis))  # every rank steps the optimizer alike
            epoch_minis = []
            for mini in minis:
                terms = []
                for micro in mini.split(cfg.train.micro_batch_size) if mini.numel() else ():
                    for _ in range(s.timesteps):
                        if self.alphas is not None:
                            sigma = draw_timesteps(g, micro.numel(), s, self.alphas.numel())
                        else:
                            sigma = draw_sigmas(g, micro.numel(), s)
                        eps = torch.randn(chosen[micro].shape, generator=g)
                        terms.append(PairTerm(micro, sigma, eps))
                norm = dist.sum(float(mini.numel() * s.timesteps))
                epoch_minis.append(MiniBatch(terms, max(norm, 1.0)))
            out.append(epoch_minis)
        return out
