"""The typed config of the text-to-image trainer: embedded defaults, a YAML recipe, key=value overrides.

Every section is strict (an unknown key names itself and the valid ones). Cross-section checks run
here, before any model is loaded, so an impossible combination fails in a second with its reason.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Iterable, Literal, Optional

from pydantic import Field, field_validator, model_validator

from ..config import SettingError, load_config, output_dir_problem
from ..guards import GuardConfig
from ..core import AdvantageConfig, LossConfig, PartSpec, StrictModel
from ..core.advantages import ESTIMATORS
from ..core.prompt_state import PROMPT_SAMPLERS, STATEFUL_ESTIMATORS
from ..run.config import CheckpointConfig, EMAConfig, OptimConfig, RatioCheckConfig, UpdateConfig
from .methods import METHODS, method_class
from .monitor_config import MonitorConfig, check_monitor
from .ragged import ragged_problem
from .awm import AWMConfig
from .sft import SFTConfig
from .dpo import DPOConfig
from .gardo import GardoConfig
from .reward_backprop import RewardBackpropConfig
from pipelines.plans import PLANS, build_plan
from pipelines.sampler import SamplerConfig
from pipelines.speed import SpeedConfig
from ..scaling.context_parallel import ContextParallelSettings, method_problem, trainer_problem, world_problem

DEFAULTS: dict[str, Any] = {
    "advantage": {"estimator": {"name": "grpo", "unbiased": False}, "transforms": [{"name": "clip", "max": 5.0}]},
    "loss": {"preset": "flow_grpo"},
    "optim": {"lr": 3e-4, "max_grad_norm": 1.0},
}

# Loss parts that treat a row as a sequence: an image action (one transition) is its own row here.
SEQUENCE_PARTS = {"sequence", "sequence_token"}

Seed = Annotated[int, Field(ge=0, lt=2**63)]  # torch generators take [0, 2**63) without wrapping
Beta = Annotated[float, Field(ge=0, lt=1)]  # an Adam beta


class ImageLoraConfig(StrictModel):
    rank: int = Field(8, ge=1)
    alpha: Optional[float] = Field(None, gt=0)  # None: = rank (the update is scaled by alpha / rank: 0 trains nothing)
    init: Literal["gaussian", "default"] = "gaussian"
    target_modules: Optional[list[str]] = None  # None: the family's published targets


class ImageModelConfig(StrictModel):
    family: str = "sd3"  # sd3 | flux | sd15 | qwenimage | flux2 | zimage
    pretrained: Optional[str] = None  # a local diffusers pipeline folder or a hub id
    tiny: bool = False  # random tiny weights (tests, CPU demos)
    tiny_options: dict[str, Any] = Field(default_factory=dict)  # qk_norm, guidance_embeds, ...
    init_seed: Seed = 0  # tiny weights depend on this only, not on the run's seed
    options: dict[str, Any] = Field(default_factory=dict)  # from_pretrained kw (variant, max_sequence_length ...)
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"  # frozen weights; step maths is always fp32
    # frozen components in another dtype than `dtype`, by the pipeline's component name (text_encoder, vae, ...):
    # cast after the model is built (flowgrpo.t2i.model.apply_component_dtypes); the denoiser takes `dtype`
    component_dtypes: dict[str, Literal["float32", "bfloat16", "float16"]] = Field(default_factory=dict)
    device: str = "auto"
    finetune: Literal["lora", "full"] = "lora"
    lora: ImageLoraConfig = Field(default_factory=ImageLoraConfig)
    init_lora: Optional[str] = None  # start from a saved LoRA folder / file
    # GPU speed switches (regional compile, attention backend, autocast, CFG forward, chunked decode,
    # gradient checkpointing): pipelines.speed.SpeedConfig, applied by build_policy after LoRA is attached
    speed: SpeedConfig = Field(default_factory=SpeedConfig)
    # ranks per sample of a long video sequence (diffusers' Ulysses / ring): flowgrpo.scaling.context_parallel
    context_parallel: ContextParallelSettings = Field(default_factory=ContextParallelSettings)

    @model_validator(mode="after")
    def _context_parallel(self) -> "ImageModelConfig":
        if problem := trainer_problem(self.context_parallel, is_video_family(self.family)):
            raise ValueError(problem)
        return self

    @model_validator(mode="before")
    @classmethod
    def _tiny_adapter_options(cls, data: Any) -> Any:
        """The adapter's own options (num_frames, ...) reach a tiny model too, as they reach a pretrained one."""
        if isinstance(data, dict) and data.get("tiny") and isinstance(data.get("options"), dict):
            tiny = dict(data.get("tiny_options") or {})
            data = {
                **data,
                "tiny_options": {**_adapter_options(data.get("family", "sd3"), data["options"], tiny), **tiny},
            }
        return data

    @model_validator(mode="after")
    def _source(self) -> "ImageModelConfig":
        if self.tiny == (self.pretrained is not None):
            raise ValueError("model: set exactly one of `pretrained: <path or hub id>` or `tiny: true`")
        if self.finetune == "full" and self.dtype != "float32":
            raise ValueError(
                "model: full fine-tuning keeps float32 master weights; use dtype float32 "
                "(bf16 compute on fp32 weights: speed.autocast bfloat16)"
            )
        return self


