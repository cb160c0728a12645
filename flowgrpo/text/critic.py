"""T-PPO's value model: a causal LM with a one-output token head, its config, its values and its update.

The critic is transformers' `AutoModelForTokenClassification` with `num_labels: 1` (Qwen2, Llama, Mistral ... all
have one): the head reads the last hidden state at every position. By default it is built like the policy, from the
policy's own initial weights (the tiny model, a folder or a hub id alike: no second load) and a zero head, so every
value starts at 0; `critic.model` loads another folder or hub id instead. With the policy on LoRA the critic is on
LoRA too (peft, the policy's rank / alpha / modules; the head trains whole), else fully trained (`critic.lora`).

Values of a completion of length l (left-padded prompt, right-padded completion, as `Rollout` holds them):
V(s_t) for t < l is the head's output at the position before completion token t (the state that samples it),
V(s_l) the output at the last token (the value at the cut). The update is PPO's value loss on the targets of
`flowgrpo.core.egae.value_targets` (finished responses only): 0.5 max((V - R)^2, (V_clip - R)^2) with
V_clip = V_old + clip(V - V_old, -value_clip, value_clip), a token mean over each mini-batch, times `value_coef`,
then its own optimizer step (flowgrpo.run.optim.OptimizerStep: gradients summed over ranks, clipped, AdamW at a
constant learning rate, a NaN / inf norm skipped) through the shared update loop (flowgrpo.run.update), micro-batch k
of each mini-batch on rank k % world_size as the policy's. The critic always runs in eval mode (no dropout).
"""

from __future__ import annotations

import copy
import math
from typing import Any, Literal, Optional, Union

import torch
from pydantic import Field
from torch import Tensor

from ..core import StrictModel
from ..distributed import Distributed
from ..guards import GuardConfig, NonFiniteGuard
from ..run.optim import OptimizerStep
from ..run.update import MiniBatch, MicroLoss, run_update
from .inputs import trimmed_inputs

PAD_ROWS = torch.zeros(1, dtype=torch.long)  # the row a lockstep run's padding passes run on


class CriticConfig(StrictModel):
    """The value model of `method: tppo` (unused by other methods)."""

    # None: the policy's initial weights; else a folder or hub id with the policy's tokenizer (a missing head is new)
    model: Optional[str] = None
    lora: Union[bool, Literal["policy"]] = "policy"  # policy: LoRA when the policy uses LoRA (its shape), else full
    lr: float = Field(1e-5, ge=0)
    weight_decay: float = Field(0.0, ge=0)
    value_coef: float = Field(0.5, gt=0)  # scales the value loss (AdamW: mostly the loss metric's scale)
    value_clip: Optional[float] = Field(0.2, gt=0)  # clip V around the rollout-time values; None: plain MSE
    max_grad_norm: Optional[float] = Field(1.0, gt=0)
    epochs: int = Field(1, ge=1)  # passes over the finished responses per step
    mini_batches: int = Field(1, ge=1)  # optimizer steps per pass
    micro_batch_size: Optional[int] = Field(None, ge=1)  # sequences per forward (default train.micro_batch_size)
    # T-PPO's windows: each step generates at most `window` tokens per stream and continues the unfinished ones next
    # step (flowgrpo/text/windows.py); None: every response is generated whole (up to generation.max_new_tokens)
    window: Optional[int] = Field(None, ge=1)


def _backbone_state(policy: Any) -> dict[str, Tensor]:
    """The policy's decoder weights (without its LM head), LoRA layers folded out (B = 0 when this runs: the
    method is built before the first update, and a resume loads the critic's own weights afterwards)."""
    base = policy.get_base_model() if hasattr(policy, "get_base_model") else policy
    decoder = getattr(base, base.base_model_prefix)
    return {k.replace(".base_layer", ""): v for k, v in decoder.state_dict().items() if "lora_" not in k}


