"""methods grpo_gardo and nft_gardo: GARDO's advantage, uncertainty gate and resettable reference over GRPO and NFT.

The formulas and what the authors' code does: flowgrpo/t2i/gardo.py. Here they plug into the existing methods
through two hooks and nothing else: GRPOMethod.assign (the per-edge credit) and NFTMethod.optimality /
reference_penalty (the per-sample r and the reference term). The reference is a LoRA adapter of its own
("gardo_ref"), equal to the policy at the start and reset to it by gardo.ReferenceSchedule; its forwards run on
the gated rows only (the release runs them on every row and discards the rest: the same loss, fewer forwards),
counted as nfe_nograd.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, ContextManager

import torch
from torch import Tensor

from ..core import LossNormalizer, compute_advantages, mean_sqdist, policy_loss
from .credit import Credit
from .gardo import ReferenceSchedule, RiskController, gardo_advantages, gate, image_features, uncertainty
from .grpo import GRPOMethod
from .methods import METHODS, ImageContext, ScoredRollout, leaf_batch
from .extra_lora import active_lora, add_frozen_lora
from .nft import NFTMethod
from .objectives import EdgeBatch, EdgeLoss, EdgeObjective

REF = "gardo_ref"
FIELDS = ("edges", "advantages", "weights", "logp_old", "std", "dt")


def add_reference_adapter(adapter: Any, cfg: Any) -> None:
    """The reference's LoRA adapter, frozen, the trained one active (before sharding)."""
    if cfg.gardo.kl_coef == 0:
        return
    add_frozen_lora(adapter, cfg.model.lora, REF)


def check_gardo(cfg: Any) -> None:
    g = cfg.gardo
    labels = [r.label for r in cfg.rewards]
    for name in [g.main_reward, *g.uncertainty_rewards]:
        if name is not None and name not in labels:
            raise ValueError(f"gardo: reward '{name}' is not among rewards {labels}")
    if g.kl_coef and cfg.model.finetune != "lora":
        raise ValueError("gardo keeps its reference as a LoRA adapter: finetune must be 'lora'")
    if cfg.plan.name not in ("ode_only", "full_sde", "window"):
        raise ValueError(
            f"gardo scores whole chains (one image per sample): plan '{cfg.plan.name}' has probes/branches"
        )


@torch.no_grad()
def copy_into(target: list[Tensor], source: list[Tensor]) -> None:
    for t, s in zip(target, source):
        t.copy_(s.detach().to(t.dtype))


