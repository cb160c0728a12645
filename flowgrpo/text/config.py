"""The typed config of the text GRPO trainer: embedded defaults, then a YAML file, then key=value overrides.

Every section is a `StrictModel`: an unknown key is an error that lists the valid ones. The advantage
and loss sections are the shared core's own configs (`flowgrpo.core`), so every estimator, transform,
loss preset (named like TRL's `loss_type`) and loss part is selectable here by name.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any, Iterable, Literal, Optional, Union

from pydantic import Field, field_validator, model_validator

from ..config import SettingError, load_config, move_renamed_keys, output_dir_problem, read_yaml_config
from ..core import RECIPES, AdvantageConfig, LossConfig, PartSpec, StrictModel
from ..core.advantages import ESTIMATORS
from ..core.prompt_state import PROMPT_SAMPLERS, STATEFUL_ESTIMATORS
from ..guards import GuardConfig
from ..run.config import CheckpointConfig, OptimConfig, RatioCheckConfig, UpdateConfig
from .critic import CriticConfig
from .methods import METHODS

# estimators whose advantage needs no other sample of the group
GROUPLESS_ESTIMATORS = {"psr", "nsr", "w_reinforce", "spo"}

# Keys renamed to the image trainer's names (old dotted key -> new): the old ones still load, with a FutureWarning.
RENAMED_KEYS: dict[str, str] = {
    "steps": "iterations",
    "generation.prompts_per_step": "prompts_per_iteration",
    "generation.group_size": "group_size",
    "generation.rollout_split": "rollout_split",
    "model.lora.r": "model.lora.rank",
}

Seed = Annotated[int, Field(ge=0, lt=2**63)]  # torch generators take [0, 2**63) without wrapping

# Merged under every config file, key by key (a file only states what differs).
DEFAULTS: dict[str, Any] = {
    "advantage": {"estimator": "grpo", "head_nan_policy": "ignore_head"},
    "loss": {"preset": "dapo"},
}


class TinyModelConfig(StrictModel):
    """A random Qwen2 built in code with a byte-level tokenizer (tests, demos; no download)."""

    hidden_size: int = Field(64, ge=1)
    num_layers: int = Field(2, ge=1)
    num_heads: int = Field(4, ge=1)
    num_kv_heads: int = Field(2, ge=1)
    intermediate_size: int = Field(128, ge=1)
    max_position_embeddings: int = Field(256, ge=1)
    tie_word_embeddings: bool = True
    init_seed: Seed = 0  # weights depend on this seed only, not on the run's seed

    @model_validator(mode="after")
    def _heads(self) -> "TinyModelConfig":
        if self.hidden_size % self.num_heads or self.num_heads % self.num_kv_heads:
            raise SettingError(
                "",
                f"num_heads ({self.num_heads}) must divide hidden_size ({self.hidden_size}) and num_kv_heads "
                f"({self.num_kv_heads}) must divide num_heads",
            )
        return self


class TextLoraConfig(StrictModel):
    """peft LoRA. No dropout: the policy runs in eval mode so that re-scoring a rollout gives ratio 1."""

    enabled: bool = False
    rank: int = Field(8, ge=1)
    alpha: float = Field(16.0, gt=0)  # the update is scaled by alpha / rank: 0 trains nothing
    target_modules: list[str] = Field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])


class TextModelConfig(StrictModel):
    """`name_or_path: tiny` builds the tiny random model; `pkg:NAME` is the folder of an installed package;
    anything else is a local folder or a hub id (loaded with AutoModelForCausalLM / AutoTokenizer)."""

    name_or_path: str = "tiny"
    tiny: TinyModelConfig = Field(default_factory=TinyModelConfig)
    gguf_file: Optional[str] = None  # a GGUF file inside name_or_path (transformers de-quantises it)
    gguf_cache_dir: Optional[str] = None  # where the de-quantised model is cached as safetensors
    revision: Optional[str] = None
    trust_remote_code: bool = False
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    # every forward of the policy under torch.autocast in this dtype, the weights staying in `dtype`: fp32
    # master weights with bf16 matmuls (AdamW on bf16 weights loses updates below bf16's resolution)
    autocast: Optional[Literal["bfloat16", "float16"]] = None
    device: str = "auto"  # auto | cpu | cuda | cuda:1 ...
    lora: TextLoraConfig = Field(default_factory=TextLoraConfig)

    @model_validator(mode="after")
    def _master_weights(self) -> "TextModelConfig":
        if not self.lora.enabled and self.dtype != "float32":  # LoRA weights are fp32 on any base dtype
            raise ValueError(
                f"model: full fine-tuning keeps float32 master weights (AdamW on {self.dtype} weights rounds away "
                f"updates below its resolution: at lr 1e-6 almost no weight moves); use dtype float32 "
                f"(bf16 compute on fp32 weights: autocast bfloat16), or lora.enabled true"
            )
        return self


class TaskConfig(PartSpec):
    """A built-in generated dataset: `name` plus the generator's settings (see flowgrpo.text.data.TASKS)."""