def build_critic(policy: Any, cfg: CriticConfig, lora: Any, device: torch.device) -> Any:
    """The value model on `device`, in eval mode. `lora`: the policy's LoRA config (rank, alpha, target_modules,
    enabled)."""
    from transformers import AutoModelForTokenClassification

    base = policy.get_base_model() if hasattr(policy, "get_base_model") else policy
    on_lora = cfg.lora is True or (cfg.lora == "policy" and lora.enabled)
    # a fully trained critic keeps float32 weights, as the policy must (AdamW rounds small updates away in bf16)
    dtype = next(base.parameters()).dtype if on_lora else torch.float32
    if cfg.model is None:
        config = copy.deepcopy(base.config)
        config.num_labels = 1
        with torch.random.fork_rng(devices=[]):  # the head is zeroed below; leave the run's RNG stream untouched
            model = AutoModelForTokenClassification.from_config(config)
        getattr(model, model.base_model_prefix).load_state_dict(_backbone_state(policy))
        head = getattr(model, "score", None) or model.classifier
        with torch.no_grad():  # V = 0 everywhere at the start: the first advantages are the plain returns
            head.weight.zero_()
            if head.bias is not None:
                head.bias.zero_()
    else:
        try:
            with torch.random.fork_rng(devices=[]):  # a new head's random init: not from the run's RNG stream
                torch.manual_seed(0)
                model = AutoModelForTokenClassification.from_pretrained(cfg.model, num_labels=1, dtype=dtype)
        except (OSError, ValueError) as err:
            raise ValueError(
                f"critic.model '{cfg.model}': cannot load a token-classification model from it (a folder with "
                f"config.json and weights, or a hub id): {err}"
            ) from None
        if model.config.vocab_size < base.config.vocab_size:  # it reads the policy's token ids
            raise ValueError(
                f"critic.model '{cfg.model}': its vocabulary ({model.config.vocab_size}) is smaller than the policy's "
                f"({base.config.vocab_size}); the critic must share the policy's tokenizer"
            )
    model.to(device=device, dtype=dtype)
    if on_lora:
        from peft import LoraConfig, get_peft_model

        peft_cfg = LoraConfig(
            r=lora.rank, lora_alpha=lora.alpha, lora_dropout=0.0, target_modules=list(lora.target_modules),
            task_type="TOKEN_CLS",
        )  # fmt: skip
        model = get_peft_model(model, peft_cfg)  # TOKEN_CLS keeps the head (`score`) trainable
    model.eval()
    return model


