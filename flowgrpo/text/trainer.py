"""The text GRPO trainer: generation and scoring of a causal LM; its method plug-in updates the policy.

One training step (the shared loop, flowgrpo/run/loop.py, runs it and owns checkpoints, metrics, progress):

    P prompts -> generate G completions each          (transformers generate or vLLM; each chunk of
                                                         prompts seeded by itself, on rank chunk % W)
              -> reward functions -> rewards [P, G, K] (NaN = not applicable / failed), gathered on every rank
              -> [DAPO dynamic sampling: drop zero-spread groups, generate more, bounded rounds]
                 (collect.py)
              -> the method plug-in (flowgrpo/text/methods.py; `grpo`: flowgrpo/text/grpo.py) turns the scored
                 batch into optimizer steps through the shared update loop (flowgrpo/run/update.py)
              -> the generation backend takes the new weights
"""

from __future__ import annotations

import logging
import math
from dataclasses import replace
from typing import Any, Callable, Mapping, Optional

import torch


from ..checkpoint import Checkpoint, load_into
from ..core.prompt_state import build_prompt_state, prompt_policy
from ..config import ConfigError
from ..metrics import TIME_KEY
from ..scaling.sharding import ShardingError, enable_activation_checkpointing, full_state
from ..run import CheckpointParts, OptimizerStep, PromptSampler, RunLoop, build_optimizer
from . import grpo, tppo  # noqa: F401  (register the methods)
from .collect import Collector
from .config import RENAMED_KEYS, TextConfig
from .data import load_prompts
from .generation import TransformersGenerator, eos_token_ids
from .methods import TextContext, build_method, method_class
from .models import is_peft, load_policy, reference_policy, resolve_model_path, trainable_state
from .reward_functions import build_rewards

log = logging.getLogger(__name__)


