"""DeepSpeed ZeRO for the trainers: the engine sums gradients over ranks, partitions them and the AdamW
moments, clips and steps; the trainers keep their own loop.

`accelerate launch --config_file configs/accelerate/deepspeed_zero2.yaml` (or deepspeed_zero3.yaml) exports the
settings; they are read through accelerate's own DeepSpeed plugin (`ZeroConfig.from_accelerate_env`). Under
ZeRO-1 / 2 every rank keeps the whole model; under ZeRO-3 the engine partitions the frozen weights (a LoRA run's
base model) and keeps the trained ones whole on every rank (`stage3_param_persistence_threshold` above the
largest LoRA tensor). Either way the trained weights are whole, so the KL reference (LoRA off), the EMA,
DiffusionNFT's old-policy adapter and the exports read them as in a data-parallel run. A full fine-tune has no
frozen base to partition: under ZeRO-3 it is refused (fsdp2.yaml shards its weights).

How the trainers drive the engine (`ZeroEngine`), and why:
- gradient accumulation is "unmanaged": `engine.step()` is the accumulation boundary, so an update may take
  any number of micro-batches (tree edges, uneven splits), as in the data-parallel path;
- the trainers call the model directly, not through `engine(...)`; a forward pre-hook does the one thing the
  engine's forward does for ZeRO before a pass (`clear_backward_seen_flag`: without it ZeRO-3's partitions
  kept only the last micro-batch's gradients; measured). ZeRO-3 adds a backward's gradients to the previous
  ones only when a forward ran in between, so each backward follows its own forward, as in the trainers;
- ZeRO-3's `memory_efficient_linear` is off: it swaps `torch.nn.functional.linear` for the whole process (VAE
  and reward models included) for a matmul + add that rounds differently from a run without DeepSpeed;
- each rank's loss already carries the global normaliser, and DeepSpeed averages over ranks, so `backward`
  scales the loss by the world size (the average of the scaled losses is their sum);
- DeepSpeed clips to the recipe's `optim.max_grad_norm` and skips a step whose gradients hold NaN / inf
  (measured: weights and moments untouched); the trainers' guard reads the engine's norm afterwards.

Checkpoints stay the plain, world-size-free format of a data-parallel run: the AdamW moments of every
parameter are gathered from the partitions (`FullOptimizerState`, DeepSpeed's `safe_get_full_optimizer_state`)
and written by rank 0 as safetensors; a resume on any world size, with or without ZeRO, scatters them back.
ZeRO-3 runs every forward as a collective (each gathers the partitioned weights), so its runs keep every
rank's forwards in step as FSDP2's do (`Distributed.gathers_weights`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Optional
from unittest import mock

import torch

# The Adam moments DeepSpeed keeps per partition, by their torch.optim.AdamW state names
MOMENTS = ("exp_avg", "exp_avg_sq")


class ZeroError(RuntimeError):
    """A DeepSpeed launch flowgrpo cannot run as asked."""


@dataclass(frozen=True)
class ZeroConfig:
    """The ZeRO stage an accelerate DeepSpeed launch asks for (1, 2 or 3), and the user's own DeepSpeed JSON."""

    stage: int = 2
    config_file: Optional[str] = None
    clipping: Optional[float] = None  # the launch's gradient_clipping (None: not set; must match the recipe)
    settings: dict[str, Any] = field(
        default_factory=dict
    )  # the launch's DeepSpeed config (a user's JSON, or accelerate's)

    @classmethod
    def from_accelerate_env(cls, env: dict[str, str] | None = None) -> ZeroConfig:
        """The settings `accelerate launch --config_file configs/accelerate/deepspeed_zero2.yaml` exports to every
        rank, read through accelerate's DeepSpeedPlugin; what flowgrpo cannot honour is refused here, in one line."""
        from accelerate.utils import DeepSpeedPlugin

        env = dict(os.environ if env is None else env)
        with mock.patch.dict(os.environ, env, clear=True):  # the plugin reads os.environ only
            plugin = DeepSpeedPlugin()
        ds = plugin.deepspeed_config
        zero = ds.get("zero_optimization", {})
        stage = int(zero.get("stage", plugin.zero_stage))
        if stage not in (1, 2, 3):
            raise ZeroError(f"zero_stage {stage}: flowgrpo runs ZeRO stages 1, 2 and 3 (or FSDP2: fsdp2.yaml)")
        if stage == 3 and plugin.zero3_init_flag:
            raise ZeroError(
                "zero3_init_flag: flowgrpo loads the model, then the engine partitions it (set it to false)"
            )
        for kind in ("offload_optimizer", "offload_param"):
            device = (zero.get(kind) or {}).get("device", "none")
            if str(device).lower() not in ("none", "auto"):
                raise ZeroError(f"{kind}: {device}: flowgrpo runs ZeRO without offloading (set it to none)")
        gas = ds.get("gradient_accumulation_steps", 1)
        if gas not in (1, "auto"):
            raise ZeroError(
                f"gradient_accumulation_steps {gas}: flowgrpo accumulates its own micro-batches (train.* settings "
                "of the recipe) and steps once per mini-batch; set it to 1"
            )
        precision = env.get("ACCELERATE_MIXED_PRECISION", "no")
        if precision != "no" or any(ds.get(k, {}).get("enabled") in (True, "true") for k in ("bf16", "fp16")):
            raise ZeroError(
                f"mixed_precision '{precision}' under DeepSpeed: its bf16 / fp16 mode would cast the fp32 trained "
                "weights; the recipe's model.dtype sets the precision (set mixed_precision: 'no')"
            )
        clip = ds.get("gradient_clipping")
        clipping = float(clip) if _is_number(clip) else None  # "auto" / None: not set
        file = env.get("ACCELERATE_DEEPSPEED_CONFIG_FILE") or None
        return cls(stage=stage, config_file=file, clipping=clipping, settings=dict(ds))

    def deepspeed_config(self, max_grad_norm: Optional[float], persist_above: int = 0) -> dict[str, Any]:
        """The DeepSpeed config of the engine (the user's JSON, if any, under flowgrpo's fixed settings)."""
        if self.clipping is not None and self.clipping != (max_grad_norm or 0.0):
            raise ZeroError(
                f"the DeepSpeed config clips gradients at {self.clipping}, the recipe's optim.max_grad_norm is "
                f"{max_grad_norm}; flowgrpo hands the recipe's to DeepSpeed: make them equal (or leave it auto)"
            )
        # "auto" is accelerate's placeholder, filled in by its `prepare`, which flowgrpo does not call: DeepSpeed's
        # own default applies instead
        zero = {k: v for k, v in self.settings.get("zero_optimization", {}).items() if v != "auto"}
        zero["stage"] = self.stage
        if self.stage == 3:  # tensors up to this size stay whole on every rank: the trained (LoRA) ones
            zero["stage3_param_persistence_threshold"] = persist_above
            zero.setdefault("memory_efficient_linear", False)
        return {
            **{
                k: v
                for k, v in self.settings.items()
                if k not in ("bf16", "fp16", "optimizer", "scheduler") and v != "auto"
            },
            "train_micro_batch_size_per_gpu": 1,
            "gradient_accumulation_steps": 1,
            "managed_gradient_accumulation": False,  # engine.step() is the boundary: any number of micro-batches
            "gradient_clipping": float(max_grad_norm or 0.0),
            "zero_optimization": zero,
            "zero_allow_untested_optimizer": True,  # torch's AdamW, the optimizer of every other launch
            "steps_per_print": 2**31 - 1,
            "wall_clock_breakdown": False,
        }


