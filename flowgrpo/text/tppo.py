"""method: tppo - Truncated PPO (arXiv 2506.15050): the GRPO method's token-level update on Extended GAE advantages
from a critic (flowgrpo/text/critic.py), then the critic's own update.

    scored batch -> the critic's values V(s_t) of every completion token and V(s_l) at each cut (no grad)
                 -> per-token rewards: the outcome reward on the last token of a finished response, 0 elsewhere
                 -> flowgrpo.core.egae (estimator `egae`): per-token advantages [N, T]; a response cut by
                    max_new_tokens is unfinished and bootstraps from V(s_l)
                 -> the GRPO method's update (old / reference log-probs, clipped token-level loss, its passes)
                 -> the critic's value loss on the returns A_t + V(s_t) of finished responses only

With `critic.window: W` a step generates at most W tokens per stream and the unfinished streams continue at the next
step with their earlier tokens as context (flowgrpo/text/windows.py, the collector's stream pool); without it a
step's generation ends at `generation.max_new_tokens` and an unfinished response is trained on with its bootstrapped
value but not continued. Data parallel over ranks (the critic's own OptimizerStep sums its gradients); FSDP2, ZeRO
and context-parallel launches are refused.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, fields
from typing import Any

import torch

from ..checkpoint import load_into
from ..config import ConfigError
from ..core.advantages import ESTIMATORS
from ..core.egae import TokenValueBatch, extended_gae, value_targets
from ..run.clock import seconds_since
from ..run.update import pass_order
from .critic import Critic, build_critic
from .grpo import TextGRPOMethod
from .methods import METHODS, TextContext

CRITIC_ORDER = 1_000  # the critic's pass p is seeded as pass CRITIC_ORDER + p of its step (not the policy's order)


@dataclass
class PendingCritic:
    """What the critic's update after the policy's needs from before it: rollout-time values, targets, mask."""

    values: torch.Tensor  # [N, T]
    targets: torch.Tensor  # [N, T] A_t + V(s_t) (unwhitened)
    mask: torch.Tensor  # [N, T] tokens of finished, scored responses


@METHODS.register("tppo")
class TextTPPOMethod(TextGRPOMethod):
    """T-PPO: Extended GAE advantages from a critic (`critic:` settings), the GRPO method's token-level update, then
    the critic's value-loss update."""

    config_section = "critic"  # where its settings live in TextConfig (for `flowgrpo list`)

    def __init__(self, ctx: TextContext) -> None:
        if ctx.dist.lockstep:  # the critic is a replicated model: its passes and steps are plain data parallel
            raise ConfigError(
                "method tppo: FSDP2, DeepSpeed ZeRO and context-parallel launches are not supported (the critic "
                "trains data-parallel only); launch with configs/accelerate/ddp.yaml or torchrun"
            )
        super().__init__(ctx)
        cfg = ctx.cfg
        try:
            model = build_critic(ctx.model, cfg.critic, cfg.model.lora, ctx.device)
        except ValueError as err:
            raise ConfigError(str(err)) from None
        self.critic = Critic(model, cfg.critic, cfg.train.logprob_batch_size or cfg.train.micro_batch_size, ctx.dist)
        settings = {**ESTIMATORS.get("egae").settings, **cfg.advantage.estimator.settings}
        self.gamma, self.lam = float(settings["gamma"]), float(settings["lam"])
        self.pending: PendingCritic | None = None
        if cfg.critic.window is not None:  # rows of one dataset prompt carry different earlier tokens as context
            self.shared_prompt = False

    @staticmethod
    def check_config(cfg: Any) -> None:
        est = cfg.advantage.estimator.name
        if est != "egae":
            raise ValueError(f"method tppo: advantage.estimator must be 'egae' (Extended GAE), got '{est}'")
        if cfg.advantage.transforms:
            names = [t.name for t in cfg.advantage.transforms]
            raise ValueError(
                f"method tppo: advantage.transforms must be empty (egae's advantages as they are), got {names}"
            )
        if cfg.generation.mask_truncated:
            raise ValueError(
                "method tppo: generation.mask_truncated must be false (T-PPO trains on the unfinished responses, "
                "bootstrapped from the critic's value at the cut)"
            )
        window, gen = cfg.critic.window, cfg.generation
        if window is None:
            return
        if window >= gen.max_new_tokens:
            raise ValueError(
                f"critic.window ({window}) must be below generation.max_new_tokens ({gen.max_new_tokens}, the whole "
                "response's budget), or null (no windows)"
            )
        pool = "each stream of the pool draws its own prompt"
        other = {"generation.backend": (gen.backend, "transformers", "a per-call window for vLLM is not wired"),
                 "rollout_split": (cfg.rollout_split, 1, pool), "prompt_sampling": (cfg.prompt_sampling.name, "uniform", pool),
                 "dynamic_sampling.enabled": (cfg.dynamic_sampling.enabled, False, pool)}  # fmt: skip
        for key, (got, want, why) in other.items():
            if got != want:
                raise ValueError(f"critic.window: {key} must be {want} ({why}), got {got}")

    def update(self, rollout: Any, record: dict[str, Any]) -> None:
        super().update(rollout, record)  # the advantages (and the critic's values) first, then the policy's update
        pending, self.pending = self.pending, None
        assert pending is not None
        t0 = time.perf_counter()
        cfg, N = self.ctx.cfg, rollout.rollout.num_sequences
        mb = cfg.critic.mini_batches
        order = [
            list(pass_order(N, cfg.seed, self.ctx.iteration, CRITIC_ORDER + e, cfg.train.shuffle).chunk(mb))
            for e in range(cfg.critic.epochs)
        ]
        record.update(self.critic.update(rollout.rollout, pending.values, pending.targets, pending.mask, order))
        record["time_critic_s"] = seconds_since(t0, self.ctx.device)

    def _advantage_inputs(self, groups: Any, rollout: Any, record: dict[str, Any], counts: dict[str, int]) -> Any:
        """The GroupBatch with the critic's values and the per-token rewards (a TokenValueBatch); the critic's
        targets are kept for its update."""
        batch = token_value_batch(groups, rollout, *self.critic.values(rollout))
        record["critic/nfe_nograd"] = float(rollout.num_sequences if rollout.valid is None else rollout.valid.sum())
        mask = batch.step_mask & batch.mask.unsqueeze(-1)
        # the critic learns the returns: unwhitened, whatever egae's `whiten` does to the policy's advantages
        returns = extended_gae(
            batch.step_rewards.double(), batch.values.double(), batch.last_value.double(), batch.finished, mask,
            self.gamma, self.lam,
        )  # fmt: skip
        targets, where = value_targets(returns, batch.values.double(), batch.finished, mask)
        N, T = rollout.completion_ids.shape
        self.pending = PendingCritic(
            batch.values.reshape(N, T).float(), targets.float().reshape(N, T), where.reshape(N, T)
        )
        return batch

    def _action_advantages(self, adv: Any, rollout: Any) -> torch.Tensor:
        """egae's per-token advantages [N, T]."""
        if adv.level != "step":
            raise ValueError(f"method tppo: expected per-token (step) advantages from egae, got {adv.level}-level")
        N, T = rollout.completion_ids.shape
        return adv.advantages.reshape(N, T)

    def checkpoint_parts(self, parts: Any) -> None:
        super().checkpoint_parts(parts)
        parts.tensors["critic"] = self.critic.state()
        parts.optimizers["critic"] = self.critic.optimizer  # loaded in place by the checkpointer on resume

    def restore(self, ckpt: Any) -> None:
        super().restore(ckpt)
        if "critic" not in ckpt.tensors:
            raise ConfigError("resume: the checkpoint has no critic (it was written by another method than tppo)")
        load_into(self.critic.model, ckpt.tensors["critic"])


