"""method: reward_backprop - direct reward back-propagation: the gradient of a differentiable reward flows back
through the decoder and the last denoising steps into the policy (DRaFT-K, DRaFT-LV, ReFL, AlignProp). No
advantage, no log-prob: the loss is the (negated) reward itself.

The rollout is the policy's own deterministic sample (plan ode_only: Euler steps x_{i+1} = x_i - (s_i - s_{i+1}) v
of a flow-matching model; DDIM with eta 0 of an epsilon model, SD1.5); its stored states are the no-grad prefix.
From the state before the grad window, under the current weights, with the same kernel:
    draft_k:   K = reward_backprop.k; steps T-K .. T-1 with grad -> x_T                    (DRaFT-K)
    refl:      t ~ U{T1..T2} (0-based grid steps); one step with grad, x0 = x_t - s_t v (DDIM: its x0)     (ReFL)
    alignprop: K ~ U{k_min..k_max} per micro-batch; steps T-K .. T-1 with grad -> x_T      (AlignProp)
    draft_lv:  from the rollout's final x_T (no grad), n = lv_samples times: fresh eps, the forward process to the
               last grid step, x = (1 - s) x_T + s eps at s = sigma_{T-1} (DDIM: sqrt(ab) x_T + sqrt(1 - ab) eps at
               alpha_bar_{T-1}), then that one step with grad; loss_i sums over the n draws    (DRaFT-LV)
    R = sum_k w_k r_k(decode(x)),   loss_i = scale * (-R_i)  or, with a margin m,  scale * relu(m - R_i)
    L = sum_{i in micro-batch} loss_i / (samples of the mini-batch, every rank)
Each denoiser call of the window runs under torch.utils.checkpoint (`checkpointing`): its activations are
recomputed in backward, so memory grows with K by one latent per step, not by one denoiser's activations.

Sources. DRaFT (Clark et al. 2023, arXiv 2309.17400; no official code, and the paper was not at hand here, so its
section and equation numbers are not cited: unverified): loss = -r(x0, c) back-propagated through the sampler,
DRaFT-K stops the gradient before the last K steps (K = 1 their recommended trade-off). DRaFT-LV, as recalled
from the paper's Algorithm 1 (its text could not be read here: unverified): after the no-grad sample x_0, for
i = 1..n draw eps, noise stop_grad(x_0) to the last step's level with the forward process, denoise that one step
with grad and add grad r(x_0^i, c) to the update (a sum over the draws, not a mean), n = 2; third-party
re-implementations default to n = 2 as well (one of them averages the rewards instead; we keep the sum). ReFL (Xu et al. 2023, ImageReward): THUDM/ImageReward @
1beb4e4, ImageReward/ReFL.py `train`: 40 DDPM steps, no-grad up to step t = randint(30, 39), one denoiser call
with grad at t, x0 = the scheduler's pred_original_sample, loss = relu(2 - r) * grad_scale (scripts/train_refl.sh:
grad_scale 1e-3, lr 1e-5, batch 8 GPUs x 2 x 4 accumulation, 100 steps, EMA); the authors pass the integer t as
that call's timestep and step with the previous grid time (a slip we do not copy). AlignProp (Prabhudesai et al.
2023): mihirp1998/AlignProp @ 185d154, main.py (truncated_backprop_rand: at step i, noise_pred.detach() when
i < randint(min, max); every denoiser call under checkpoint.checkpoint(use_reentrant=False)) and
config/align_prop.py (aesthetic / hps: truncated_backprop_minmax (0, 50) of 50 DDIM steps, loss_coeff 0.01, lr
1e-3, weight decay 0.1, max_grad_norm 5, CFG 7.5, LoRA; main.py's losses: aesthetic |r - 10| (= relu(10 - r)
below the target), hps 1 - r).
Difference, on purpose: AlignProp's code draws a fresh threshold at every step (its window is not contiguous); we
draw one K per micro-batch (the paper's description; not checked here), so the window is the last K steps. On a flow-matching grid
that ends at sigma 0, ReFL at the last step equals DRaFT-1 (x0 = x_{T-1} - s_{T-1} v is the last Euler step).
ReFL's and AlignProp's SD1.x runs sample with DDPM / DDIM (eta 0 in AlignProp's scheduler.step); here an epsilon
model rolls out and back-propagates through DDIM with eta 0.
"""

from __future__ import annotations

from typing import Any, Callable, Literal, Optional

