"""The `monitor:` section of an image recipe: the reward-hacking monitor (flowgrpo/t2i/hacking_monitor.py), on by
default. Thresholds are documented where they are read (flowgrpo/t2i/hacking_alarm.py)."""

from __future__ import annotations

import inspect
from typing import Annotated, Any, Optional

from pydantic import Field

from ..core import PartSpec, StrictModel

# Held-out gold scorers when `monitor.gold` is not set: built in, no weights, no downloads. JPEG compressibility
# falls with the high-frequency noise, speckle and grid patterns that reward hacking leaves behind. A scorer that
# is also trained is left out (a trained reward is no gold); real runs should name a held-out model
# (`monitor.gold: [aesthetic]`, `[hpsv2]`, `[pickscore]`, ...) that is not among `rewards`.
DEFAULT_GOLD = ("jpeg_compressibility",)


class GoldScorer(PartSpec):
    """A pointwise scorer by registry name with its settings; `weight` weighs it in the combined gold score."""

    weight: float = Field(1.0, gt=0)
    alias: Optional[str] = None

    @property
    def label(self) -> str:
        return self.alias or self.name


class AlarmConfig(StrictModel):
    """When the monitor raises its alarm (flowgrpo/t2i/hacking_alarm.py has the rules). Effects are in units of the
    baseline's per-image standard deviation of the score (the images the untrained model made from the same
    prompts and noise); trends are least-squares slopes over the last `window` monitor evaluations."""

    window: int = Field(3, ge=2)  # K: monitor evaluations (the baseline included) the trends are fitted over
    patience: int = Field(2, ge=1)  # consecutive evaluations a rule must hold before the alarm fires
    gap: float = Field(1.0, gt=0)  # training-reward effect minus gold effect, since the baseline
    gold_follow: float = Field(0.25, ge=0)  # "gold flat": its trend is at most this share of the reward's trend
    gold_drop: float = Field(1.0, gt=0)  # gold fell this far below its best while the training reward held
    gold_rise: float = Field(0.5, ge=0)  # gold improved at least this much: image-statistic drifts are benign
    saturation_rise: float = Field(0.15, gt=0)  # absolute rise of the mean HSV saturation over the baseline
    clipped_rise: float = Field(0.10, gt=0)  # absolute rise of the share of clipped channel values
    grid_ratio: float = Field(2.0, gt=1)  # grid8 / grid16 at least this many times the baseline's ...
    grid_rise: float = Field(0.05, gt=0)  # ... and up by at least this much (absolute)
    high_freq_rise: float = Field(0.15, gt=0)  # absolute rise of the high-frequency power share
    diversity_ratio: float = Field(0.5, gt=0, lt=1)  # group diversity at most this share of the baseline's


class MonitorConfig(StrictModel):
    """Held-out gold scorers on fixed prompts and fixed noise every `every` iterations (deterministic ODE samples,
    EMA weights when kept), the training reward on the same images, image statistics and an alarm."""

    enabled: bool = True
    every: int = Field(5, ge=1)  # iterations between monitor evaluations; the baseline runs before the first update
    gold: Optional[list[GoldScorer]] = None  # None: DEFAULT_GOLD less the trained scorers
    prompts: Optional[list[str]] = None  # None: the held-out eval prompts (data.eval_prompts / eval_path)
    max_prompts: int = Field(4, ge=1)
    images_per_prompt: int = Field(4, ge=2)  # a group per prompt: diversity needs two or more
    num_steps: Optional[int] = Field(None, ge=1)  # ODE steps (default: eval.num_steps, else the sampler's)
    seed: Annotated[int, Field(ge=0, lt=2**63)] = 20_250  # the same noise at every monitor evaluation
    use_ema: bool = True
    stop_on_alarm: bool = False  # end the run (checkpoint saved, one line why) when the alarm fires
    # best_gold/ weights of the best-gold evaluation (LoRA: diffusers LoRA folder; full: the denoiser folder).
    # None: LoRA runs save them, full fine-tunes only write best_gold.json (a full denoiser per new best is large)
    save_best: Optional[bool] = None
    alarm: AlarmConfig = Field(default_factory=AlarmConfig)


def makes_video(cfg: Any) -> bool:
    """Whether the recipe's model family decodes to clips [B, F, 3, H, W] (5-D latents), not images."""
    from pipelines.adapters import ADAPTERS

    family = ADAPTERS.get(cfg.model.family)
    return family is not None and family.latent_ndim == 5


def _inner_name(reward: Any) -> Any:
    """The image scorer a per_frame reward wraps (its `reward` setting: a name or {name, ...})."""
    inner = reward.settings.get("reward") if reward.name == "per_frame" else None
    return inner.get("name") if isinstance(inner, dict) else inner


def gold_specs(cfg: Any) -> list[GoldScorer]:
    """The gold scorers of a T2IConfig: `monitor.gold`, or DEFAULT_GOLD less the scorers that are trained. A video
    run scores each default (image) gold scorer on every frame of a clip (per_frame, mean), under its own name."""
    m: MonitorConfig = cfg.monitor
    if m.gold is not None:
        return list(m.gold)
    trained = {r.name for r in cfg.rewards} | {_inner_name(r) for r in cfg.rewards}
    names = [n for n in DEFAULT_GOLD if n not in trained]
    if makes_video(cfg):
        return [GoldScorer(name="per_frame", settings={"reward": {"name": n}}, alias=n) for n in names]
    return [GoldScorer(name=n) for n in names]


def check_monitor(cfg: Any) -> Optional[str]:
    """Why `monitor` cannot run with this recipe (None: it can): gold scorers must be registered, pointwise, with
    known settings and distinct labels. Nothing is loaded."""
    from reward_models import get_entry

    if not cfg.monitor.enabled:
        return None
    labels = []
    for g in gold_specs(cfg):
        try:
            entry = get_entry(g.name)
        except KeyError as err:
            return f"monitor.gold: {err}"
        if entry.kind != "pointwise":
            return f"monitor.gold: '{g.name}' is {entry.kind}; gold scorers score one image at a time (pointwise)"
        unknown = sorted(set(g.settings) - set(entry.settings))
        if unknown:
            return f"monitor.gold: scorer '{g.name}' has no setting {unknown}; valid: {sorted(entry.settings)}"
        missing = [k for k, v in entry.settings.items() if v is inspect.Parameter.empty and k not in g.settings]
        if missing:
            return f"monitor.gold: scorer '{g.name}' needs setting(s) {missing}"
        labels.append(g.label)
    dup = sorted({x for x in labels if labels.count(x) > 1})
    return f"monitor.gold: duplicate names {dup}; give each an `alias`" if dup else None