def token_value_batch(groups: Any, rollout: Any, values: torch.Tensor, last_value: torch.Tensor) -> TokenValueBatch:
    """The TokenValueBatch of a rollout: values [N, T] and last_value [N] as [P, G, T] / [P, G]; per-token rewards
    with each finished response's scalar reward on its last token; a finished response whose reward is missing
    (NaN) has no tokens (advantage 0, no critic target), an unfinished one needs no reward."""
    P, G = groups.num_groups, groups.group_size
    N, T = rollout.completion_ids.shape
    lengths = rollout.completion_mask.sum(1)
    finished = (~rollout.truncated).view(P, G)
    reward = groups.scalar_rewards()
    scored = groups.usable(reward) | ~finished
    mask = rollout.completion_mask.view(P, G, T) & scored.unsqueeze(-1)
    last = torch.nn.functional.one_hot((lengths - 1).clamp_min(0), T).view(P, G, T).bool() & mask
    outcome = torch.nan_to_num(reward, nan=0.0).to(values.dtype).unsqueeze(-1)
    step_rewards = torch.where(last & finished.unsqueeze(-1), outcome, torch.zeros((), dtype=values.dtype))
    base = {f.name: getattr(groups, f.name) for f in fields(groups)}
    return TokenValueBatch(
        **{**base, "step_rewards": step_rewards, "step_mask": mask},
        values=values.view(P, G, T), last_value=last_value.view(P, G), finished=finished,
    )  # fmt: skip