def _adapter_options(family: str, options: dict[str, Any], tiny_options: dict[str, Any]) -> dict[str, Any]:
    """The entries of `model.options` that the family's adapter takes itself (`Adapter.options`: num_frames,
    max_sequence_length, ...), for a tiny model; set in both sections they must agree."""
    from pipelines.adapters import ADAPTERS

    own = ADAPTERS[family].options if family in ADAPTERS else ()
    picked = {k: v for k, v in options.items() if k in own}
    clash = sorted(k for k in picked if k in tiny_options and tiny_options[k] != picked[k])
    if clash:
        raise ValueError(f"model: options and tiny_options set {clash} differently; set them in one place")
    return picked


def is_video_family(family: str) -> bool:
    """Whether the family's latents are 5-D [B, C, F, h, w] and its decode gives clips [B, F, 3, H, W]."""
    from pipelines.adapters import ADAPTERS

    return family in ADAPTERS and ADAPTERS[family].latent_ndim == 5


class PromptSetConfig(StrictModel):
    prompts: Optional[list[str]] = None  # inline prompts, or
    path: Optional[str] = None  # a .txt (one per line) or .jsonl ({"prompt": ..., metadata})
    eval_prompts: Optional[list[str]] = None
    eval_path: Optional[str] = None
    shuffle: bool = True
    # .jsonl rows naming input images (editing families): how each image is brought to the sampler's height x
    # width, as diffusers' VaeImageProcessor does: plain resize, resize + centre crop, or no change (else an error)
    image_resize: Literal["resize", "crop", "exact"] = "resize"

    @model_validator(mode="after")
    def _one(self) -> "PromptSetConfig":
        if (self.prompts is None) == (self.path is None):
            raise ValueError("data: set exactly one of `prompts: [...]` or `path: file.txt|.jsonl`")
        return self


class RewardConfig(PartSpec):
    """A scorer by registry name with its settings, its weight and an optional metrics alias."""

    weight: float = 1.0
    alias: Optional[str] = None

    @property
    def label(self) -> str:
        return self.alias or self.name


class GroupFilterConfig(StrictModel):
    """Edit-R1's group mask (flowgrpo/core/group_filter.py): a group enters the loss only when its reward std (biased,
    of the weighted reward) > min_std and its mean < max_mean; the loss is a mean over the samples kept."""

    min_std: float = Field(0.05, ge=0)
    max_mean: float = 0.9