import torch
from pydantic import Field, model_validator
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from ..core import StrictModel, compute_advantages
from ..run.update import MiniBatch, MicroLoss, pass_generator, record_update, run_update
from .methods import METHODS, ImageContext, ImageMethod, ScoredRollout, leaf_batch
from pipelines.schedules import DDIMSchedule
from pipelines.steps import step

Form = Literal["draft_k", "draft_lv", "refl", "alignprop"]
FORMS = ("draft_k", "draft_lv", "refl", "alignprop")


class RewardBackpropConfig(StrictModel):
    """Direct reward back-propagation (method: reward_backprop)."""

    form: Form = "draft_k"
    k: int = Field(1, ge=1)  # draft_k: the last k steps carry grad (DRaFT-1 is the paper's recommendation)
    lv_samples: int = Field(2, ge=1)  # draft_lv: noise draws of the last step per sample (the paper's n = 2)
    # refl: the grad step t is drawn from [T1, T2] (0-based grid steps); None: [ceil(3T / 4), T - 1] (the
    # authors' 30..39 of 40 steps)
    refl_steps: Optional[tuple[int, int]] = None
    # alignprop: the window K is drawn from [k_min, k_max]; None: [1, T] (the authors' (0, 50) of 50 steps, without
    # the K = 0 draw that trains nothing)
    truncation: Optional[tuple[int, int]] = None
    margin: Optional[float] = None  # None: loss -R; m: relu(m - R) (ReFL m = 2; AlignProp aesthetic |10 - R|)
    loss_scale: float = Field(1.0, gt=0)  # ReFL grad_scale 1e-3, AlignProp loss_coeff 0.01
    checkpointing: bool = True  # each denoiser call of the window under torch.utils.checkpoint

    @model_validator(mode="after")
    def _ranges(self) -> "RewardBackpropConfig":
        for name in ("refl_steps", "truncation"):
            pair = getattr(self, name)
            if pair is not None and not 0 <= pair[0] <= pair[1]:
                raise ValueError(
                    f"reward_backprop.{name}: expected [low, high] with 0 <= low <= high, got {list(pair)}"
                )
        if self.truncation is not None and self.truncation[0] < 1:
            raise ValueError(f"reward_backprop.truncation: K >= 1 (K = 0 trains nothing), got {list(self.truncation)}")
        return self


# --- the formulas --------------------------------------------------------------------------------