class TextGRPOTrainer(RunLoop):
    """GRPO-family training of a causal LM. `reward_funcs` adds callables by name for `rewards[].name`."""

    unit = "step"
    progress_label = "text-grpo"
    resume_free = frozenset({"iterations", "stop_after", "resume", "progress", "checkpoint", "output_dir"})
    renamed_keys = RENAMED_KEYS  # a checkpoint written before the renames still resumes
    nan_reward_is_missing = True  # a reward function's None: counted per reward already, not a failure

    def __init__(self, config: TextConfig, reward_funcs: Optional[Mapping[str, Callable]] = None):
        super().__init__(config, config.iterations)
        self.cfg: TextConfig = config
        cfg = config
        self.tokenizer, self.model = load_policy(cfg.model)
        self.reference = reference_policy(
            self.model, method_class(cfg.method).needs_reference(cfg)
        )  # a frozen copy is taken before sharding
        if cfg.train.gradient_checkpointing:  # after the copy: the frozen reference runs without grad anyway
            try:
                enable_activation_checkpointing(self.model)
            except ShardingError as err:
                raise ConfigError(f"train.gradient_checkpointing: {err}") from None
        if self.dist.sharded:
            self.dist.shard(self.model)
            frozen = getattr(self.reference, "frozen", None)
            if frozen is not None:
                self.dist.shard(frozen)
        self.device = next(self.model.parameters()).device
        self.eos_ids = eos_token_ids(self.model, self.tokenizer)
        try:
            self.rewards = build_rewards(
                cfg.rewards,
                extra=reward_funcs,
                context={
                    "max_tokens": cfg.generation.max_new_tokens,
                    "eos_token_ids": self.eos_ids,
                    "tokenizer": self.tokenizer,
                    "device": str(self.device),
                },
            )
        except ValueError as err:
            raise ConfigError(f"rewards: {err}") from None
        context = getattr(self._base_config(), "max_position_embeddings", None)
        self.data = load_prompts(
            cfg.data,
            self.tokenizer,
            context_length=context,
            max_new_tokens=cfg.generation.max_new_tokens,
            required_columns={r.name: r.columns for r in self.rewards},
        )
        self.generator = self._build_generator()
        self.sampler = PromptSampler(len(self.data), cfg.seed, cfg.data.shuffle)
        # per-prompt state across steps (SPO's tracker, Prompt Replay's buffer): None unless a part reads it
        sampling = cfg.prompt_sampling
        self.prompt_state = build_prompt_state(
            len(self.data), cfg.advantage.estimator.name, sampling.name, self._prompt_prior()
        )
        # reads_budgets: Knapsack RL's per-prompt budgets become ragged groups in the collector
        self.sampler.policy = prompt_policy(
            self.prompt_state, sampling.name, sampling.settings, cfg.seed, reads_budgets=True
        )
        try:
            self.collector = Collector(
                cfg, self.generator, self.tokenizer, self.data, self.rewards, self.sampler, self.dist, self.prompt_state
            )
        except ValueError as err:
            raise ConfigError(str(err)) from None
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        built = build_optimizer(self.params, cfg.optim, cfg.iterations, fused=True)
        self.optimizer, self.scheduler = built.optimizer, built.scheduler
        self.optimizer_step = OptimizerStep(
            self.params, self.optimizer, cfg.optim.max_grad_norm, self.dist, guard=self.guard, module=self.model,
            loss_scale=cfg.optim.loss_scale,
        )  # fmt: skip
        self.method = build_method(
            TextContext(
                cfg=cfg, dist=self.dist, optimizer_step=self.optimizer_step, params=self.params,
                reference=self.reference, completed=lambda: self.iteration, model=self.model, rewards=self.rewards,
                device=self.device, prompt_state=self.prompt_state, tokenizer=self.tokenizer, data=self.data,
            )
        )  # fmt: skip
        if cfg.resume:
            self.resume()

    def _prompt_prior(self) -> Optional[torch.Tensor]:
        """`data.value_column`: each row's offline success rate (NaN where the column is empty), or None."""
        column = self.cfg.data.value_column
        if column is None:
            return None
        values = [row.get(column) for row in self.data.rows]
        try:
            prior = torch.tensor([math.nan if v is None else float(v) for v in values], dtype=torch.float64)
        except (TypeError, ValueError):
            raise ConfigError(f"data.value_column: the column '{column}' must hold numbers in [0, 1]") from None
        if bool(((prior < 0) | (prior > 1)).any()):
            raise ConfigError(f"data.value_column: the column '{column}' must hold numbers in [0, 1]")
        if bool(torch.isnan(prior).all()):
            raise ConfigError(f"data.value_column: no row has a value in the column '{column}'")
        return prior

    def _build_generator(self) -> Any:
        gen = self.cfg.generation
        if gen.backend == "transformers":
            return TransformersGenerator(
                self.model, self.tokenizer, gen, self.cfg.group_size, synced=self.dist.gathers_weights
            )
        from .vllm_backend import VLLMGenerator

        m = self.cfg.model
        path = m.gguf_cache_dir if m.gguf_file else resolve_model_path(m.name_or_path)
        longest = max(len(ids) for ids in self.data.prompt_ids)
        generator = VLLMGenerator(
            self.model, self.tokenizer, gen, self.cfg.group_size, model_path=path, max_prompt_len=longest
        )
        generator.sync_weights()  # LoRA / resumed weights: the engine loaded the base model only
        return generator

    def _base_config(self) -> Any:
        model = self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model
        return model.config

    # --- checkpoints, the end of the run -----------------------------------------------------

    def checkpoint_parts(self) -> CheckpointParts:
        parts = CheckpointParts(tensors={"model": trainable_state(self.model)}, optimizers={"policy": self.optimizer_step.checkpointed},
                                state={"sampler": self.sampler.state_dict()})  # fmt: skip
        if self.prompt_state is not None:  # float64 tensors: restored exactly
            parts.tensors["prompt_state"] = self.prompt_state.state_dict()
        self.method.checkpoint_parts(parts)  # the method's own state (SPO kl's stored completions)
        self.collector.checkpoint_parts(parts)  # T-PPO windows: the streams carried into the next step
        return parts

    def restore(self, ckpt: Checkpoint) -> None:
        load_into(self.model, ckpt.tensors["model"])
        self.sampler.load_state_dict(ckpt.state["sampler"])
        if self.prompt_state is not None:
            if "prompt_state" not in ckpt.tensors:
                raise ConfigError(
                    "resume: the checkpoint has no prompt state (it was written without a part that reads one)"
                )
            self.prompt_state.load_state_dict(ckpt.tensors["prompt_state"])
        self.collector.restore(ckpt)
        self.method.restore(ckpt)
        self.generator.sync_weights()

    def save_final_model(self) -> None:
        """`final/`: the LoRA adapter (peft) or the whole model (transformers) and the tokenizer. A sharded run
        gathers the weights on rank 0 first (every rank calls this)."""
        final = self.out / "final"
        state = None
        if self.dist.sharded:
            state = full_state(self.model, trainable_only=is_peft(self.model))
            # tied weights (lm_head = embeddings) come back as two tensors: keep the name the model keeps
            own = {n for n, _ in self.model.named_parameters()} | {n for n, _ in self.model.named_buffers()}
            state = {k: v for k, v in state.items() if k in own}
        if self.dist.is_main:
            self.model.save_pretrained(str(final), state_dict=state)
            self.tokenizer.save_pretrained(str(final))

    def progress_postfix(self, record: dict[str, Any]) -> dict[str, str]:
        out = {"reward": f"{record.get('reward_mean', math.nan):.3f}",
               "len": f"{record.get('completions/mean_length', math.nan):.1f}"}  # fmt: skip
        if "kl/ref_mean" in record:  # the KL to the reference model, where the loss computes one
            out["kl_ref"] = f"{record['kl/ref_mean']:.1e}"
        return out

    # --- one step ----------------------------------------------------------------------------

    def train_iteration(self) -> dict[str, Any]:
        record = super().train_iteration()
        tokens = record.get("tokens/generated", 0)
        record["tokens/per_second"] = tokens / max(record[TIME_KEY], 1e-9)
        return record

    def iterate(self, record: dict[str, Any]) -> None:
        record.update(self.generator.settings)
        batch = self.collector.collect(record, self.iteration)
        if batch is None:
            log.warning("step %d: dynamic sampling kept no group with reward spread; no update", self.iteration + 1)
            record["skipped_update"] = 1
            return
        values = self.guard.rewards(record, batch.scores.values)  # +-inf -> NaN (left out like None), counted
        batch = replace(batch, scores=replace(batch.scores, values=values))
        self.optimizer_step.begin()
        self.method.update(batch, record)
        record.update(self.optimizer_step.metrics())
        self.generator.sync_weights()
        record["tokens/per_second_generate"] = record["tokens/generated"] / max(record["time_rollout_s"], 1e-9)


def train_text(config: TextConfig, reward_funcs: Optional[Mapping[str, Callable]] = None) -> list[dict[str, Any]]:
    """Build the trainer and run it; returns the metrics records of the steps run."""
    return TextGRPOTrainer(config, reward_funcs).train()
