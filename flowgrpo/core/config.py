"""Typed, strict configs of the core: unknown keys and unknown names are errors that list the valid ones."""

from __future__ import annotations

import difflib
import math
from dataclasses import dataclass
from typing import Any, Literal, Mapping, Optional

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ..config import SettingError
from .advantages import ESTIMATORS
from .losses import AGGREGATIONS, BOUNDS, KL_ESTIMATORS, PRESETS, RATIOS, STEP_WEIGHTINGS, SURROGATES
from .offpolicy import CLIP_MODES, REC_WEIGHTS  # registers the REC family's parts and presets
from . import trust_region  # noqa: F401  (registers the flow_dppo surrogate)
from .registry import Registry
from .regularizers import REGULARIZERS
from .transforms import TRANSFORMS
from .conditional import SCHEDULES  # registers CANON and Stratified GRPO
from .prompt_state import PROMPT_SAMPLERS
from . import spo as _spo  # noqa: F401  (registers SPO and ACE)
from . import egae, etr, knapsack, real, rover, spae, thr  # noqa: F401  (register the parts bounded below)


@dataclass(frozen=True)
class Bound:
    """The valid values of one registry setting. Settings are a function's keyword arguments, so the registry knows
    them by name only; a bound declared here (`bound_settings`) is checked when the config loads, before any folder
    or model. A number: finite, in [low, high] (an end open where `*_open`), an int where `integer`; or a name
    among `choices`."""

    low: Optional[float] = None
    high: Optional[float] = None
    low_open: bool = False
    high_open: bool = False
    integer: bool = False
    choices: tuple[str, ...] = ()

    def describe(self) -> str:
        if self.choices:
            return "one of " + ", ".join(map(repr, self.choices))
        kind = "an integer" if self.integer else "a finite number"
        if self.low is not None and self.high is not None:
            left, right = "(" if self.low_open else "[", ")" if self.high_open else "]"
            return f"{kind} in {left}{self.low:g}, {self.high:g}{right}"
        if self.low is not None:
            return f"{kind} {'>' if self.low_open else '>='} {self.low:g}"
        if self.high is not None:
            return f"{kind} {'<' if self.high_open else '<='} {self.high:g}"
        return kind

    def allows(self, value: Any) -> bool:
        if self.choices:
            return isinstance(value, str) and value in self.choices
        if isinstance(value, bool) or not isinstance(value, int if self.integer else (int, float)):
            return False
        if not math.isfinite(value):
            return False
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return False
        return self.high is None or (value < self.high if self.high_open else value <= self.high)


def at_least(low: float, *, integer: bool = False) -> Bound:
    return Bound(low=low, integer=integer)


def above(low: float) -> Bound:
    return Bound(low=low, low_open=True)


def count(low: int = 1) -> Bound:
    """An integer >= low (a count, a size, a step index)."""
    return Bound(low=low, integer=True)


def between(low: float, high: float, *, low_open: bool = False, high_open: bool = False) -> Bound:
    return Bound(low=low, high=high, low_open=low_open, high_open=high_open)


def one_of(*choices: str) -> Bound:
    return Bound(choices=choices)


FINITE = Bound()
PROBABILITY = between(0, 1)
FRACTION = between(0, 1, low_open=True)  # (0, 1]
POSITIVE = above(0)
NON_NEGATIVE = at_least(0)

# registry kind -> entry name -> setting -> bound (filled by `bound_settings`, next to each registry's users)
SETTING_BOUNDS: dict[str, dict[str, dict[str, Bound]]] = {}


def bound_settings(registry: Registry, name: str, **bounds: Bound) -> None:
    """Declare the valid values of settings of `registry`'s entry `name` (a setting not declared is checked against
    the type of its default: a finite number, an integer, a bool or a string)."""
    valid = registry.get(name).settings
    unknown = sorted(set(bounds) - set(valid))
    if unknown:
        raise ValueError(f"{registry.kind} '{name}' has no setting(s) {unknown} to bound")
    SETTING_BOUNDS.setdefault(registry.kind, {}).setdefault(name, {}).update(bounds)


def _default_bound(default: Any) -> Optional[Bound]:
    """The implicit bound of a setting from its default: the same kind of value (None or a sequence: not checked)."""
    if isinstance(default, bool):
        return None  # checked as a bool by `setting_problem`
    if isinstance(default, int):
        return Bound(integer=True)
    if isinstance(default, float):
        return FINITE
    return None