class EdgeConfig(StrictModel):
    """Which stored transitions enter the loss (sampling and rewards are never changed by this)."""

    # BranchGRPO: node depths (1 .. sampler.num_steps) whose edges are not trained
    depth_pruning: Optional[list[Annotated[int, Field(ge=1)]]] = None
    depth_pruning_slide_every: Optional[int] = Field(None, ge=1)  # pruned depths move one level up every k iterations
    width_pruning: Optional[float] = Field(None, gt=0, le=1)  # BranchGRPO: keep ratio of the last split's children
    width_pruning_mode: Literal[1, 2] = 1
    drop_zero_advantage: bool = True  # edges with A = 0 add no gradient (unless KL is on)
    # DanceGRPO / Pref-GRPO: each sample trains its own random int(fraction * n) of the plan's n trained
    # steps (an independent permutation per sample, from seed and iteration); exclude_last drops the
    # last denoising step from n first (DanceGRPO's [:, :-1]).
    per_sample_fraction: Optional[float] = Field(None, gt=0, le=1)
    exclude_last: bool = False
    group_filter: Optional[GroupFilterConfig] = None  # saturated groups out of the loss (methods grpo, nft); None: off


class NFTConfig(StrictModel):
    """DiffusionNFT: forward-process objective against an old policy kept as a second LoRA adapter."""

    beta: float = Field(1.0, gt=0)  # implicit-policy step (0.1 for OCR / multi-reward)
    adv_max: float = Field(5.0, gt=0)  # A -> r = clip(A / adv_max / 2 + 0.5, 0, 1)
    # Training times on the rollout's sigma grid (flowgrpo/t2i/nft.py): "permutation": int(steps * timestep_fraction)
    # grid times per sample, a fresh permutation each (NVlabs release); "discrete": `timesteps` grid times per
    # micro-batch, stratified over the grid sigmas >= 1 - timestep_fraction (Flow-Factory TimeSampler.discrete)
    time_sampling: Literal["permutation", "discrete"] = "permutation"
    timesteps: int = Field(2, ge=1)  # discrete: training times per micro-batch (num_train_timesteps)
    timestep_fraction: float = Field(0.99, gt=0, le=1)
    decay: Literal["on_policy", "linear", "delayed"] = "linear"  # old <- lambda old + (1 - lambda) new
    # the decay's clock: optimizer steps so far, this iteration's included (the release's global_step), or the
    # 0-based index of the iteration just trained (Flow-Factory's ema_step(step=epoch))
    decay_clock: Literal["optimizer_steps", "iterations"] = "optimizer_steps"
    kl_coef: float = Field(0.0, ge=0)  # beta_KL * |v - v_ref|^2 (0.0001 in the release)


class AdversarialConfig(StrictModel):
    """Adv-GRPO: a discriminator reward trained alongside the policy, reference images as positives."""

    enabled: bool = False
    reward: str = "discriminator"  # the `rewards[].alias or name` that is trained
    references: Optional[str] = None  # folder of reference images (all prompts), or
    reference_generator: Optional[Literal["bright", "dark"]] = None  # synthetic references (tests, demos)
    d_times: int = Field(10, ge=2)  # D updates on iterations with (it + 1) % d_times != 0
    lr: float = Field(1e-4, ge=0)
    betas: tuple[Beta, Beta] = (0.5, 0.999)

    @model_validator(mode="after")
    def _refs(self) -> "AdversarialConfig":
        if self.enabled and (self.references is None) == (self.reference_generator is None):
            raise ValueError("adversarial: set exactly one of `references: <folder>` or `reference_generator`")
        return self


class HeldOutEvalConfig(StrictModel):
    """The held-out evaluation during training (deterministic ODE samples, fixed noise); `flowgrpo evaluate` has its
    own config (flowgrpo.evaluation.config.EvalConfig)."""

    every: int = Field(0, ge=0)  # iterations between evaluations; 0 = off
    num_steps: Optional[int] = Field(None, ge=1)  # ODE steps (default: the sampler's)
    images_per_prompt: int = Field(1, ge=1)
    use_ema: bool = True
    seed: Seed = 1234  # the same noise at every evaluation