def _is_number(value: Any) -> bool:
    try:
        float(value)
    except (TypeError, ValueError):
        return False
    return True


def _whole_on_every_rank(module: torch.nn.Module, stage: int) -> int:
    """ZeRO-3's persistence threshold: one more than the largest trained or LoRA tensor (DiffusionNFT's
    old-policy adapter is frozen LoRA), so that those stay whole and only the frozen base is partitioned."""
    if stage != 3:
        return 0
    kept = [p.numel() for n, p in module.named_parameters() if p.requires_grad or "lora_" in n]
    threshold = max(kept, default=0) + 1
    if not any(not p.requires_grad and p.numel() >= threshold for p in module.parameters()):
        raise ZeroError(
            "ZeRO-3 partitions the frozen base of a LoRA run and keeps the trained weights whole; a full "
            "fine-tune has no frozen base: shard its weights with configs/accelerate/fsdp2.yaml (or run ZeRO-2)"
        )
    return threshold


class ZeroEngine:
    """A DeepSpeed engine over `module` and its AdamW: backward, step, the step's gradient norm."""

    def __init__(
        self,
        module: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        cfg: ZeroConfig,
        max_grad_norm: Optional[float],
        world_size: int,
    ) -> None:
        import deepspeed

        self.world_size, self.stage = world_size, cfg.stage
        self.params = [p for group in optimizer.param_groups for p in group["params"]]
        persist = _whole_on_every_rank(module, cfg.stage)
        self.group_sizes = [len(group["params"]) for group in optimizer.param_groups]  # DeepSpeed flattens them
        self.inner = optimizer  # the torch AdamW: its param groups (and the LR the schedule sets) stay live
        # DeepSpeed reads LOCAL_RANK, which a one-process run (no launcher: a run resumed on one GPU) lacks
        os.environ.setdefault("LOCAL_RANK", "0")
        self.engine, _, _, _ = deepspeed.initialize(
            model=module,
            optimizer=optimizer,
            config=cfg.deepspeed_config(max_grad_norm, persist),
            dist_init_required=False,
        )
        module.register_forward_pre_hook(self._before_forward)

    def _before_forward(self, module: torch.nn.Module, args: Any) -> None:
        self.engine.optimizer.clear_backward_seen_flag()  # what engine.forward does first

    def backward(self, loss: torch.Tensor) -> None:
        self.engine.backward(loss * self.world_size, scale_wrt_gas=False)

    def step(self) -> tuple[float, bool]:
        """Reduce, clip, AdamW; (the gradient norm before clipping, whether DeepSpeed applied the step)."""
        skipped = self.engine.skipped_steps
        self.engine.step()
        norm = self.engine.get_global_grad_norm()
        norm = float(norm) if norm is not None else 0.0
        return norm, self.engine.skipped_steps == skipped

    # --- the AdamW state, whole -------------------------------------------------------------------------

    def full_optimizer_state(self) -> dict[str, Any]:
        """torch.optim.AdamW.state_dict() of the whole parameters, gathered from every rank's partitions (a
        collective: every rank calls it)."""
        from deepspeed.utils import safe_get_full_optimizer_state

        steps = self._steps()
        state: dict[int, dict[str, Any]] = {}
        for i, p in enumerate(self.params if steps is not None else []):  # no moments before the first step
            moments = {k: safe_get_full_optimizer_state(p, k) for k in MOMENTS}
            if all(m is not None for m in moments.values()):
                state[i] = {"step": torch.tensor(steps), **{k: m.detach().cpu() for k, m in moments.items()}}
        groups, index = [], 0
        for group, n in zip(self.inner.param_groups, self.group_sizes):
            groups.append(
                {**{k: v for k, v in group.items() if k != "params"}, "params": list(range(index, index + n))}
            )
            index += n
        return {"state": state, "param_groups": groups}

    def load_full_optimizer_state(self, sd: dict[str, Any]) -> None:
        """Scatter a whole-parameter AdamW state (any world size's, or a run without ZeRO) into this rank's
        partitions."""
        from deepspeed.utils import safe_set_full_optimizer_state

        for group, saved in zip(self.inner.param_groups, sd["param_groups"]):
            group.update({k: v for k, v in saved.items() if k != "params"})
        if not sd["state"]:  # saved before the first step (e.g. Adv-GRPO's discriminator-only iterations)
            return
        self._create_optimizer_state()
        steps = None
        for i, p in enumerate(self.params):
            entry = sd["state"].get(i)
            if entry is None:
                continue
            for k in MOMENTS:
                safe_set_full_optimizer_state(p, entry[k].to(torch.float32), k)
            steps = float(entry["step"])
        if steps is not None:
            for state in self.inner.state.values():  # the flat partitions' AdamW steps
                if "step" in state:
                    state["step"] = torch.full_like(torch.as_tensor(state["step"]), steps)

    def load_master_weights(self) -> None:
        """After weights were loaded into the module (a resume): DeepSpeed's fp32 master partitions take them
        (its next step would otherwise write the weights it started with back into the module)."""
        from deepspeed.utils import safe_set_full_fp32_param

        for p in self.params:
            safe_set_full_fp32_param(p, p.detach().to(torch.float32))

    def _create_optimizer_state(self) -> None:
        """AdamW creates its moments at its first step, and DeepSpeed links them to the parameters then: a
        fresh engine takes one step with zero gradients at learning rate 0 (the weights do not move; the
        moments and step count it leaves are overwritten by the loaded ones)."""
        if self._steps() is not None:
            return
        lrs = [group["lr"] for group in self.inner.param_groups]
        for group in self.inner.param_groups:
            group["lr"] = 0.0
        import contextlib

        import deepspeed

        # ZeRO-3: the weights are read outside a forward, so gathered for it
        whole = deepspeed.zero.GatheredParameters(self.params) if self.stage == 3 else contextlib.nullcontext()
        with whole:
            self.engine.backward(torch.stack([(p * 0).sum() for p in self.params]).sum())
        self.engine.step()
        for group, lr in zip(self.inner.param_groups, lrs):
            group["lr"] = lr

    def _steps(self) -> Optional[float]:
        """AdamW's step count (the same for every partition: every step updates all); None before the first."""
        for state in self.inner.state.values():
            if "step" in state:
                return float(state["step"])
        return None


class FullOptimizerState:
    """The checkpoint's view of a ZeRO run's optimizer: `state_dict()` / `load_state_dict()` in torch AdamW's
    whole-parameter format. The gather is collective, so `gather()` runs on every rank before rank 0 writes."""

    def __init__(self, engine: ZeroEngine) -> None:
        self.engine = engine
        self._gathered: Optional[dict[str, Any]] = None

    def gather(self) -> None:
        self._gathered = self.engine.full_optimizer_state()

    def state_dict(self) -> dict[str, Any]:
        if self._gathered is None:
            raise ZeroError("the ZeRO optimizer state is gathered on every rank first (FullOptimizerState.gather)")
        return self._gathered

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.engine.load_full_optimizer_state(sd)