class TextDataConfig(StrictModel):
    """JSONL prompts (`path`) or a built-in generated task (`task`)."""

    path: Optional[str] = None
    task: Optional[TaskConfig] = None
    prompt_field: str = "prompt"  # a string, or a list of chat messages
    chat_template: bool = True  # apply the tokenizer's chat template when it has one
    system_prompt: Optional[str] = None  # prepended as a system message when the template is applied
    shuffle: bool = True  # a new permutation each epoch (seeded)
    max_rows: Optional[int] = Field(None, ge=1)
    # a column with each prompt's offline success rate in [0, 1] (empty: unknown): SPO's value tracker starts there
    # (alpha = prior_count p, beta = prior_count (1 - p)) and its prompt sampler ranks unseen prompts by it
    value_column: Optional[str] = None

    @model_validator(mode="after")
    def _one_source(self) -> "TextDataConfig":
        if (self.path is None) == (self.task is None):
            raise ValueError("set exactly one of data.path (a JSONL file) and data.task (a built-in task)")
        return self


class VLLMConfig(StrictModel):
    """The colocated vLLM engine (`generation.backend: vllm`, GPU extra `pip install -e '.[vllm]'`).

    It runs in the training process on the same GPU; the policy's weights (LoRA merged) are loaded into
    it after every optimizer update.
    """

    gpu_memory_utilization: float = Field(0.3, gt=0, le=1)
    tensor_parallel_size: int = Field(1, ge=1)
    max_model_len: Optional[int] = Field(None, ge=1)  # default: max prompt length + max_new_tokens
    dtype: str = "auto"
    enable_prefix_caching: bool = True  # the G samples of a prompt share its KV blocks
    enable_sleep_mode: bool = False  # free the KV cache while the policy trains
    enforce_eager: bool = False


class GenerationConfig(StrictModel):
    """How the G samples of a prompt are drawn (P and G: `prompts_per_iteration`, `group_size`). `transformers`: `generate`, batched, left padding, KV cache. `vllm`: the
    colocated vLLM engine (GPU)."""

    backend: Literal["transformers", "vllm"] = "transformers"
    max_new_tokens: int = Field(32, ge=1)
    temperature: float = Field(1.0, gt=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0)  # 0 = off
    # top_p / top_k / min_p / repetition_penalty change what is sampled but not the recomputed
    # log-probs (those of the temperature-scaled full distribution, as in TRL)
    min_p: Optional[float] = Field(None, ge=0, le=1)
    repetition_penalty: Optional[float] = Field(None, gt=0)
    batch_size: int = Field(64, ge=1)  # sequences per generate call
    mask_truncated: bool = False  # DAPO overlong filtering: truncated completions leave the loss
    # record the sampler's log-prob of every token (always on with vLLM): the trainer then measures
    # how far the training forward is from it and corrects for it (`rollout_correction`)
    rollout_logprobs: bool = False
    vllm: VLLMConfig = Field(default_factory=VLLMConfig)