class ArtifactsConfig(StrictModel):
    grid_every: int = Field(0, ge=0)  # sample grids of the rollout every k iterations (0: first and last)
    grid_images: int = Field(16, ge=1)
    video_fps: int = Field(16, ge=1, le=240)  # a video family's grids and tracker GIFs (Wan: 16)
    plot: bool = True  # reward_curve.png at the end
    tensorboard: bool = True
    wandb: bool = False
    wandb_project: str = "flowgrpo"

    @model_validator(mode="before")
    @classmethod
    def _moved(cls, data: Any) -> Any:
        if isinstance(data, dict) and "save_lora" in data:
            raise ValueError(
                "artifacts.save_lora was removed: the final LoRA (`lora/`, `lora_ema/`) is written when "
                "checkpoint.save_final_model is true (the one switch of both trainers); set "
                "checkpoint.save_final_model=false to skip it"
            )
        return data


class T2IConfig(StrictModel):
    seed: Seed = 0
    output_dir: str = "outputs/t2i"
    iterations: int = Field(20, ge=0)
    stop_after: Optional[int] = Field(None, ge=0)  # stop here as if interrupted; resume continues to `iterations`
    method: str = "grpo"  # a registered method (flowgrpo.t2i.methods.METHODS): grpo, nft
    model: ImageModelConfig = Field(default_factory=lambda: ImageModelConfig(tiny=True))
    data: PromptSetConfig = Field(default_factory=lambda: PromptSetConfig(prompts=["a photo of a cat"]))
    sampler: SamplerConfig = Field(default_factory=SamplerConfig)
    plan: PartSpec = Field(default_factory=lambda: PartSpec(name="full_sde"))
    group_size: int = Field(8, ge=2)
    prompts_per_iteration: int = Field(2, ge=1)
    rollout_prompts: int = Field(1, ge=1)  # prompts per rollout batch (its rewards overlap the next batch)
    # parts each prompt's group is rolled out in, as separate batches of group_size / rollout_split images (each
    # seeded by itself), so that a group can straddle ranks: 48 prompts x 24 images on 64 GPUs with 4 parts
    rollout_split: int = Field(1, ge=1)
    rewards: list[RewardConfig] = Field(default_factory=lambda: [RewardConfig(name="brightness")])
    reward_workers: int = Field(2, ge=1)
    advantage: AdvantageConfig = Field(default_factory=lambda: AdvantageConfig(**DEFAULTS["advantage"]))
    # which prompts each step draws (flowgrpo.core.prompt_state.PROMPT_SAMPLERS), as in the text trainer: uniform
    # (the seeded epoch permutation), spo (SPO's priorities from its value tracker), replay (Prompt Replay)
    prompt_sampling: PartSpec = Field(default_factory=lambda: PartSpec(name="uniform"))
    loss: LossConfig = Field(default_factory=lambda: LossConfig(**DEFAULTS["loss"]))
    edges: EdgeConfig = Field(default_factory=EdgeConfig)
    optim: OptimConfig = Field(default_factory=lambda: OptimConfig(**DEFAULTS["optim"]))
    train: UpdateConfig = Field(default_factory=UpdateConfig)
    ema: EMAConfig = Field(default_factory=EMAConfig)
    nft: NFTConfig = Field(default_factory=NFTConfig)
    awm: AWMConfig = Field(default_factory=AWMConfig)  # method awm (flowgrpo/t2i/awm.py)
    sft: SFTConfig = Field(default_factory=SFTConfig)  # method sft (flowgrpo/t2i/sft.py)
    # method reward_backprop: DRaFT-K / ReFL / AlignProp (flowgrpo/t2i/reward_backprop.py)
    reward_backprop: RewardBackpropConfig = Field(default_factory=RewardBackpropConfig)
    dpo: DPOConfig = Field(default_factory=DPOConfig)  # method diffusion_dpo (flowgrpo/t2i/dpo.py)
    gardo: GardoConfig = Field(default_factory=GardoConfig)  # methods grpo_gardo, nft_gardo (t2i/gardo.py)
    adversarial: AdversarialConfig = Field(default_factory=AdversarialConfig)
    eval: HeldOutEvalConfig = Field(default_factory=HeldOutEvalConfig)
    monitor: MonitorConfig = Field(default_factory=MonitorConfig)  # reward-hacking monitor (t2i/hacking_monitor.py)
    artifacts: ArtifactsConfig = Field(default_factory=ArtifactsConfig)
    ratio_check: RatioCheckConfig = Field(default_factory=RatioCheckConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    guards: GuardConfig = Field(default_factory=GuardConfig)  # non-finite rewards / gradients (flowgrpo.guards)
    resume: bool = False
    progress: bool = True
    num_threads: Optional[int] = Field(None, ge=1)
    deterministic: bool = False

    @field_validator("method")
    @classmethod
    def _registered_method(cls, name: str) -> str:
        METHODS.get(name)  # an unknown name fails with the valid ones
        return name

    @model_validator(mode="after")
    def _combinations(self) -> "T2IConfig":
        self.plan.check(PLANS, "plan")
        self.prompt_sampling.check(PROMPT_SAMPLERS, "prompt_sampling")
        if not self.rewards:
            raise ValueError("rewards: at least one scorer is needed")
        if problem := output_dir_problem(self.output_dir):
            raise ValueError(problem)
        labels = [r.label for r in self.rewards]
        dup = sorted({x for x in labels if labels.count(x) > 1})
        if dup:
            raise ValueError(f"rewards: duplicate names {dup}; give each an `alias`")
        if self.prompts_per_iteration % self.rollout_prompts:
            raise ValueError(
                f"prompts_per_iteration ({self.prompts_per_iteration}) must be a multiple of "
                f"rollout_prompts ({self.rollout_prompts})"
            )
        est = self.advantage.estimator.name
        plan = self.plan.name
        if problem := _world_size_problem(self):
            raise ValueError(problem)
        if problem := _estimator_problem(self):
            raise ValueError(problem)
        _check_plan(self)
        if self.rollout_split > 1 and (problem := _split_problem(self, est, plan)):
            raise ValueError(f"rollout_split {self.rollout_split}: {problem}")
        needs = ESTIMATORS.get(est)
        if problem := _prompt_state_problem(self, est) or ragged_problem(self):  # ragged: Knapsack RL's budgets
            raise ValueError(problem)
        if (self.edges.depth_pruning or self.edges.width_pruning) and plan != "tree":
            raise ValueError("edges: depth / width pruning are BranchGRPO options for the 'tree' plan")
        if self.plan.settings.get("post_compress") is not None and self.sampler.schedule.name != "time_shift":
            raise ValueError(
                "plan.post_compress rebuilds the tail of the time_shift grid (MixGRPO-Flash): set "
                "sampler.schedule {name: time_shift, shift: ...}"
            )
        if self.edges.group_filter is not None and self.method not in GROUP_FILTER_METHODS:
            readers = " or ".join(GROUP_FILTER_METHODS)
            raise ValueError(f"edges.group_filter masks groups in the loss of method {readers}, not '{self.method}'")
        if self.edges.exclude_last and self.edges.per_sample_fraction is None:
            raise ValueError("edges.exclude_last belongs to the per-sample step subsets: set per_sample_fraction")
        method = method_class(self.method)
        if self.edges.per_sample_fraction is not None and (
            needs.plan or plan not in ("full_sde", "window") or not method.per_sample_steps
        ):
            pickers = " or ".join(n for n in METHODS.names() if method_class(n).per_sample_steps)
            raise ValueError(
                f"edges.per_sample_fraction picks steps per final sample: it needs method {pickers}, a "
                f"chain plan (full_sde, window) and a sample-level estimator, not plan '{plan}' "
                f"with estimator '{est}'"
            )
        for part in ("ratio", "aggregation"):
            if getattr(self.loss, part).name in SEQUENCE_PARTS:
                raise ValueError(
                    f"loss.{part} '{getattr(self.loss, part).name}' treats a row as a sequence of "
                    "tokens; image actions are single transitions (use a token-level part)"
                )
        method.check_config(self)  # the method's own rules, registered with it
        size = self.sampler.share_noise_size
        if size is not None and plan in ("full_sde", "window", "ode_only") and self.group_size % size:
            raise ValueError(
                f"sampler.share_noise_size {size} must divide group_size {self.group_size} "
                "(a group is whole blocks that share a noise)"
            )
        if self.ema.count_idle_iterations and not self.adversarial.enabled:
            raise ValueError("ema.count_idle_iterations counts discriminator iterations: it needs adversarial.enabled")
        if problem := check_monitor(self):
            raise ValueError(problem)
        if is_video_family(self.model.family) and (problem := _video_problem(self)):
            raise ValueError(f"model.family '{self.model.family}' makes video clips: {problem}")
        if self.adversarial.enabled and self.adversarial.reward not in labels:
            raise ValueError(f"adversarial.reward '{self.adversarial.reward}' is not among rewards {labels}")
        return self


# the methods that hand the per-prompt state to the estimator: grpo (credit.assign_credit) and nft (its optimality)
PROMPT_STATE_METHODS = ("grpo", "nft")
# the methods whose loss reads edges.group_filter: grpo (credit.assign_credit), nft and nft_gardo (NFTMethod.update)
GROUP_FILTER_METHODS = ("grpo", "nft", "nft_gardo")


def _prompt_state_problem(cfg: T2IConfig, est: str) -> Optional[str]:
    """A part that reads the per-prompt state (estimator spo, a prompt sampler but uniform) with a method that
    does not feed it."""
    sampling = cfg.prompt_sampling.name
    if (est in STATEFUL_ESTIMATORS or sampling != "uniform") and cfg.method not in PROMPT_STATE_METHODS:
        part = f"advantage estimator '{est}'" if est in STATEFUL_ESTIMATORS else f"prompt_sampling '{sampling}'"
        return f"{part} reads the per-prompt state, which method {' or '.join(PROMPT_STATE_METHODS)} feeds, not '{cfg.method}'"
    return None


def _check_plan(cfg: T2IConfig) -> None:
    """Build the plan once for the sampler's steps (what depends on them: a window that fits, split steps inside the
    chain), so that it fails here and not after the run folder exists; a method that trains the plan's edges needs
    at least one trained step."""
    plan, steps = cfg.plan, cfg.sampler.num_steps
    try:
        built = build_plan(plan.name, steps, 0, cfg.seed, **plan.settings)
    except (ValueError, TypeError) as err:
        raise SettingError("plan", f"'{plan.name}' with sampler.num_steps {steps}: {err}") from None
    if method_class(cfg.method).per_sample_steps and not built.trained_steps:  # GRPO trains the plan's edges
        raise SettingError("plan", f"'{plan.name}' trains none of the {steps} steps: the run would learn nothing")
    depths = cfg.edges.depth_pruning or []
    if any(d > steps for d in depths):
        raise SettingError("edges.depth_pruning", f"node depths lie in [1, {steps}] (sampler.num_steps), got {depths}")


def _reward_kinds(cfg: T2IConfig) -> list[str]:
    """'pointwise' / 'pairwise' of each configured scorer, read from its registry entry (nothing is loaded)."""
    from reward_models import get_entry

    try:
        return [get_entry(r.name).kind for r in cfg.rewards]
    except KeyError as err:
        raise ValueError(f"rewards: {err}") from None


def _estimator_problem(cfg: T2IConfig) -> Optional[str]:
    """Whether the estimator, the plan and the rewards fit, from what the estimator reads (its registered `reads`)."""
    est, plan = cfg.advantage.estimator.name, cfg.plan.name
    needs = ESTIMATORS.get(est)
    per_step = needs.reads in ("step_rewards", "siblings")
    if needs.plan and plan != needs.plan:
        level = "per-step rewards" if per_step else "node rewards"
        return f"advantage estimator '{est}' needs {level} from the '{needs.plan}' plan, not '{plan}'"
    readers = [n for n in ESTIMATORS.names() if ESTIMATORS.get(n).plan == plan]
    if readers and est not in readers:  # a plan whose rewards only some estimators read
        kind = "node-level" if plan == "tree" else "per-step"
        return f"plan '{plan}' needs the {kind} estimator {' or '.join(map(repr, readers))}, not '{est}'"
    if "pairwise" in _reward_kinds(cfg):
        if per_step:
            return (
                f"a pairwise reward compares the final images of a group; the per-step estimator '{est}' needs "
                "pointwise probe rewards"
            )
        if cfg.rollout_split > 1:
            return "a pairwise reward compares a whole group's images: it needs rollout_split 1"
    return None


def _video_problem(cfg: T2IConfig) -> Optional[str]:
    """Image-only features a video run refuses (the reward stage checks each scorer's input once built)."""
    if cfg.adversarial.enabled:
        return "adversarial.enabled: the Adv-GRPO discriminator judges single images, not clips"
    if cfg.method in ("grpo_gardo", "nft_gardo") and cfg.gardo.diversity.enabled:
        return "gardo.diversity: its features are of single images, not clips; set gardo.diversity.enabled=false"
    if "pairwise" in _reward_kinds(cfg):
        return "a pairwise reward compares two images, not two clips; use a pointwise video scorer (per_frame, ...)"
    return None


def _world_size_problem(cfg: T2IConfig) -> Optional[str]:
    """The rollout batches of an iteration must divide evenly over the processes of the launch."""
    from ..distributed import world_size_from_environment

    world = world_size_from_environment()
    chunks = cfg.prompts_per_iteration // cfg.rollout_prompts * cfg.rollout_split
    cp = cfg.model.context_parallel
    if cp.enabled:  # the batches split over the groups of ulysses x ring ranks, not over the ranks
        return world_problem(cp, world, chunks) or method_problem(cp, cfg.method, cfg.adversarial.enabled)
    if chunks % world:
        return (
            f"prompts_per_iteration / rollout_prompts x rollout_split = {chunks} rollout batches must divide "
            f"evenly over {world} processes (rollout_split lets a group straddle ranks)"
        )
    return None


def _split_problem(cfg: T2IConfig, est: str, plan: str) -> Optional[str]:
    """Why `rollout_split` cannot split this recipe's groups (None: it can)."""
    k, G = cfg.rollout_split, cfg.group_size
    if G % k:
        return f"it must divide group_size {G}"
    if cfg.rollout_prompts != 1:
        return "a split group is rolled out one prompt at a time: set rollout_prompts 1"
    if cfg.method != "grpo" or cfg.adversarial.enabled:
        return "it needs method grpo without adversarial (DiffusionNFT and the discriminator read whole local groups)"
    if plan not in ("full_sde", "window", "ode_only") or ESTIMATORS.get(est).plan:
        return f"it needs a chain plan (full_sde, window) and a sample-level estimator, not '{plan}' / '{est}'"
    if cfg.sampler.share_noise and (cfg.sampler.share_noise_size is None or (G // k) % cfg.sampler.share_noise_size):
        return f"a shared initial noise must stay within a part: set sampler.share_noise_size to a divisor of {G // k}"
    return None


def load_t2i_config(path: Optional[str | Path] = None, overrides: Iterable[str] = ()) -> T2IConfig:
    """YAML recipe + key=value overrides over the embedded defaults."""
    return load_config(T2IConfig, path, overrides, defaults=DEFAULTS)