def setting_problem(registry: Registry, name: str, setting: str, value: Any) -> Optional[str]:
    """Why `value` is not valid for `setting` of the entry `name` (None: it is)."""
    defaults = registry.get(name).settings
    default = defaults.get(setting)
    if value is None and default is None:
        return None  # a setting that is off by default, left off
    bound = SETTING_BOUNDS.get(registry.kind, {}).get(name, {}).get(setting) or _default_bound(default)
    if bound is None:
        if isinstance(default, bool) and not isinstance(value, bool):
            return f"must be true or false, got {value!r} ({registry.kind} '{name}')"
        if isinstance(default, str) and not isinstance(value, str):
            return f"must be a string, got {value!r} ({registry.kind} '{name}')"
        return None
    if bound.allows(value):
        return None
    return f"must be {bound.describe()}, got {value!r} ({registry.kind} '{name}')"


def check_setting_bounds(registry: Registry, name: str, settings: Mapping[str, Any], key: str = "") -> None:
    """Raise a SettingError naming `key.setting` for the first setting outside its bound."""
    for setting, value in settings.items():
        if (problem := setting_problem(registry, name, setting, value)) is not None:
            raise SettingError(f"{key}.{setting}" if key else setting, problem)


class StrictModel(BaseModel):
    """A pydantic model whose unknown keys raise with the list of valid keys, and whose floats are finite (a NaN
    or inf setting passes no range check and silently misbehaves)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _reject_unknown_keys(cls, data: Any) -> Any:
        if isinstance(data, dict):
            valid = list(cls.model_fields)
            for key in data:
                if key not in valid:
                    close = difflib.get_close_matches(str(key), valid, n=1)
                    hint = f" (did you mean '{close[0]}'?)" if close else ""
                    raise ValueError(f"unknown key '{key}'{hint}; valid keys: {sorted(valid)}")
        return data


class PartSpec(BaseModel):
    """A named part with its settings. YAML: `name` or `{name: ..., setting: value, ...}`."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    name: str
    settings: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="before")
    @classmethod
    def _from_short_form(cls, data: Any) -> Any:
        if isinstance(data, str):
            return {"name": data}
        if isinstance(data, dict) and "settings" not in data:
            own = set(cls.model_fields) - {"settings"}  # subclasses add fields of their own (weight, ...)
            return {
                **{k: v for k, v in data.items() if k in own},
                "settings": {k: v for k, v in data.items() if k not in own},
            }
        return data

    def check(self, registry: Registry, key: str = "") -> "PartSpec":
        """The name is registered, its settings exist and are within their bounds (`key`: where the part sits,
        named in a bound's error)."""
        registry.get(self.name).check_settings(self.settings, registry.kind)
        check_setting_bounds(registry, self.name, self.settings, key)
        return self


class AdvantageConfig(StrictModel):
    """Which estimator turns rewards into advantages, and the transforms applied after it."""

    estimator: PartSpec = Field(default_factory=lambda: PartSpec(name="grpo"))
    transforms: list[PartSpec] = Field(default_factory=list)
    head_nan_policy: Literal["propagate", "ignore_head"] = "propagate"

    @model_validator(mode="after")
    def _check_names(self) -> "AdvantageConfig":
        self.estimator.check(ESTIMATORS, "estimator")
        for i, t in enumerate(self.transforms):
            t.check(TRANSFORMS, f"transforms.{i}")
        return self


class KLSpec(StrictModel):
    """KL to the reference policy, added to every action's loss as coef * estimator."""

    estimator: str = "k3"
    coef: float = Field(default=0.0, ge=0)  # a negative coefficient would reward moving away from the reference