class Gardo:
    """GARDO's state for one run: the risk controller, the reference schedule, the reference adapter's weights, and
    the KL terms seen in this iteration's optimizer steps."""

    def __init__(self, ctx: ImageContext) -> None:
        self.ctx, self.cfg = ctx, ctx.cfg.gardo
        self.controller = RiskController(self.cfg.kl_fraction, self.cfg.kl_fraction.base)
        self.schedule = ReferenceSchedule(self.cfg)
        self.ref_params = ctx.adapter.lora_parameters(REF) if self.cfg.kl_coef else []
        copy_into(self.ref_params, ctx.params)
        self.step_kl: dict[int, list[float]] = {}

    def reference(self) -> ContextManager[Any]:
        return active_lora(self.ctx.adapter, REF)

    def before_update(self, record: dict[str, Any]) -> None:
        reset = bool(self.cfg.kl_coef) and self.schedule.due(self.ctx.iteration)
        if reset:
            copy_into(self.ref_params, self.ctx.params)
        record["gardo/reset"] = float(reset)
        record["gardo/kl_threshold"] = self.schedule.threshold

    def signals(self, rollout: ScoredRollout, record: dict[str, Any]) -> tuple[Tensor, Tensor]:
        """(advantages [P, L], gate [P * L]) of every sample, global order."""
        ctx, cfg = self.ctx, self.ctx.cfg
        L = rollout.tree.leaves.shape[1]
        values = rollout.leaf_values
        labels = [r.label for r in cfg.rewards]
        batch = leaf_batch(rollout, cfg)
        record.update(compute_advantages(batch, cfg.advantage).metrics)  # the reward metrics, logged alike
        main = values[:, labels.index(self.cfg.main_reward or labels[0])].double() * self.cfg.reward_scale
        feats = None
        if self.cfg.diversity.enabled:
            if rollout.images is None or rollout.images.shape[0] != rollout.tree.leaves.numel():
                raise RuntimeError("gardo: the diversity weights need the decoded final images of the rollout")
            local = image_features(rollout.images, self.cfg.diversity)
            mine = ctx.dist.my_chunks(cfg.prompts_per_iteration // cfg.rollout_prompts)
            feats = ctx.dist.gather_chunks(
                list(local.chunk(len(mine))), cfg.prompts_per_iteration // cfg.rollout_prompts
            )
            feats = feats.view(-1, L, feats.shape[-1])
        adv = gardo_advantages(main.view(-1, L), feats)
        positive = adv > 0
        if feats is not None and bool(positive.any()):
            from .gardo import diversity_weights

            record["gardo/diversity_weight_max"] = float(diversity_weights(main.view(-1, L), feats)[positive].max())
        record["gardo/adv_abs_mean"] = float(adv.abs().mean())
        return adv, self._gate(main, values, labels, record)

    def _gate(self, main: Tensor, values: Tensor, labels: list[str], record: dict[str, Any]) -> Tensor:
        if not self.cfg.kl_coef:
            return torch.zeros(main.numel(), dtype=torch.bool)
        if not self.cfg.uncertainty_rewards:
            return torch.ones(main.numel(), dtype=torch.bool)
        low = torch.tensor(-torch.inf, dtype=torch.float64)  # an unscored sample ranks last
        aux = torch.stack([values[:, labels.index(n)].double() for n in self.cfg.uncertainty_rewards], 1)
        u = uncertainty(torch.where(torch.isfinite(main), main, low), torch.where(torch.isfinite(aux), aux, low))
        fraction = self.controller.update(float(u[u >= 0].mean()))
        gated, threshold = gate(u, fraction)
        record.update({"gardo/kl_fraction": fraction, "gardo/u_threshold": threshold,
                       "gardo/gated_fraction": float(gated.double().mean())})  # fmt: skip
        return gated

    def local(self, global_samples: Tensor, L: int) -> Tensor:
        """This rank's entries of a per-sample tensor in global order, in local order."""
        mine, _ = self.ctx.dist.localize(torch.arange(global_samples.numel()), self.ctx.cfg.rollout_prompts * L)
        return global_samples.reshape(-1)[mine]

    def observe(self, kl: float) -> None:
        """A micro-batch's KL term (its gated mean), under the optimizer step it belongs to."""
        self.step_kl.setdefault(self.ctx.optimizer_step.total, []).append(kl)

    def after_update(self, record: dict[str, Any]) -> None:
        """The mean KL term of each optimizer step over every rank's micro-batches flags the next reset."""
        dist = self.ctx.dist
        means = []
        for step in sorted(self.step_kl):
            vals = self.step_kl[step]
            total, count = dist.sum(sum(vals)), dist.sum(float(len(vals)))
            means.append(total / max(count, 1.0))
        self.step_kl = {}
        if self.cfg.kl_coef:
            self.schedule.observe(means)
            record["gardo/step_kl_max"] = max(means) if means else 0.0

    def checkpoint_parts(self, parts: Any) -> None:
        if self.ref_params:
            parts.tensors["gardo_ref"] = {f"{i}": p.detach() for i, p in enumerate(self.ref_params)}
        parts.state["gardo"] = {"schedule": self.schedule.state_dict(), "fraction": self.controller.fraction,
                                "buffer": list(self.controller.buffer)}  # fmt: skip

    def restore(self, ckpt: Any) -> None:
        with torch.no_grad():
            for i, p in enumerate(self.ref_params):
                p.copy_(ckpt.tensors["gardo_ref"][f"{i}"])
        state = ckpt.state["gardo"]
        self.schedule.load_state_dict(state["schedule"])
        self.controller.fraction, self.controller.buffer = float(state["fraction"]), list(state["buffer"])


def chain_credit(tree: Any, adv: Tensor) -> Credit:
    """The sample's advantage on every trained edge of its chain; zero advantages dropped (the release filters
    samples whose advantages are all 0)."""
    chain = tree.ancestors(tree.leaves)[..., 1:]  # [P, L, T] edges into depth 1..T
    node_adv = torch.full((tree.num_nodes,), float("nan"))
    ok = chain >= 0
    node_adv[chain[ok]] = adv.unsqueeze(-1).expand(chain.shape)[ok].float()
    keep = tree.edge_trained & torch.isfinite(node_adv) & (node_adv != 0)
    edges = keep.nonzero().squeeze(1)
    metrics = {"edges/trained": float(edges.numel()), "edges/available": float(tree.edge_trained.sum())}
    return Credit(edges, node_adv[edges], torch.ones(edges.numel()), metrics, node_adv)


class GatedKLObjective(EdgeObjective):
    """policy_loss over re-scored edges plus GARDO's KL on gated edges: coef mean_{gated rows} mean_d (mu -
    mu_ref)^2 dt / (2 std^2) (flow_grpo's KL form), weighted by the micro-batch's share of the mini-batch's rows."""

    def __init__(self, sampler: Any, loss: Any, gardo: Gardo) -> None:
        super().__init__(sampler, loss, None)
        self.gardo = gardo
        self.node_gate = torch.zeros(0, dtype=torch.bool)  # per local node: the edge into it is gated

    def __call__(self, adapter: Any, tree: Any, batch: EdgeBatch, prompts: list[str], norm: LossNormalizer) -> EdgeLoss:
        out = self.sampler.rescore(adapter, tree, batch.edges, prompts)
        dev = out.logp.device
        moved = EdgeBatch(*(getattr(batch, f).to(dev) for f in FIELDS))
        output = policy_loss(moved.inputs(out.logp.float()), self.loss, norm)
        coef, live = self.gardo.cfg.kl_coef, batch.weights > 0
        if coef and bool(live.any()):  # a padding batch (weight 0) adds and observes nothing
            sel = self.node_gate[batch.edges] & live
            if not bool(sel.any()) and self.gardo.cfg.ungated == "all":
                sel = live
            kl_mean = 0.0
            if bool(sel.any()):
                idx = sel.nonzero().squeeze(1)
                with torch.no_grad(), self.gardo.reference() as ref:
                    ref_out = self.sampler.rescore(ref, tree, batch.edges[idx], prompts)
                i = idx.to(dev)
                kl = mean_sqdist(out.mean[i], ref_out.mean) * moved.dt[i] / (2 * moved.std[i] ** 2)
                share = float(live.sum()) / max(norm.num_tokens, 1.0)
                output = replace(output, loss=output.loss + coef * kl.mean() * share)
                kl_mean = float(kl.detach().mean())
            output.metrics["gardo/kl"] = kl_mean
            self.gardo.observe(kl_mean)
        return EdgeLoss(output, out.logp.detach())


@METHODS.register("grpo_gardo")
class GardoGRPOMethod(GRPOMethod):
    """Flow-GRPO with GARDO (tinnerhrhe/GARDO scripts/train_sd3_grpo_gardo.py)."""

    prepare_model = staticmethod(add_reference_adapter)

    def __init__(self, ctx: ImageContext) -> None:
        super().__init__(ctx)
        self.needs_images = ctx.cfg.gardo.diversity.enabled
        self.gardo = Gardo(ctx)
        self.objective = GatedKLObjective(ctx.sampler, ctx.cfg.loss, self.gardo)
        self._record: dict[str, Any] = {}

    @staticmethod
    def needs_reference(cfg: Any) -> bool:
        return False  # its reference is the gardo_ref adapter, not the base model

    @staticmethod
    def check_config(cfg: Any) -> None:
        check_gardo(cfg)
        if cfg.loss.kl.coef != 0:
            raise ValueError("method 'grpo_gardo' applies its own gated KL (gardo.kl_coef): set loss.kl.coef 0")
        if cfg.loss.ratio.name == "ratio_norm" or cfg.edges.per_sample_fraction is not None:
            raise ValueError("method 'grpo_gardo' trains the plain ratio on every trained step of a chain")

    def assign(self, rollout: ScoredRollout) -> Credit:
        adv, gated = self.gardo.signals(rollout, self._record)
        tree, L = rollout.tree, rollout.tree.leaves.shape[1]
        chain = tree.ancestors(tree.leaves)[..., 1:]
        node_gate = torch.zeros(tree.num_nodes, dtype=torch.bool)
        ok = chain >= 0
        node_gate[chain[ok]] = self.gardo.local(gated, L).view(-1, L).unsqueeze(-1).expand(chain.shape)[ok]
        self.objective.node_gate = node_gate
        clip = self.ctx.cfg.gardo.adv_clip_max
        return chain_credit(rollout.global_tree, adv.clamp(-clip, clip))

    def update(self, rollout: ScoredRollout, record: dict[str, Any]) -> None:
        self._record = record
        self.gardo.before_update(record)
        super().update(rollout, record)
        self.gardo.after_update(record)

    def checkpoint_parts(self, parts: Any) -> None:
        self.gardo.checkpoint_parts(parts)

    def restore(self, ckpt: Any) -> None:
        self.gardo.restore(ckpt)


@METHODS.register("nft_gardo")
class GardoNFTMethod(NFTMethod):
    """DiffusionNFT with GARDO (tinnerhrhe/GARDO scripts/train_sd3_nft_gardo.py)."""

    @staticmethod
    def prepare_model(adapter: Any, cfg: Any) -> None:
        NFTMethod.prepare_model(adapter, cfg)
        add_reference_adapter(adapter, cfg)

    def __init__(self, ctx: ImageContext) -> None:
        super().__init__(ctx)
        self.needs_images = ctx.cfg.gardo.diversity.enabled
        self.gardo = Gardo(ctx)
        self.local_gate = torch.zeros(0, dtype=torch.bool)

    @staticmethod
    def needs_reference(cfg: Any) -> bool:
        return False

    @staticmethod
    def check_config(cfg: Any) -> None:
        NFTMethod.check_config(cfg)
        check_gardo(cfg)
        if cfg.nft.kl_coef != 0:
            raise ValueError("method 'nft_gardo' applies its own gated KL (gardo.kl_coef): set nft.kl_coef 0")

    def optimality(self, rollout: ScoredRollout, record: dict[str, Any]) -> tuple[Tensor, Tensor]:
        """r = clip(clip(A, +-adv_max) / adv_max / 2 + 1/2, 0, 1) of GARDO's A (train_sd3_nft_gardo.py); weight 0
        for an unscored main reward."""
        adv, gated = self.gardo.signals(rollout, record)
        L = rollout.tree.leaves.shape[1]
        self.local_gate = self.gardo.local(gated, L)
        m = self.ctx.cfg.nft.adv_max
        r = (adv.clamp(-m, m) / m / 2 + 0.5).clamp(0.0, 1.0)
        labels = [x.label for x in self.ctx.cfg.rewards]
        main = rollout.leaf_values[:, labels.index(self.gardo.cfg.main_reward or labels[0])]
        return r.reshape(-1).float(), torch.isfinite(main).float()

    def reference_penalty(
        self, v: Tensor, x_t: Tensor, t: Tensor, rows: Any, micro: Tensor, total: float
    ) -> tuple[Tensor | float, int]:
        """coef mean_{gated rows} mean_d |v - v_ref|^2 (every row when none is gated: `ungated: all`), weighted by the
        micro-batch's share of the mini-batch's terms."""
        g = self.gardo.cfg
        if not g.kl_coef:
            return 0.0, 0
        sel = self.local_gate[micro]
        if not bool(sel.any()) and g.ungated == "all":
            sel = torch.ones_like(sel)
        if not bool(sel.any()):
            self.gardo.observe(0.0)
            return 0.0, 0
        idx = sel.nonzero().squeeze(1).to(v.device)
        with torch.no_grad(), self.gardo.reference() as ref:
            v_ref = ref.model_output(x_t[idx], t[idx], rows.index(idx), self.ctx.cfg.sampler.guidance_scale, "none")
        kl = ((v[idx].float() - v_ref.float()) ** 2).flatten(1).mean(1).mean()
        self.gardo.observe(float(kl.detach()))
        return g.kl_coef * kl * micro.numel() * self.ctx.cfg.train.mini_batches / total, idx.numel()

    def update(self, rollout: ScoredRollout, record: dict[str, Any]) -> None:
        self.gardo.before_update(record)
        super().update(rollout, record)
        self.gardo.after_update(record)

    def checkpoint_parts(self, parts: Any) -> None:
        super().checkpoint_parts(parts)
        self.gardo.checkpoint_parts(parts)

    def restore(self, ckpt: Any) -> None:
        super().restore(ckpt)
        self.gardo.restore(ckpt)
