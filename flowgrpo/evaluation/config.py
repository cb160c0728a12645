"""The evaluation config: what to score (a folder of images, or images generated now), with which
scorers, what to compare against, and how to report. A YAML file plus `key.sub=value` overrides,
loaded by `flowgrpo.config.load_config`; every section is strict (an unknown key is an error that
lists the valid ones), and scorer names and settings are checked against the reward_models registry
before any image is generated.

    input:
      generate: {model: sd3, pretrained: /models/sd3.5-medium, lora: outputs/run/lora, prompts: prompts.txt}
    baseline:                    # optional: the same model without LoRA, compared against `input`
      generate: {model: sd3, pretrained: /models/sd3.5-medium, prompts: prompts.txt}
    scorers: [pickscore, {name: jpeg_compressibility, quality: 95}]
    output_dir: outputs/eval/sd35-lora

Image editing: `input.generate={model: flux_kontext, tiny: true, prompts: edits.jsonl}` (or qwenimage_edit /
qwenimage_edit_plus) with rows `{"prompt": ..., "images": [paths relative to the file]}`; edit scorers such as
edit_preservation and clip_directional read metadata["source_images"] (see sources.py, generate.py).
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any, Iterable, Literal, Optional

from pydantic import Field, model_validator

from ..config import load_config
from ..core.config import PartSpec, StrictModel


class ImagesInput(StrictModel):
    """A folder of images and a prompts file (see `flowgrpo.evaluation.sources` for the formats).

    `prompts` defaults to `<dir>/prompts.jsonl`, else `<dir>/prompts.txt`."""

    dir: str
    prompts: Optional[str] = None


class GenerateInput(StrictModel):
    """Images generated now: deterministic ODE sampling (plan `ode_only`) of a model family.

    The initial noise of a batch is drawn from a generator seeded by (`seed`, index of the batch's
    first prompt): two runs with the same `seed`, `batch_size`, prompts and resolution start every
    image from the same noise, so a base model and its LoRA are compared image for image.
    """

    model: str  # family: sd3 | flux | sd15 | qwenimage | ...; editing: flux_kontext | qwenimage_edit(_plus)
    pretrained: Optional[str] = None  # a local diffusers pipeline folder or a hub id
    tiny: bool = False  # tiny random weights built from configs (tests, demos)
    lora: Optional[str] = None  # a folder (or .safetensors file) written by adapter.save_lora
    prompts: str  # prompt set: .txt (one per line) or .jsonl ("prompt" + metadata; editing: + "images")
    image_resize: Literal["resize", "crop", "exact"] = "resize"  # editing: how input images reach height x width
    max_prompts: Optional[int] = Field(default=None, ge=1)
    images_per_prompt: int = Field(default=1, ge=1)
    num_steps: int = Field(default=28, ge=1)
    guidance_scale: float = Field(default=4.5, ge=0)
    cfg_mode: Literal["full", "none"] = "full"  # "none" for guidance-distilled models (FLUX dev / schnell)
    solver: Literal["euler", "dpm2m"] = "euler"
    shift: Optional[float] = Field(default=None, gt=0)  # None: the model's scheduler config decides
    height: int = Field(default=512, ge=8)
    width: int = Field(default=512, ge=8)
    fps: int = Field(default=16, ge=1, le=240)  # a video family's clips (wan): frames per second of the files
    seed: int = Field(default=0, ge=0, lt=2**63)  # torch generators take [0, 2**63)
    batch_size: int = Field(default=4, ge=1)  # prompts per sampler call (each with images_per_prompt images)
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    device: str = "auto"  # auto | cpu | cuda | cuda:1 ...
    model_options: dict[str, Any] = Field(default_factory=dict)  # more build_adapter kw (max_sequence_length, ...)

    @model_validator(mode="after")
    def _one_source(self) -> "GenerateInput":
        from pipelines.adapters import ADAPTERS  # light: adapters import diffusers only when used

        if self.model not in ADAPTERS:
            raise ValueError(f"unknown model family '{self.model}'; valid: {sorted(ADAPTERS)}")
        if (self.pretrained is None) == (not self.tiny):
            raise ValueError("set exactly one of generate.pretrained (a path or hub id) and generate.tiny=true")
        taken = {"dtype", "device", "pretrained", "tiny"} & set(self.model_options)
        if taken:
            raise ValueError(f"model_options may not set {sorted(taken)}: they are settings of their own")
        return self


class InputConfig(StrictModel):
    """One set of images to score: exactly one of `images` (a folder) and `generate`."""

    label: Optional[str] = None  # shown in the report; default: the output folder's name
    images: Optional[ImagesInput] = None
    generate: Optional[GenerateInput] = None

    @model_validator(mode="after")
    def _exactly_one(self) -> "InputConfig":
        if (self.images is None) == (self.generate is None):
            raise ValueError("set exactly one of images (a folder with a prompts file) and generate (a model)")
        return self


class ScorerSpec(PartSpec):
    """A reward_models scorer: `name` or `{name: ..., setting: value}`; checked against the registry."""

    @model_validator(mode="after")
    def _check_registry(self) -> "ScorerSpec":
        from reward_models import get_entry

        try:
            entry = get_entry(self.name)
        except KeyError as err:  # UnknownScorerError: the message lists the valid names
            raise ValueError(str(err)) from None
        valid = entry.settings
        unknown = [k for k in self.settings if k not in valid]
        if unknown:
            raise ValueError(f"scorer '{self.name}' has no setting {unknown}; valid settings: {sorted(valid)}")
        missing = [k for k, v in valid.items() if v is inspect.Parameter.empty and k not in self.settings]
        if missing:
            raise ValueError(f"scorer '{self.name}' needs setting(s) {missing}")
        return self

    @property
    def kind(self) -> str:
        from reward_models import get_entry

        return get_entry(self.name).kind


class ReportConfig(StrictModel):
    enabled: bool = True
    title: Optional[str] = None
    top_k: int = Field(default=4, ge=0)  # best and worst k images per scorer (and pairs in a comparison)
    thumbnail_size: int = Field(default=192, ge=16)  # longest side in pixels; smaller images are kept as they are
    thumbnail_format: Literal["jpeg", "png"] = "jpeg"
    histogram_bins: int = Field(default=20, ge=1)


class StatsConfig(StrictModel):
    """Confidence intervals of means: percentile bootstrap (numpy), `resamples` draws, seeded."""

    confidence: float = Field(default=0.95, gt=0, lt=1)
    resamples: int = Field(default=2000, ge=1)
    seed: int = Field(default=0, ge=0)  # numpy's default_rng refuses a negative seed


class EvalConfig(StrictModel):
    input: InputConfig
    baseline: Optional[InputConfig] = None  # run A of a comparison, evaluated into <output_dir>/baseline
    compare: Optional[str] = None  # run A from an earlier evaluation's output folder
    scorers: list[ScorerSpec] = Field(min_length=1)
    score_batch_size: int = Field(default=32, ge=1)  # images loaded and scored together
    output_dir: str = "outputs/eval"
    overwrite: bool = False  # allow writing over an earlier run in output_dir
    progress: bool = True  # tqdm progress bars
    report: ReportConfig = Field(default_factory=ReportConfig)
    stats: StatsConfig = Field(default_factory=StatsConfig)

    @model_validator(mode="after")
    def _check(self) -> "EvalConfig":
        if self.baseline is not None and self.compare is not None:
            raise ValueError("set at most one of baseline (evaluated now) and compare (an earlier run's folder)")
        names = [s.name for s in self.scorers if s.kind == "pairwise"]
        if names and self.baseline is None and self.compare is None:
            raise ValueError(f"pairwise scorer(s) {names} need a comparison: set baseline or compare")
        return self


def load_eval_config(path: Optional[str | Path] = None, overrides: Iterable[str] = ()) -> EvalConfig:
    """Defaults, then the YAML file, then `key.sub=value` overrides; raises ConfigError."""
    return load_config(EvalConfig, path, overrides)