class LossConfig(StrictModel):
    """A policy loss composed from named parts. `preset` fills the parts the user does not set."""

    preset: Optional[str] = None
    ratio: PartSpec = Field(default_factory=lambda: PartSpec(name="token"))
    bounds: PartSpec = Field(default_factory=lambda: PartSpec(name="symmetric"))
    surrogate: PartSpec = Field(default_factory=lambda: PartSpec(name="ppo_clip"))
    aggregation: PartSpec = Field(default_factory=lambda: PartSpec(name="token_mean"))
    step_weighting: PartSpec = Field(default_factory=lambda: PartSpec(name="none"))
    regularizer: PartSpec = Field(default_factory=lambda: PartSpec(name="none"))  # OPMD, AsymRE (regularizers.py)
    kl: KLSpec = Field(default_factory=KLSpec)
    entropy_coef: float = 0.0  # the entropy term's weight (finite; its sign is the user's choice)
    log_ratio_clamp: float = Field(default=20.0, gt=0)  # |log ratio| is clamped to this before exp

    @model_validator(mode="before")
    @classmethod
    def _apply_preset(cls, data: Any) -> Any:
        """Fill parts from the preset (or the defaults); a part given as settings only keeps its name."""
        if not isinstance(data, dict):
            return data
        base: dict[str, Any] = {}
        if data.get("preset") is not None:
            name = data["preset"]
            if name not in PRESETS:
                close = difflib.get_close_matches(str(name), list(PRESETS), n=1)
                hint = f" (did you mean '{close[0]}'?)" if close else ""
                raise ValueError(f"unknown loss preset '{name}'{hint}; valid presets: {sorted(PRESETS)}")
            base = PRESETS[name]
        merged = {**base, **data}
        for key in ("ratio", "bounds", "surrogate", "aggregation", "step_weighting", "regularizer", "kl"):
            user = data.get(key)
            if isinstance(user, dict) and ("name" not in user or key == "kl"):
                default = base.get(key)
                if default is None:
                    field = cls.model_fields[key]
                    default = field.get_default(call_default_factory=True).model_dump() if field.default_factory else {}
                    default = {"name": default["name"], **default["settings"]} if "settings" in default else default
                elif isinstance(default, str):
                    default = {"name": default}
                merged[key] = {**default, **user}
        return merged

    @model_validator(mode="after")
    def _check_names(self) -> "LossConfig":
        self.ratio.check(RATIOS, "ratio")
        self.bounds.check(BOUNDS, "bounds")
        self.surrogate.check(SURROGATES, "surrogate")
        self.aggregation.check(AGGREGATIONS, "aggregation")
        self.step_weighting.check(STEP_WEIGHTINGS, "step_weighting")
        self.regularizer.check(REGULARIZERS, "regularizer")
        KL_ESTIMATORS.get(self.kl.estimator)
        return self


# --- bounds of the core's registered settings (a count: >= 1; a probability: [0, 1]; ...) ---

# an eps added to a spread before dividing by it: 0 gives exact z-scores (a group without spread is then 0 / 0),
# a negative one can make the divisor 0 or flip its sign
EPS = NON_NEGATIVE