class RolloutCorrectionConfig(StrictModel):
    """Rollout-vs-training mismatch: the engine that sampled (vLLM kernels, bf16, a KV cache) gives
    slightly different log-probs than the training forward. With the sampler's log-probs recorded, the
    trainer computes w = exp(logp_train_old - logp_rollout) per token and, by `mode`:

    token_truncate     w_t clipped to [clip_min, clip_max] multiplies each token's policy term (TIS)
    token_mask         tokens with w_t outside [clip_min, clip_max] leave the loss
    sequence_truncate  one weight per completion, exp(sum_t log w_t), clipped, multiplies its tokens
    sequence_mask      completions whose sequence weight is outside the bounds leave the loss
    none               measured and logged only

    The weights are detached (no gradient); KL and entropy terms are not weighted.
    """

    mode: Literal["token_truncate", "token_mask", "sequence_truncate", "sequence_mask", "none"] = "token_truncate"
    clip_min: Optional[float] = Field(None, ge=0)  # None: no lower bound (0 for the mask modes)
    clip_max: float = Field(2.0, gt=0)

    @model_validator(mode="after")
    def _bounds(self) -> "RolloutCorrectionConfig":
        if self.clip_min is not None and self.clip_min >= self.clip_max:
            raise ValueError(f"rollout_correction: clip_min {self.clip_min} must be below clip_max {self.clip_max}")
        return self


class RewardSpec(PartSpec):
    """One reward function. `name` is a registered reward, or `module:function` / `path/file.py:function`.

    YAML: `target_pattern`, `{name: math_answer, weight: 1.0}`, or with settings
    `{name: format_regex, pattern: '\\\\boxed'}` (keys other than name/weight/columns are settings).
    `columns` lists the dataset columns a user function needs (checked on every row at load time).
    """

    name: str
    weight: float = 1.0
    columns: list[str] = Field(default_factory=list)
    alias: Optional[str] = None  # the name in the metrics (default: name)
    settings: dict[str, Any] = Field(default_factory=dict)

    @property
    def label(self) -> str:
        return self.alias or self.name.rsplit(":", 1)[-1]


class TextUpdateConfig(UpdateConfig):
    """How one generation batch (P x G sequences) is used: the shared passes, and the text forward's switches."""

    # sequences per no-grad log-prob pass (default micro_batch_size)
    logprob_batch_size: Optional[int] = Field(None, ge=1)
    # run each distinct prompt of a micro-batch once and repeat its key/value cache for the completions
    # that share it (fewer FLOPs, same maths). auto: on when it agrees with the plain forward on the
    # first batch (to a tenth of ratio_check.tolerance in log-prob); true / false: always / never
    shared_prompt: Union[bool, Literal["auto"]] = "auto"
    # recompute each decoder layer's activations in backward (transformers' own checkpointing): the
    # activations of a micro-batch shrink to the layers' inputs, for about one more forward of compute.
    # The shared-prompt forward writes a key/value cache that a recomputed layer would write twice, so
    # `shared_prompt: auto` is off with it (FSDP2 runs take it from the accelerate config instead)
    gradient_checkpointing: bool = False

    @model_validator(mode="after")
    def _checkpointing(self) -> "TextUpdateConfig":
        if self.gradient_checkpointing and self.shared_prompt is True:
            raise ValueError(
                "train.shared_prompt true cannot run with train.gradient_checkpointing true (a recomputed "
                "layer would write the prompt's key/value cache twice); use shared_prompt auto or false"
            )
        return self


class DynamicSamplingConfig(StrictModel):
    """DAPO dynamic sampling: drop groups whose rewards do not vary, generate more to refill the batch."""

    enabled: bool = False
    max_extra_rounds: int = Field(3, ge=0)  # extra generation rounds per step at most
    min_std: float = Field(0.0, ge=0)  # a group needs a reward std above this to stay


class TextRatioCheckConfig(RatioCheckConfig):
    """The text trainer's on-policy check.

    When the old log-probs are needed anyway (inner_epochs > 1 or mini_batches > 1), every sequence
    of the first pass is checked against them. Otherwise (one update per batch: the old log-probs are
    the detached current ones, as in TRL) only `rows` sequences of the first micro-batch are
    re-scored without grad for the check, so it costs a small fraction of a forward pass
    (`rows: null`: every sequence, a whole extra pass). What it guards against (dropout left on,
    non-deterministic kernels, weights changed between sampling and scoring) shows on every token
    of every sequence, so a few sequences a step are enough to see it.
    """

    rows: Optional[int] = Field(2, ge=1)


