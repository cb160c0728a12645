"""Typed, strict configs of the core: unknown keys and unknown names are errors that list the valid ones."""

from __future__ import annotations

import difflib
from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, model_validator

from .advantages import ESTIMATORS
from .losses import AGGREGATIONS, BOUNDS, KL_ESTIMATORS, PRESETS, RATIOS, STEP_WEIGHTINGS, SURROGATES
from .registry import Registry
from .transforms import TRANSFORMS


class StrictModel(BaseModel):
    """A pydantic model whose unknown keys raise with the list of valid keys."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

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

    model_config = ConfigDict(extra="forbid")
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

    def check(self, registry: Registry) -> "PartSpec":
        registry.get(self.name).check_settings(self.settings, registry.kind)
        return self


class AdvantageConfig(StrictModel):
    """Which estimator turns rewards into advantages, and the transforms applied after it."""

    estimator: PartSpec = Field(default_factory=lambda: PartSpec(name="grpo"))
    transforms: list[PartSpec] = Field(default_factory=list)
    head_nan_policy: Literal["propagate", "ignore_head"] = "propagate"

    @model_validator(mode="after")
    def _check_names(self) -> "AdvantageConfig":
        self.estimator.check(ESTIMATORS)
        for t in self.transforms:
            t.check(TRANSFORMS)
        return self


class KLSpec(StrictModel):
    """KL to the reference policy, added to every action's loss as coef * estimator."""

    estimator: str = "k3"
    coef: float = 0.0


class LossConfig(StrictModel):
    """A policy loss composed from named parts. `preset` fills the parts the user does not set."""

    preset: Optional[str] = None
    ratio: PartSpec = Field(default_factory=lambda: PartSpec(name="token"))
    bounds: PartSpec = Field(default_factory=lambda: PartSpec(name="symmetric"))
    surrogate: PartSpec = Field(default_factory=lambda: PartSpec(name="ppo_clip"))
    aggregation: PartSpec = Field(default_factory=lambda: PartSpec(name="token_mean"))
    step_weighting: PartSpec = Field(default_factory=lambda: PartSpec(name="none"))
    kl: KLSpec = Field(default_factory=KLSpec)
    entropy_coef: float = 0.0
    log_ratio_clamp: float = 20.0

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
        for key in ("ratio", "bounds", "surrogate", "aggregation", "step_weighting", "kl"):
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
        self.ratio.check(RATIOS)
        self.bounds.check(BOUNDS)
        self.surrogate.check(SURROGATES)
        self.aggregation.check(AGGREGATIONS)
        self.step_weighting.check(STEP_WEIGHTINGS)
        KL_ESTIMATORS.get(self.kl.estimator)
        return self
