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
import os
from dataclasses import dataclass, field
from pathlib import Path
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
    "reward_models.edit_scores",
    "reward_models.edit_judge",
    "reward_models.geneval",
    "reward_models.adversarial",
    "reward_models.video",
    "reward_models.video_judge",
)
KINDS = ("pointwise", "pairwise")


class ScorerWeightsError(FileNotFoundError, ValueError):
    """A scorer's weights cannot be found: the one-line message names the scorer, the hub id or local path, and
    what to do (download them, allow downloads, or point `model:` at a local folder). A FileNotFoundError (what
    transformers and the hub raise for it) and a ValueError (a config that cannot be used: the trainers and
    `flowgrpo evaluate` answer it in one line, exit 2)."""


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


# Keys a trainer's reward entry takes beside the scorer's own settings (`rewards: [{name, weight, alias, ...}]`);
# named in the message for a misspelt setting, since that is where users type them.
ENTRY_KEYS = ("weight", "alias")


def build_scorer(config: "str | Mapping[str, Any] | ScorerConfig", **overrides: Any):
    """Build a scorer from a config; `overrides` win over the config's settings. Weights that cannot be found (not
    in the hub cache offline, no such local folder, no such hub repo) raise ScorerWeightsError, a ValueError whose
    one-line message names the scorer, the hub id or path and what to do."""
    cfg = ScorerConfig.parse(config)
    entry = get_entry(cfg.name)
    settings = {**cfg.settings, **overrides}
    valid = entry.settings
    for key in settings:
        if key not in valid:
            raise ValueError(
                f"scorer '{cfg.name}' has no setting '{key}'{_suggest(key, [*valid, *ENTRY_KEYS])}; valid settings: "
                f"{sorted(valid)} (a trainer's reward entry also takes {', '.join(map(repr, ENTRY_KEYS))})"
            )
    missing = [k for k, v in valid.items() if v is inspect.Parameter.empty and k not in settings]
    if missing:
        raise ValueError(f"scorer '{cfg.name}' needs setting(s) {missing}")
    if not settings.get("tiny"):
        if problem := _missing_local_path(cfg.name, settings, valid):
            raise ScorerWeightsError(problem)
    try:
        return entry.factory(**settings)
    except ScorerWeightsError:
        raise  # a nested scorer's (multi, pointwise_as_pairwise): it names itself
    except Exception as err:
        problem = _hub_problem(cfg.name, {**valid, **settings}, err)
        if problem is None:
            raise
        raise ScorerWeightsError(problem) from err


# --- weights that cannot be found -----------------------------------------------------------------------------

# settings that name weights (a local path or a hub id), in the order they are named in a message
_WEIGHT_SETTINGS = ("model", "processor", "tokenizer", "head")


def _looks_like_path(value: str) -> bool:
    """A value no hub id can be: absolute, ./ ../ ~, or more than one '/' (a hub id is 'name' or 'owner/name')."""
    return value.startswith(("/", ".", "~", "\\")) or value.count("/") > 1 or "\\" in value


def _missing_local_path(name: str, settings: Mapping[str, Any], valid: Mapping[str, Any]) -> str | None:
    """A weight setting given as a local path that does not exist (checked before anything loads)."""
    for key in _WEIGHT_SETTINGS:
        value = settings.get(key)
        if not isinstance(value, str) or not _looks_like_path(value) or Path(value).expanduser().exists():
            continue
        default = valid.get(key)
        hint = f", or a hub id such as its default '{default}'" if isinstance(default, str) else ""
        return (
            f"{name}: `{key}: {value}` is a local path that does not exist (resolved: "
            f"{Path(value).expanduser().resolve()}); point `{key}:` at the folder or file holding the weights{hint}"
        )
    return None


def _error_chain(err: BaseException) -> list[BaseException]:
    chain: list[BaseException] = []
    while err is not None and err not in chain:
        chain.append(err)
        err = err.__cause__ or err.__context__  # type: ignore[assignment]
    return chain


def _hub_ids(settings: Mapping[str, Any]) -> list[tuple[str, str]]:
    """(setting, hub id) of the weight settings that are not local paths."""
    out = []
    for key in _WEIGHT_SETTINGS:
        value = settings.get(key)
        if isinstance(value, str) and value and not _looks_like_path(value) and not Path(value).exists():
            out.append((key, value))
    return out


def _hub_problem(name: str, settings: Mapping[str, Any], err: BaseException) -> str | None:
    """One line for a failure to find weights on the hub or in its cache; None for any other error."""
    try:
        from huggingface_hub import errors as hub
    except ImportError:  # pragma: no cover - huggingface_hub comes with transformers
        return None
    chain = _error_chain(err)
    kinds = [e for e in chain if isinstance(e, (hub.LocalEntryNotFoundError, hub.OfflineModeIsEnabled))]
    gated = [e for e in chain if isinstance(e, hub.GatedRepoError)]
    no_repo = [e for e in chain if isinstance(e, (hub.RepositoryNotFoundError, hub.HFValidationError))]
    offline_text = any("couldn't connect to" in str(e) or "offline mode" in str(e).lower() for e in chain)
    ids = _hub_ids(settings)
    if not ids or not (kinds or gated or no_repo or offline_text):
        return None
    ids = [(k, v) for k, v in ids if any(v in str(e) for e in chain)] or ids  # the one the error names, if it does
    named = " and ".join(f"`{key}: {value}`" for key, value in ids)
    are = "are" if len(ids) > 1 else "is"
    first = ids[0][1]
    where = f"point `{ids[0][0]}:` at a local folder that holds them"
    if gated:
        return (
            f"{name} weights: the hub repo of {named} is gated: accept its terms on the hub, log in once "
            f"(`hf auth login`) and download it (`hf download {first}`), or {where}"
        )
    if no_repo and not kinds:
        return (
            f"{name} weights not found: {named} {are} neither a local folder nor a hub repo that can be read "
            f"(misspelt, or private: `hf auth login`); {where}"
        )
    offline = os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")
    offline = offline or os.environ.get("TRANSFORMERS_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")
    why = (
        "HF_HUB_OFFLINE=1 forbids downloading them"
        if offline
        else "they could not be downloaded (no connection to the hub?)"
    )
    fix = "download them once (" + "; ".join(f"`hf download {value}`" for _, value in ids) + ")"
    fix += ", run with HF_HUB_OFFLINE=0 so they download on first use" if offline else ""
    return f"{name} weights not found: {named} {are} not in the local hub cache and {why}; {fix}, or {where}"