class TextConfig(StrictModel):
    seed: Seed = 0
    output_dir: str = "outputs/text"
    iterations: int = Field(20, ge=0)  # training steps of the run
    # stop at this step (as if interrupted); resume continues to `iterations`
    stop_after: Optional[int] = Field(None, ge=0)
    method: str = "grpo"  # a registered text method (flowgrpo.text.methods.METHODS)
    # a paper's whole recipe (flowgrpo.core.recipes.RECIPES): load_text_config puts its advantage estimator,
    # transforms, loss and prompt_sampling in place of the file's; key=value overrides apply on top
    recipe: Optional[str] = None
    model: TextModelConfig = Field(default_factory=TextModelConfig)
    data: TextDataConfig = Field(default_factory=lambda: TextDataConfig(task=TaskConfig(name="pattern")))
    group_size: int = Field(8, ge=1)  # G (1 only for estimators without a group baseline)
    prompts_per_iteration: int = Field(2, ge=1)  # P
    # a chunk's G samples per prompt are drawn in this many parts, each under its own seed on its own rank:
    # groups straddle ranks, so more ranks than chunks of prompts still all generate (G divisible by it)
    rollout_split: int = Field(1, ge=1)
    generation: GenerationConfig = Field(default_factory=GenerationConfig)
    rewards: list[RewardSpec] = Field(default_factory=lambda: [RewardSpec(name="target_pattern")])
    stop_on_reward_error: bool = False
    advantage: AdvantageConfig = Field(default_factory=lambda: AdvantageConfig(**DEFAULTS["advantage"]))
    # which prompts each step draws (flowgrpo.core.prompt_state.PROMPT_SAMPLERS): uniform (the seeded epoch
    # permutation), spo (SPO's priorities from its value tracker), replay (Prompt Replay)
    prompt_sampling: PartSpec = Field(default_factory=lambda: PartSpec(name="uniform"))
    loss: LossConfig = Field(default_factory=lambda: LossConfig(**DEFAULTS["loss"]))
    optim: OptimConfig = Field(default_factory=OptimConfig)
    train: TextUpdateConfig = Field(default_factory=TextUpdateConfig)
    dynamic_sampling: DynamicSamplingConfig = Field(default_factory=DynamicSamplingConfig)
    rollout_correction: RolloutCorrectionConfig = Field(default_factory=RolloutCorrectionConfig)
    ratio_check: TextRatioCheckConfig = Field(default_factory=TextRatioCheckConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    critic: CriticConfig = Field(default_factory=CriticConfig)  # method tppo's value model (text/critic.py)
    guards: GuardConfig = Field(default_factory=GuardConfig)  # non-finite rewards / gradients (flowgrpo.guards)
    resume: bool = False
    progress: bool = True
    num_threads: Optional[int] = Field(None, ge=1)  # torch CPU threads (fix it for bit-exact comparisons)
    deterministic: bool = False  # torch.use_deterministic_algorithms

    @model_validator(mode="before")
    @classmethod
    def _renamed(cls, data: Any) -> Any:
        return move_renamed_keys(data, RENAMED_KEYS)

    @field_validator("recipe")
    @classmethod
    def _known_recipe(cls, name: Optional[str]) -> Optional[str]:
        if name is not None and name not in RECIPES:
            raise ValueError(f"unknown recipe '{name}'; valid recipes: {sorted(RECIPES)}")
        return name

    @field_validator("method")
    @classmethod
    def _registered_method(cls, name: str) -> str:
        METHODS.get(name)  # an unknown name fails with the valid ones
        return name

    @model_validator(mode="after")
    def _check(self) -> "TextConfig":
        self.prompt_sampling.check(PROMPT_SAMPLERS, "prompt_sampling")  # here: a field validator's key doubles
        if not self.rewards:
            raise ValueError("rewards: at least one reward function is needed")
        if problem := output_dir_problem(self.output_dir):
            raise ValueError(problem)
        est = self.advantage.estimator.name
        reads = ESTIMATORS.get(est).reads  # what the estimator reads, from its registry entry
        # SPAE: method grpo runs its step probes (text/step_probe.py); egae: method tppo's critic (text/tppo.py)
        if est == "egae" and self.method != "tppo":
            raise ValueError("advantage estimator 'egae' needs a critic's values: set method: tppo (recipe tppo)")
        if reads != "final" and est not in ("spae", "egae"):
            raise ValueError(
                f"advantage estimator '{est}' reads {reads} (an image rollout's); the text trainer gives it each "
                "completion's final reward and uses one advantage per completion"
            )
        if self.group_size < 2 and est not in GROUPLESS_ESTIMATORS:
            raise ValueError(
                f"group_size 1: estimator '{est}' compares the samples of a group, so "
                f"one sample has advantage 0 and nothing is learnt; use >= 2 (or one of "
                f"{sorted(GROUPLESS_ESTIMATORS)})"
            )
        if self.data.value_column is not None and est not in STATEFUL_ESTIMATORS:
            raise ValueError(
                f"data.value_column: read by the estimators {sorted(STATEFUL_ESTIMATORS)} only, not '{est}'"
            )
        if self.group_size % self.rollout_split:
            raise ValueError(
                f"rollout_split {self.rollout_split} must divide group_size {self.group_size} "
                "(each part samples group_size / rollout_split completions of every prompt)"
            )
        labels = [r.label for r in self.rewards]
        dup = sorted({x for x in labels if labels.count(x) > 1})
        if dup:
            raise ValueError(f"rewards: duplicate names {dup}; give each an `alias`")
        if self.generation.backend == "vllm" and self.model.name_or_path == "tiny":
            raise ValueError(
                "generation.backend vllm needs a model vLLM can load (model.name_or_path: a folder "
                "or hub id), not the in-code tiny model"
            )
        if problem := _vllm_problem(self):
            raise ValueError(problem)
        METHODS.get(self.method).fn.check_config(self)  # the method's own rules, registered with it
        return self


def _vllm_problem(cfg: TextConfig) -> Optional[str]:
    """What the vLLM backend cannot run with: a GGUF file without its de-quantised copy, a ZeRO-3 launch."""
    if cfg.generation.backend != "vllm":
        return None
    if cfg.model.gguf_file and not cfg.model.gguf_cache_dir:
        return (
            "generation.backend vllm with model.gguf_file needs model.gguf_cache_dir (vLLM loads the de-quantised "
            "safetensors copy)"
        )
    from ..distributed import zero_from_launch

    zero = zero_from_launch()  # the launch's accelerate DeepSpeed config, read from the environment
    if zero is not None and zero.stage == 3:
        return "generation.backend vllm under ZeRO-3: the policy's weights are partitioned; use ZeRO-2 or FSDP2"
    return None


def migrate_saved_config(data: dict) -> dict:
    """A config dict saved before the renames (a checkpoint's `config`) under today's key names, without a warning."""
    return move_renamed_keys(data, RENAMED_KEYS, warn=False)


def recipe_overrides(path: Optional[str | Path], overrides: Iterable[str]) -> list[str]:
    """The overrides that put the named recipe's sections in place (none without a known `recipe`): the last
    `recipe=` override wins over the file's `recipe:`."""
    name = read_yaml_config(Path(path)).get("recipe") if path is not None else None
    for item in overrides:
        key, _, value = item.partition("=")
        if key.strip() == "recipe":
            name = value.strip() or None
    if name not in RECIPES:
        return []  # none, or unknown: TextConfig's check names the valid ones
    recipe = RECIPES[name]
    return [
        f"advantage.estimator={json.dumps(recipe['advantage']['estimator'])}",
        f"advantage.transforms={json.dumps(recipe['advantage']['transforms'])}",
        f"loss={json.dumps(recipe['loss'])}",
        f"prompt_sampling={json.dumps(recipe.get('prompt_sampling', 'uniform'))}",
    ]


def load_text_config(path: Optional[str | Path] = None, overrides: Iterable[str] = ()) -> TextConfig:
    """YAML file + key=value overrides over the embedded defaults; a `recipe` replaces the advantage estimator,
    transforms, loss and prompt sampler of the defaults and the file, before the overrides."""
    overrides = list(overrides)
    overrides = [*recipe_overrides(path, overrides), *overrides]
    return load_config(TextConfig, path, overrides, defaults=DEFAULTS, renamed=RENAMED_KEYS)