class Critic:
    """The value model, its AdamW, its optimizer step and its loss."""

    def __init__(
        self, model: Any, cfg: CriticConfig, micro_batch_size: int, dist: Optional[Distributed] = None
    ) -> None:
        self.model, self.cfg = model, cfg
        self.dist = dist or Distributed()
        self.micro = cfg.micro_batch_size or micro_batch_size
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=cfg.lr, weight_decay=cfg.weight_decay, foreach=True)
        # its own guard: a NaN / inf critic gradient skips the critic's step only (counted in critic/skipped_steps)
        self.guard = NonFiniteGuard(GuardConfig())
        self.step = OptimizerStep(self.params, self.optimizer, cfg.max_grad_norm, self.dist, guard=self.guard)
        self.device = next(model.parameters()).device

    def state(self) -> dict[str, Tensor]:
        """The trained tensors (a checkpoint's `critic` group)."""
        return {name: p for name, p in self.model.named_parameters() if p.requires_grad}

    def forward(self, rollout: Any, rows: Tensor) -> Tensor:
        """V [n, Tc + 1] of `rows`: column t is V(s_t), the state after t completion tokens; 0 beyond the width."""
        ids, attn, pos, width = trimmed_inputs(rollout, rows)
        out = self.model(input_ids=ids.to(self.device), attention_mask=attn.to(self.device),
                         position_ids=pos.to(self.device), use_cache=False)  # fmt: skip
        values = out.logits[:, -(width + 1) :, 0].float()
        return torch.nn.functional.pad(values, (0, rollout.completion_ids.shape[1] - width))

    @torch.no_grad()
    def values(self, rollout: Any) -> tuple[Tensor, Tensor]:
        """(V(s_t) [N, Tc] of every token, V(s_l) [N] at each completion's cut), on CPU, no grad: row block b on
        rank b % world_size, gathered on every rank; the padding rows of ragged groups read 0."""
        N, Tc = rollout.completion_ids.shape
        real = torch.arange(N) if rollout.valid is None else rollout.valid.nonzero()[:, 0]
        blocks = list(real.split(self.micro))
        local = [(b, self.forward(rollout, blocks[b]).cpu()) for b in self.dist.my_chunks(len(blocks))]
        full = torch.zeros(N, Tc + 1)
        for b, v in self.dist.gather_objects(local):
            full[blocks[b]] = v
        last = full.gather(1, rollout.completion_mask.sum(1, keepdim=True)).squeeze(1)
        return full[:, :Tc], last

    def update(
        self, rollout: Any, old: Tensor, targets: Tensor, mask: Tensor, order: list[list[Tensor]]
    ) -> dict[str, float]:
        """Value-loss steps on the tokens of `mask` [N, Tc] (targets, rollout-time values `old` [N, Tc]); `order`:
        per epoch, each mini-batch's rows (the caller seeds it). A mini-batch without target tokens takes no step;
        micro-batch k of a mini-batch runs on rank k % world_size. Metrics `critic/...`."""
        rows_with = mask.any(1)
        out: dict[str, float] = {"critic/target_tokens": float(mask.sum())}
        if not bool(rows_with.any()):
            return out
        R, V = targets[mask].double(), old[mask].double()
        var = float(R.var(unbiased=False)) if R.numel() > 1 else 0.0
        out["critic/explained_var"] = 1 - float((R - V).var(unbiased=False)) / var if var > 0 else math.nan
        out["critic/value_mean"], out["critic/return_mean"] = float(V.mean()), float(R.mean())
        # every rank holds the whole mask: the same mini-batches, token counts and micro-batches everywhere
        plan = [[m for m in (mini[rows_with[mini]] for mini in epoch) if m.numel()] for epoch in order]
        W, rank = self.dist.world_size, self.dist.rank
        passes = (
            (MiniBatch([m for k, m in enumerate(mini.split(self.micro)) if k % W == rank], int(mask[mini].sum()))
             for mini in epoch)
            for epoch in plan
        )  # fmt: skip

        def micro_loss(micro: Tensor, tokens: int, on_policy: bool) -> MicroLoss:
            loss, clipped, own = self._micro_loss(rollout, micro, old, targets, mask, tokens)
            # "loss/": summed over micro-batches and ranks, per step; the clipped share weighs by tokens
            return MicroLoss(loss, {"loss/critic": float(loss.detach()), "critic/clip_frac": clipped / own}, own)

        self.step.begin()
        skipped = self.guard.skipped_steps
        steps = sum(len(epoch) for epoch in plan)
        # a lockstep launch (FSDP2 / ZeRO) would pad with this pass; method tppo refuses those launches
        result = run_update(passes, micro_loss, lambda _: self.forward(rollout, PAD_ROWS).sum(), self.step, self.dist)
        metrics = result.metrics.result(steps)
        norms = [n for n in self.step.norms if math.isfinite(n)]
        out.update({"critic/loss": metrics["loss/critic"], "critic/clip_frac": metrics["critic/clip_frac"],
                    "critic/nfe_grad": float(sum(int(m.numel()) for epoch in plan for m in epoch)),
                    "critic/optimizer_steps": float(len(norms)),
                    "critic/skipped_steps": float(self.guard.skipped_steps - skipped)})  # fmt: skip
        if norms:
            out["critic/grad_norm"] = sum(norms) / len(norms)
        return out

    def _micro_loss(
        self, rollout: Any, micro: Tensor, old: Tensor, targets: Tensor, mask: Tensor, tokens: int
    ) -> tuple[Tensor, float, int]:
        """This micro-batch's share of the mini-batch's token-mean value loss, how many of its tokens were clipped,
        and how many it has."""
        m = mask[micro].to(self.device)
        v = self.forward(rollout, micro)[:, :-1]
        r, v_old = targets[micro].to(self.device).float(), old[micro].to(self.device).float()
        err = (v - r) ** 2
        clipped = 0.0
        if self.cfg.value_clip is not None:
            v_clip = v_old + (v - v_old).clamp(-self.cfg.value_clip, self.cfg.value_clip)
            err_clip = (v_clip - r) ** 2
            clipped = float(((err_clip > err) & m).sum())
            err = torch.maximum(err, err_clip)
        return self.cfg.value_coef * 0.5 * (err * m).sum() / tokens, clipped, int(m.sum())