bound_settings(ESTIMATORS, "grpo", eps=EPS, std_scope=one_of("group", "batch", "none"))
bound_settings(ESTIMATORS, "batch_whiten", eps=EPS)
bound_settings(ESTIMATORS, "mc_grpo", mad_floor=POSITIVE)  # a MAD of 0 is common: the floor is the divisor
bound_settings(ESTIMATORS, "ngrpo", num_virtual=count(0), eps=EPS)
bound_settings(ESTIMATORS, "dgpo", eps=EPS, temperature=POSITIVE)
bound_settings(ESTIMATORS, "a_grae", alpha=POSITIVE, eps=EPS, std_eps=EPS)
bound_settings(ESTIMATORS, "w_reinforce", positive_weight=NON_NEGATIVE)
bound_settings(ESTIMATORS, "gdpo", eps=EPS)
bound_settings(ESTIMATORS, "win_rate", eps=EPS)
bound_settings(ESTIMATORS, "sibling", eps=EPS)
bound_settings(ESTIMATORS, "turning_point", eta=NON_NEGATIVE, balance_by=one_of("trend", "bonus"), eps=EPS)
bound_settings(ESTIMATORS, "value_anchored", gamma=PROBABILITY, k=NON_NEGATIVE, absolute_steps=count(0), eps=POSITIVE)
bound_settings(ESTIMATORS, "tree_depth", fusion=one_of("mean", "softmax"), eps=EPS, min_std=NON_NEGATIVE)
bound_settings(TRANSFORMS, "clip", max=POSITIVE)
bound_settings(TRANSFORMS, "filter_zero_std", tol=NON_NEGATIVE)
bound_settings(TRANSFORMS, "top_bottom_k", k=count(1))
bound_settings(TRANSFORMS, "nft_optimality", adv_clip_max=POSITIVE)
bound_settings(BOUNDS, "symmetric", eps=NON_NEGATIVE)
bound_settings(BOUNDS, "asymmetric", eps_low=PROBABILITY, eps_high=NON_NEGATIVE)
bound_settings(BOUNDS, "dcpo", eps_low=NON_NEGATIVE, eps_high=NON_NEGATIVE)
bound_settings(SURROGATES, "ppo_clip", dual_clip=above(1), delta=above(1))  # both cap a ratio above 1
bound_settings(SURROGATES, "sapo", tau_pos=POSITIVE, tau_neg=POSITIVE)
bound_settings(AGGREGATIONS, "token_mean", scale=POSITIVE)
bound_settings(
    SURROGATES,
    "rec",
    clip_mode=one_of(*CLIP_MODES),
    eps_low_prime=between(0, 1, low_open=True),  # Trinity: 0 < eps_low_prime <= 1
    eps_high_prime=POSITIVE,
    weight=one_of(*REC_WEIGHTS),
    temp=POSITIVE,
)
bound_settings(ESTIMATORS, "rec", eps=EPS, drop=one_of("none", "balance"))
bound_settings(
    ESTIMATORS,
    "canon",
    metric=one_of("entropy", "length"),
    lam=PROBABILITY,
    max_length=POSITIVE,
    schedule=one_of(*SCHEDULES),
    scheduled=one_of("inter", "intra"),
    sched_high=PROBABILITY,
    sched_low=PROBABILITY,
    warmup_steps=count(1),
    total_steps=count(1),
    cycles=count(1),
)
bound_settings(ESTIMATORS, "stratified_grpo", alpha=PROBABILITY, eps=EPS)
bound_settings(REGULARIZERS, "opmd", coef=NON_NEGATIVE)
bound_settings(REGULARIZERS, "asymre", coef=NON_NEGATIVE)
bound_settings(
    ESTIMATORS,
    "spo",
    rho=between(0, 1, low_open=True),
    prior_value=PROBABILITY,
    prior_count=POSITIVE,
    eps=EPS,
    rho_type=one_of("constant", "kl"),
    d_half=POSITIVE,
    rho_min=PROBABILITY,
)
bound_settings(TRANSFORMS, "ace", alpha=NON_NEGATIVE)
bound_settings(PROMPT_SAMPLERS, "spo", floor=NON_NEGATIVE)
bound_settings(PROMPT_SAMPLERS, "replay", fraction=PROBABILITY, cooldown=count(0), max_reuse=count(1))
# issue 31's second round: REAL, ETR, ROVER, THR, Knapsack RL, T-PPO's EGAE, SPAE (their modules register them)
bound_settings(ESTIMATORS, "real", labels=one_of("binary", "mean"))
bound_settings(SURROGATES, "real", tau=POSITIVE)
bound_settings(BOUNDS, "etr", eps_low=PROBABILITY, eps_high=NON_NEGATIVE, alpha=NON_NEGATIVE, beta=NON_NEGATIVE,
               a_max=POSITIVE)  # fmt: skip
bound_settings(ESTIMATORS, "rover", eps=EPS)
bound_settings(SURROGATES, "rover", temperature=POSITIVE)
bound_settings(STEP_WEIGHTINGS, "thr", p=between(-1, 1), select=one_of(*thr.SELECTIONS), beta=FINITE, top_frac=FRACTION,
               mode=one_of(*thr.MODES))  # fmt: skip
bound_settings(PROMPT_SAMPLERS, "knapsack", low=count(1), high=count(1), unknown=PROBABILITY)
bound_settings(PROMPT_SAMPLERS, "ban_saturated", std_below=NON_NEGATIVE)  # Edit-R1's ban (group_filter.py)
bound_settings(ESTIMATORS, "egae", gamma=PROBABILITY, lam=PROBABILITY)
bound_settings(
    ESTIMATORS, "spae", saturation=PROBABILITY, saturation_weight=PROBABILITY, shaping_coef=NON_NEGATIVE,
    shaping_clip=POSITIVE, eps=EPS, probe_batch_size=count(0), probe_samples=count(0), probe_temperature=POSITIVE,
    probe_max_tokens=count(1),
)  # fmt: skip