def grad_window(s: RewardBackpropConfig, num_steps: int, g: torch.Generator) -> tuple[int, int, bool]:
    """(first step with grad, steps with grad, predict x0 at the end) of one micro-batch; draws from `g`."""
    T = num_steps
    if s.form == "draft_k":
        if s.k > T:
            raise ValueError(f"reward_backprop.k {s.k} exceeds sampler.num_steps {T}")
        return T - s.k, s.k, False
    if s.form == "draft_lv":  # the last step, from the re-noised final sample (`renoise`), lv_samples times
        return T - 1, 1, False
    if s.form == "refl":
        low, high = s.refl_steps if s.refl_steps is not None else (-(-3 * T // 4), T - 1)
        if high > T - 1:
            raise ValueError(f"reward_backprop.refl_steps {[low, high]}: steps lie in [0, {T - 1}] (num_steps {T})")
        t = low + int(torch.randint(high - low + 1, (1,), generator=g))
        return t, 1, True
    if s.form == "alignprop":
        low, high = s.truncation if s.truncation is not None else (1, T)
        if high > T:
            raise ValueError(f"reward_backprop.truncation {[low, high]}: K lies in [1, {T}] (num_steps {T})")
        K = low + int(torch.randint(high - low + 1, (1,), generator=g))
        return T - K, K, False
    raise ValueError(f"reward_backprop.form: unknown {s.form!r}; valid: {', '.join(FORMS)}")


def denoise(
    velocity: Callable[[Tensor, int], Tensor],
    x: Tensor,
    start: int,
    steps: int,
    schedule: Any,
    predict_x0: bool = False,
    use_checkpoint: bool = True,
    kernel: str = "ode",
    settings: Optional[dict[str, Any]] = None,
) -> Tensor:
    """Deterministic steps start .. start + steps - 1 from x with grad (`kernel`: ode for a flow-matching model,
    ddim with eta 0 for an epsilon one, as the rollout took them); the last step's clean estimate (x - s v, DDIM's
    predicted x0) instead of its x_next when `predict_x0` (ReFL). `velocity(x, i)` is the denoiser at grid step i."""
    kw = settings or {}

    def one(x: Tensor, i: int, last: bool) -> Tensor:
        out = step(kernel, x, velocity(x, i), schedule, i, **kw)
        return out.x0_hat.to(x.dtype) if (last and predict_x0) else out.x_next

    for i in range(start, start + steps):
        last = i == start + steps - 1
        if use_checkpoint:
            x = checkpoint(one, x, i, last, use_reentrant=False)
        else:
            x = one(x, i, last)
    return x


def renoise(x0: Tensor, schedule: Any, i: int, noise: Tensor) -> Tensor:
    """The forward process from a clean sample to the noise level of grid step i (DRaFT-LV): (1 - s_i) x0 + s_i eps
    on a flow-matching grid, sqrt(ab_i) x0 + sqrt(1 - ab_i) eps on a DDIM one (alpha_bar at timesteps[i])."""
    x0 = x0.detach()
    if isinstance(schedule, DDIMSchedule):
        ab = schedule.alpha_bar[i].to(device=x0.device, dtype=torch.float32)
        return (ab.sqrt() * x0 + (1 - ab).sqrt() * noise).to(x0.dtype)
    s = schedule.sigmas[i].to(device=x0.device, dtype=torch.float32)
    return ((1 - s) * x0 + s * noise).to(x0.dtype)


def draws(s: RewardBackpropConfig) -> int:
    """Passes through the grad window per sample: draft_lv's noise draws, 1 for the other forms."""
    return s.lv_samples if s.form == "draft_lv" else 1


def reward_loss(R: Tensor, margin: Optional[float], scale: float) -> Tensor:
    """Per-sample loss [B] of weighted rewards R [B] (float64): scale (-R), or scale relu(margin - R)."""
    R = R.double()
    return scale * (-R if margin is None else torch.relu(margin - R))


def weighted_reward(
    images: Tensor, prompts: list[str], metadata: dict[str, list[Any]], scorers: list[tuple[str, float, Any]]
) -> tuple[Tensor, dict[str, Tensor]]:
    """R = sum_k w_k r_k [B] with grad, and each scorer's detached values."""
    total: Optional[Tensor] = None
    parts = {}
    for label, weight, scorer in scorers:
        r = scorer(images, prompts, metadata)[scorer.key]
        parts[label] = r.detach()
        total = weight * r if total is None else total + weight * r
    assert total is not None
    return total, parts


def check_differentiable(scorers: list[tuple[str, float, Any]]) -> None:
    """Every weighted scorer must let gradients reach the pixels (a clear error names the first that does not)."""
    bad = [label for label, w, s in scorers if w != 0 and not getattr(s, "differentiable", False)]
    if bad:
        good = [label for label, w, s in scorers if getattr(s, "differentiable", False)]
        raise ValueError(
            f"method reward_backprop back-propagates through the reward: scorer {bad[0]!r} is not differentiable "
            f"(differentiable among rewards: {good or 'none'}; give the others weight 0)"
        )


# --- the plug-in ---------------------------------------------------------------------------------


@METHODS.register("reward_backprop")
class RewardBackpropMethod(ImageMethod):
    """DRaFT-K / DRaFT-LV / ReFL / AlignProp: the gradient of a differentiable reward through the last denoising steps."""

    @staticmethod
    def check_config(cfg: Any) -> None:
        plan, solver = cfg.plan.name, cfg.plan.settings.get("solver", "euler")
        if plan != "ode_only" or solver != "euler":
            raise ValueError(
                f"method reward_backprop continues the rollout's deterministic chain: set plan {{name: ode_only}} "
                f"(solver euler), not plan '{plan}' (solver {solver!r})"
            )
        if cfg.sampler.decode != "final":
            raise ValueError("method reward_backprop decodes the final state: set sampler.decode final")
        grad_window(cfg.reward_backprop, cfg.sampler.num_steps, torch.Generator())  # the ranges fit the grid

    def __init__(self, ctx: ImageContext) -> None:
        super().__init__(ctx)
        assert ctx.scorer is not None
        self.scorers = [(r.label, r.weight, ctx.scorer(r.label)) for r in ctx.cfg.rewards if r.weight != 0]
        check_differentiable(self.scorers)

    def _metrics(self, rollout: ScoredRollout, record: dict[str, Any]) -> None:
        """The rollout's reward statistics (reward_mean, rewards/<name>/*, adv/*), as every method logs them."""
        cfg = self.ctx.cfg
        record.update(compute_advantages(leaf_batch(rollout, cfg), cfg.advantage).metrics)

    def _local_metadata(self, rollout: ScoredRollout) -> list[dict[str, Any]]:
        """The metadata of this rank's prompts, in local tree order (the trainer's chunk layout, rollout_split 1)."""
        cfg, bp = self.ctx.cfg, rollout.batch_prompts
        Pc = cfg.rollout_prompts
        mine = self.ctx.dist.my_chunks(cfg.prompts_per_iteration // Pc)
        return [m for c in mine for m in bp.metadata[c * Pc : (c + 1) * Pc]]

    def update(self, rollout: ScoredRollout, record: dict[str, Any]) -> None:
        ctx = self.ctx
        cfg, dist, tree, adapter = ctx.cfg, ctx.dist, rollout.tree, ctx.adapter
        s: RewardBackpropConfig = cfg.reward_backprop
        schedule = tree.schedule
        self._metrics(rollout, record)
        T = tree.num_steps
        L = tree.leaves.shape[1]
        chain = tree.ancestors(tree.leaves).flatten(0, 1)  # [n, T + 1] node of each sample at every depth
        n = chain.shape[0]
        prompt_of = torch.arange(tree.num_prompts).repeat_interleave(L)
        meta = self._local_metadata(rollout)
        embeds = adapter.encode_prompts(rollout.prompts, cfg.sampler.negative_prompt)
        if adapter.prediction == "epsilon":  # the rollout's deterministic kernel (the sampler's, for each family)
            kernel, settings, times = "ddim", {"eta": 0.0}, schedule.timesteps
        else:
            kernel, settings = "ode", {}
            times = schedule.sigmas if schedule.model_sigmas is None else schedule.model_sigmas
        mode = cfg.sampler.cfg_mode
        per_row = 1 if mode == "none" else 2
        counters = ctx.sampler.counters
        stats = {"calls": 0, "recompute": 0}

        n_draws = draws(s)
        noise_gen = pass_generator(cfg.seed + 2, ctx.iteration, 0)  # draft_lv's draws: seeded, a resume repeats them

        def loss_of(rows: Tensor, window: tuple[int, int, bool], norm: float) -> tuple[Tensor, dict[str, float]]:
            start, steps, predict_x0 = window
            rows_embeds = embeds.index(prompt_of[rows])
            local = prompt_of[rows].tolist()
            prompts = [rollout.prompts[i] for i in local]
            keys = sorted({k for i in local for k in meta[i]}) if meta else []
            row_meta = {k: [meta[i].get(k) for i in local] for k in keys}

            def velocity(x: Tensor, i: int) -> Tensor:
                t = times[i].to(x.device).expand(x.shape[0])
                v: Tensor = adapter.model_output(x, t, rows_embeds, cfg.sampler.guidance_scale, mode)
                return v

            if s.form == "draft_lv":  # the final sample, re-noised to the last step's level once per draw
                final = tree.states[chain[rows, T]].to(adapter.device)
                eps = torch.randn((n_draws, *final.shape), generator=noise_gen).to(final.device, final.dtype)
                starts = [renoise(final, schedule, start, e) for e in eps]
            else:
                starts = [tree.states[chain[rows, start]].to(adapter.device)]
            per = torch.zeros(rows.numel(), dtype=torch.float64, device=adapter.device)
            Rs, parts_all = [], []
            for x in starts:
                x_end = denoise(velocity, x, start, steps, schedule, predict_x0, s.checkpointing, kernel, settings)
                R, parts = weighted_reward(adapter.decode(x_end, prompts), prompts, row_meta, self.scorers)
                ok = torch.isfinite(R.detach())
                per = per + reward_loss(torch.where(ok, R, torch.zeros_like(R)), s.margin, s.loss_scale) * ok
                Rs.append(R.detach()[ok])
                parts_all.append(parts)
            counters.nfe_grad += rows.numel() * steps * per_row * len(starts)
            if s.checkpointing:
                stats["recompute"] += rows.numel() * steps * per_row * len(starts)
            stats["calls"] += len(self.scorers) * len(starts)
            loss = per.sum().float() / norm
            finite = torch.cat(Rs)
            metrics = {
                "loss/policy": float(loss.detach()),
                "reward_backprop/reward_mean": float(finite.mean()) if finite.numel() else float("nan"),
                "reward_backprop/grad_steps": float(steps * len(starts)),
                "reward_backprop/first_grad_step": float(start),
            }
            for label in parts_all[0]:
                r = torch.cat([p[label] for p in parts_all])
                metrics[f"reward_backprop/{label}_mean"] = float(r[torch.isfinite(r)].mean())
            return loss, metrics

        layout = self._layout(n, T)

        def micro_loss(micro: tuple[Tensor, tuple[int, int, bool]], norm: float, on_policy: bool) -> MicroLoss:
            rows, window = micro
            loss, metrics = loss_of(rows, window, norm)
            return MicroLoss(loss, metrics, rows.numel())

        def padding_loss(norm: float) -> Tensor:  # a sharded run's extra pass: the same forwards, loss zeroed
            return loss_of(torch.zeros(1, dtype=torch.long), grad_window(s, T, torch.Generator()), 1.0)[0]

        result = run_update(iter(layout), micro_loss, padding_loss, ctx.optimizer_step, dist)
        record_update(record, result, len(ctx.optimizer_step.norms), dist.lockstep)
        record["reward_calls"] = record.get("reward_calls", 0) + stats["calls"]
        record["reward_backprop/recompute_rows"] = stats["recompute"]
        record["reward_backprop/samples"] = int(dist.sum(float(n)))

    def _layout(self, n: int, T: int) -> list[list[MiniBatch]]:
        """Per inner epoch, the mini-batches: the samples in a seeded order, micro-batches of samples, each with
        its grad window (`micro_windows`); the normaliser is the mini-batch's sample count over every rank."""
        cfg, dist = self.ctx.cfg, self.ctx.dist
        out = []
        for epoch in range(cfg.train.inner_epochs):
            order = torch.randperm(n, generator=pass_generator(cfg.seed, self.ctx.iteration, epoch))
            minis = list(order.chunk(cfg.train.mini_batches)) if n else []
            minis += [order[:0]] * (dist.most(len(minis)) - len(minis))  # every rank steps the optimizer alike
            micros = [list(m.split(cfg.train.micro_batch_size)) if m.numel() else [] for m in minis]
            windows = micro_windows(cfg, T, self.ctx.iteration, epoch, [len(m) for m in micros])
            out.append(
                [
                    MiniBatch(list(zip(rows, wins)), max(dist.sum(float(mini.numel())), 1e-12))
                    for mini, rows, wins in zip(minis, micros, windows)
                ]
            )
        return out


def micro_windows(cfg: Any, T: int, iteration: int, epoch: int, micros: list[int]) -> list[list[tuple[int, int, bool]]]:
    """The grad window of each micro-batch of pass `epoch` (`micros`: micro-batches per mini-batch), drawn in order
    from a generator of (seed, iteration, epoch) alone: every rank draws the same windows (a sharded run needs the
    same denoiser calls everywhere) and a resumed run the same ones."""
    g = pass_generator(cfg.seed + 1, iteration, epoch)
    return [[grad_window(cfg.reward_backprop, T, g) for _ in range(m)] for m in micros]


def grad_rows(cfg: Any, iteration: int, n: int) -> int:
    """Rows through the denoiser with grad in one iteration over n samples on one rank (the windows replayed;
    twice under CFG); checkpointing recomputes as many in backward."""
    total, T = 0, cfg.sampler.num_steps
    for epoch in range(cfg.train.inner_epochs):
        micros = [list(m.split(cfg.train.micro_batch_size)) for m in torch.arange(n).chunk(cfg.train.mini_batches)]
        windows = micro_windows(cfg, T, iteration, epoch, [len(m) for m in micros])
        total += sum(r.numel() * w[1] for rows, wins in zip(micros, windows) for r, w in zip(rows, wins))
    return total * draws(cfg.reward_backprop) * (1 if cfg.sampler.cfg_mode == "none" else 2)


def expected_grad_steps(s: RewardBackpropConfig, T: int) -> float:
    """Denoiser calls with grad per image and pass, in expectation over the drawn windows: draft_k K, draft_lv its
    noise draws n, refl 1, alignprop (k_min + k_max) / 2."""
    if s.form == "draft_k":
        return float(s.k)
    if s.form == "draft_lv":
        return float(s.lv_samples)
    if s.form == "refl":
        return 1.0
    low, high = s.truncation if s.truncation is not None else (1, T)
    return (low + high) / 2


__all__ = [
    "RewardBackpropConfig",
    "RewardBackpropMethod",
    "check_differentiable",
    "denoise",
    "draws",
    "expected_grad_steps",
    "grad_rows",
    "grad_window",
    "micro_windows",
    "renoise",
    "reward_loss",
    "weighted_reward",
]
