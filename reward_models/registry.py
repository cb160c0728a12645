"""Scorers by name.

An entry is a factory whose keyword-only parameters are its settings (what a config may set), so
an unknown setting is an error rather than silently ignored. Settings that several scorers share
(HttpSettings, BackboneSettings, ...) are dataclasses that with_settings lists among a factory's own. Duplicate names raise; an unknown name
gets the valid names and the closest match. Built-in scorer modules are imported on the first
lookup, which keeps `import reward_models` free of torch and transformers.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import importlib
import inspect
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping

# Modules whose import registers the built-in scorers.
_BUILTIN_MODULES = (
    "reward_models.toy",
    "reward_models.jpeg",
    "reward_models.clip_scores",
    "reward_models.aesthetic",
    "reward_models.similarity",
    "reward_models.pairwise",
    "reward_models.multi",
    "reward_models.remote",
    "reward_models.hpsv2",
    "reward_models.imagereward",
    "reward_models.prompt_echo",
    "reward_models.ocr",
    "reward_models.vlm_judge",
    "reward_models.geneval",
    "reward_models.adversarial",
)
KINDS = ("pointwise", "pairwise")


class UnknownScorerError(KeyError):
    """A lookup with a name that is not registered."""

    def __str__(self) -> str:  # KeyError would quote the whole message
        return str(self.args[0])


@dataclass(frozen=True)
class Entry:
    name: str
    factory: Callable[..., Any]
    kind: str
    doc: str = ""

    @property
    def settings(self) -> dict[str, Any]:
        """Keyword-only parameters and their defaults (inspect.Parameter.empty = required)."""
        params = inspect.signature(self.factory).parameters.values()
        return {p.name: p.default for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY}


@dataclass
class ScorerConfig:
    """A scorer by name plus its settings, e.g. ScorerConfig("pickscore", {"dtype": "bfloat16"})."""

    name: str
    settings: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def parse(cls, config: "str | Mapping[str, Any] | ScorerConfig") -> "ScorerConfig":
        """Accepts a name, a ScorerConfig, or a flat mapping {"name": ..., **settings}."""
        if isinstance(config, ScorerConfig):
            return config
        if isinstance(config, str):
            return cls(config)
        if isinstance(config, Mapping):
            if "name" not in config:
                raise ValueError(f"scorer config needs a 'name', got keys {sorted(config)}")
            rest = {k: v for k, v in config.items() if k != "name"}
            return cls(str(config["name"]), rest)
        raise TypeError(f"scorer config must be a name, a mapping or a ScorerConfig, got {type(config).__name__}")


_ENTRIES: dict[str, Entry] = {}
_builtins_loaded = False


def register(name: str, *, kind: str = "pointwise") -> Callable:
    """Decorator: register a factory (function or class) under `name`."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")

    def decorate(factory: Callable) -> Callable:
        if name in _ENTRIES:
            raise ValueError(f"scorer '{name}' is already registered")
        doc = (inspect.getdoc(factory) or "").split("\n")[0]
        _ENTRIES[name] = Entry(name, factory, kind, doc)
        return factory

    return decorate


def with_settings(*sections: type, **defaults: Any) -> Callable:
    """Factory decorator: the fields of the dataclasses `sections` (e.g. HttpSettings) become keyword-only
    settings of the factory, set flat in a config entry like its own, and reach its **kwargs; `defaults`
    override the sections' defaults for this factory. The factory is called with every setting, defaults
    included."""

    def decorate(factory: Callable) -> Callable:
        signature = inspect.signature(factory)
        own = [p for p in signature.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
        taken = {p.name for p in own}
        overrides, added = dict(defaults), []
        for f in (f for section in sections for f in dataclasses.fields(section)):
            if f.name in taken:
                raise ValueError(f"{factory.__name__}: setting '{f.name}' is given twice")
            taken.add(f.name)
            default = overrides.pop(f.name, f.default)
            default = inspect.Parameter.empty if default is dataclasses.MISSING else default
            added.append(inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=default))
        if overrides:
            raise ValueError(f"{factory.__name__}: defaults {sorted(overrides)} name no section field")
        full = signature.replace(parameters=added + own)

        @functools.wraps(factory)
        def build(**settings: Any):
            bound = full.bind(**settings)
            bound.apply_defaults()
            return factory(**bound.arguments)

        build.__signature__ = full
        return build

    return decorate


def unregister(name: str) -> None:
    """Remove an entry (for tests and plugins that re-register)."""
    _ENTRIES.pop(name, None)


def _load_builtins() -> None:
    global _builtins_loaded
    if not _builtins_loaded:
        _builtins_loaded = True
        for module in _BUILTIN_MODULES:
            importlib.import_module(module)


def _suggest(name: str, choices: Iterable[str]) -> str:
    close = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.5)
    return f" (did you mean '{close[0]}'?)" if close else ""


def get_entry(name: str) -> Entry:
    _load_builtins()
    try:
        return _ENTRIES[name]
    except KeyError:
        raise UnknownScorerError(
            f"unknown scorer '{name}'{_suggest(name, _ENTRIES)}; valid names: {sorted(_ENTRIES)}"
        ) from None


def available(kind: str | None = None) -> list[str]:
    """Registered names, optionally only one kind."""
    _load_builtins()
    return sorted(n for n, e in _ENTRIES.items() if kind is None or e.kind == kind)


def build_scorer(config: "str | Mapping[str, Any] | ScorerConfig", **overrides: Any):
    """Build a scorer from a config; `overrides` win over the config's settings."""
    cfg = ScorerConfig.parse(config)
    entry = get_entry(cfg.name)
    settings = {**cfg.settings, **overrides}
    valid = entry.settings
    for key in settings:
        if key not in valid:
            raise ValueError(
                f"scorer '{cfg.name}' has no setting '{key}'{_suggest(key, valid)}; valid settings: {sorted(valid)}"
            )
    missing = [k for k, v in valid.items() if v is inspect.Parameter.empty and k not in settings]
    if missing:
        raise ValueError(f"scorer '{cfg.name}' needs setting(s) {missing}")
    return entry.factory(**settings)
