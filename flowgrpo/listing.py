"""What `flowgrpo list` prints: every registry's entries with their settings and defaults.

SECTIONS is the one table of registries (CLI key, title, module, attribute); `entries` imports only the
sections asked for and yields an `Item` per entry. A registry is read by its shape, not by its name:

- a `flowgrpo.core.registry.Registry` (names / get; an entry's `settings` are its keyword-only parameters);
- a module with `available()` and `get_entry(name)` (reward_models.registry: attribute "");
- a mapping of name -> class (settings: a pydantic model's fields, else its constructors' keyword-only
  parameters) or name -> dict (a loss preset: its settings are the parts it sets).

A class entry with no settings of its own (a method plug-in) takes them from `config`: the field named like
the entry in that pydantic model (`nft` -> T2IConfig.nft), shown as `nft.beta=1.0`.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import inspect
import math
import textwrap
import types
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Optional


@dataclass(frozen=True)
class Section:
    key: str  # the CLI name: `flowgrpo list kernels`
    title: str
    module: str
    attr: str  # "" = the module itself is the registry
    imports: tuple[str, ...] = ()  # modules whose import registers the entries
    config: Optional[tuple[str, str]] = None  # (module, model): settings of class entries without their own

    @property
    def source(self) -> str:
        return f"{self.module}.{self.attr}" if self.attr else self.module


_T2I_CONFIG = ("flowgrpo.t2i.config", "T2IConfig")
_T2I_METHODS = ("flowgrpo.t2i.grpo", "flowgrpo.t2i.nft", "flowgrpo.t2i.adversarial")

SECTIONS: tuple[Section, ...] = (
    Section("estimators", "advantage estimators", "flowgrpo.core.advantages", "ESTIMATORS"),
    Section("transforms", "advantage transforms", "flowgrpo.core.transforms", "TRANSFORMS"),
    Section("ratios", "ratios", "flowgrpo.core.losses", "RATIOS"),
    Section("bounds", "bounds", "flowgrpo.core.losses", "BOUNDS"),
    Section("surrogates", "surrogates", "flowgrpo.core.losses", "SURROGATES"),
    Section("aggregations", "aggregations", "flowgrpo.core.losses", "AGGREGATIONS"),
    Section("kl_estimators", "KL estimators", "flowgrpo.core.losses", "KL_ESTIMATORS"),
    Section("step_weightings", "step weightings", "flowgrpo.core.losses", "STEP_WEIGHTINGS"),
    Section("regularizers", "regularizers", "flowgrpo.core.regularizers", "REGULARIZERS"),
    Section("presets", "loss presets (the parts each sets)", "flowgrpo.core.losses", "PRESETS"),
    Section("recipes", "paper recipes (advantage + loss; text `recipe:`)", "flowgrpo.core.recipes", "RECIPES"),
    Section(
        "prompt_samplers", "prompt samplers (text `prompt_sampling:`)", "flowgrpo.core.prompt_state", "PROMPT_SAMPLERS"
    ),
    Section("kernels", "transition kernels", "pipelines.steps", "KERNELS"),
    Section("plans", "rollout plans", "pipelines.plans", "PLANS"),
    Section("sigma_grids", "sigma grids", "pipelines.schedules", "SIGMA_GRIDS"),
    Section("methods", "image methods", "flowgrpo.t2i.methods", "METHODS", _T2I_METHODS, _T2I_CONFIG),
    Section("wrappers", "image method wrappers", "flowgrpo.t2i.methods", "WRAPPERS", _T2I_METHODS, _T2I_CONFIG),
    Section(
        "text_methods",
        "text methods",
        "flowgrpo.text.methods",
        "METHODS",
        ("flowgrpo.text.grpo", "flowgrpo.text.tppo"),
        ("flowgrpo.text.config", "TextConfig"),
    ),
    Section("text_rewards", "text reward functions", "flowgrpo.text.reward_functions", "REWARDS"),
    Section("scorers", "image scorers", "reward_models.registry", ""),
    Section("families", "model families", "pipelines.adapters", "ADAPTERS"),
)

REQUIRED = inspect.Parameter.empty  # a setting without a default


@dataclass(frozen=True)
class Item:
    section: Section
    name: str
    doc: str  # the first paragraph of its docstring, as one line
    settings: dict[str, Any]  # name -> default (REQUIRED: none)


def section_keys() -> list[str]:
    return [s.key for s in SECTIONS]


def select(keys: Iterable[str]) -> list[Section]:
    """The sections named (all when none, in table order); ValueError names the valid ones."""
    by_key = {s.key: s for s in SECTIONS}
    wanted = [k.replace("-", "_") for k in keys]
    for key in wanted:
        if key not in by_key:
            close = difflib.get_close_matches(key, list(by_key), n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            raise ValueError(f"unknown section '{key}'{hint}; valid sections: {', '.join(by_key)}")
    return [s for s in SECTIONS if not wanted or s.key in wanted]


def entries(sections: Iterable[Section]) -> Iterator[Item]:
    """Import each section's registry (only those asked for) and yield its entries, sorted by name."""
    for section in sections:
        for name in section.imports:
            importlib.import_module(name)
        module = importlib.import_module(section.module)
        registry = getattr(module, section.attr) if section.attr else module
        config = getattr(importlib.import_module(section.config[0]), section.config[1]) if section.config else None
        for name, target, doc, settings in sorted(_read(registry), key=lambda e: e[0]):
            if not settings and inspect.isclass(target):
                settings = class_settings(target)
            if not settings and config is not None:
                settings = _config_section(config, getattr(target, "config_section", name))
            yield Item(section, name, _doc(target) or doc, settings)


def _read(registry: Any) -> Iterator[tuple[str, Any, str, dict[str, Any]]]:
    if hasattr(registry, "names") and hasattr(registry, "get"):  # flowgrpo.core.registry.Registry
        for name in registry.names():
            e = registry.get(name)
            yield name, e.fn, e.doc, e.settings
    elif isinstance(registry, types.ModuleType) and hasattr(registry, "get_entry"):  # reward_models.registry
        for name in registry.available():
            e = registry.get_entry(name)
            yield name, e.factory, e.doc, e.settings
    elif isinstance(registry, Mapping):
        for name, value in registry.items():
            if isinstance(value, Mapping):  # a preset: the parts it sets
                yield name, None, "", dict(value)
            else:
                yield name, value, "", {}
    else:
        raise TypeError(f"cannot list a {type(registry).__name__}")


def _doc(target: Any) -> str:
    """The first paragraph of the docstring, as one line: the object's own (not one inherited from a base
    class), else its module's."""
    if target is None:
        return ""
    own = target.__dict__.get("__doc__") if inspect.isclass(target) else getattr(target, "__doc__", None)
    if not own:
        own = getattr(inspect.getmodule(target), "__doc__", None)
    return " ".join(inspect.cleandoc(own).split("\n\n")[0].split()) if own else ""


def class_settings(cls: type) -> dict[str, Any]:
    """A pydantic model's or dataclass's fields with defaults; else the keyword-only parameters of its
    constructors, following `**kw` up the base classes."""
    fields = getattr(cls, "model_fields", None)
    if isinstance(fields, Mapping):  # pydantic v2
        return {k: REQUIRED if f.is_required() else f.get_default(call_default_factory=True) for k, f in fields.items()}
    out: dict[str, Any] = {}
    if dataclasses.is_dataclass(cls):
        for f in dataclasses.fields(cls):
            if f.default is not dataclasses.MISSING:
                out[f.name] = f.default
            elif f.default_factory is not dataclasses.MISSING:
                out[f.name] = f.default_factory()
            else:
                out[f.name] = REQUIRED
        return out
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None or klass is object:
            continue
        params = inspect.signature(init).parameters.values()
        for p in params:
            if p.kind is inspect.Parameter.KEYWORD_ONLY:
                out.setdefault(p.name, p.default)
        if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
            break
    return out


def _config_section(config: Any, name: str) -> dict[str, Any]:
    field = getattr(config, "model_fields", {}).get(name)
    model = getattr(field, "annotation", None)
    if not (inspect.isclass(model) and hasattr(model, "model_fields")):
        return {}
    return {f"{name}.{k}": v for k, v in class_settings(model).items()}


# --- output ----------------------------------------------------------------------------------------


def _value(v: Any, limit: int = 40) -> str:
    if isinstance(v, Mapping):
        rest = ", ".join(f"{k}={_value(x)}" for k, x in v.items() if k != "name")
        return f"{v['name']}({rest})" if "name" in v else f"({rest})"
    text = repr(v)
    if len(text) <= limit:
        return text
    return repr(v[: limit - 3])[:-1] + "…'" if isinstance(v, str) else text[: limit - 1] + "…"


def _setting_texts(settings: Mapping[str, Any]) -> list[str]:
    return [k + ("=<required>" if v is REQUIRED else f"={_value(v)}") for k, v in settings.items()]


def format_settings(settings: Mapping[str, Any]) -> str:
    return ", ".join(_setting_texts(settings))


def _pack(parts: list[str], width: int, first: str, rest: str) -> list[str]:
    """Comma-separated parts on lines of at most `width` columns, never breaking inside a part."""
    lines, line = [], first
    for i, part in enumerate(parts):
        part += "," if i < len(parts) - 1 else ""
        if line not in (first, rest) and len(line) + 1 + len(part) > width:
            lines.append(line)
            line = rest
        line += part if line in (first, rest) else " " + part
    return [*lines, line]


def _wrap(text: str, width: int, **kw: Any) -> list[str]:
    return textwrap.wrap(text, width, break_on_hyphens=False, break_long_words=False, **kw)


def format_text(items: Iterable[Item], width: int = 120) -> str:
    """Grouped by section: `name  doc` with the settings wrapped under the doc, names aligned per section."""
    groups: dict[str, list[Item]] = {}
    for item in items:
        groups.setdefault(item.section.key, []).append(item)
    lines: list[str] = []
    for group in groups.values():
        section = group[0].section
        lines.append(f"{section.title} [{section.key}] ({section.source}):")
        pad = max(len(i.name) for i in group) + 2
        indent = " " * (2 + pad)
        for item in group:
            shown = format_settings(item.settings)
            text = item.doc or shown
            first, *rest = _wrap(text, width - len(indent)) or [""]
            lines.append(f"  {item.name:<{pad}}{first}".rstrip())
            lines.extend(indent + line for line in rest)
            if item.doc and shown:
                lines.extend(_pack(_setting_texts(item.settings), width, indent + "settings: ", indent))
        lines.append("")
    return "\n".join(lines)


def _json_value(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return repr(v)  # strict JSON has no inf / nan
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, Mapping):
        return {str(k): _json_value(x) for k, x in v.items()}
    if isinstance(v, (list, tuple, set, frozenset)):
        return [_json_value(x) for x in v]
    return repr(v)


def to_json(items: Iterable[Item]) -> dict[str, Any]:
    """{section key: {title, source, entries: [{name, doc, settings: {name: default}, required: [...]}]}}."""
    out: dict[str, Any] = {}
    for item in items:
        section = out.setdefault(
            item.section.key, {"title": item.section.title, "source": item.section.source, "entries": []}
        )
        section["entries"].append(
            {
                "name": item.name,
                "doc": item.doc,
                "settings": {k: None if v is REQUIRED else _json_value(v) for k, v in item.settings.items()},
                "required": [k for k, v in item.settings.items() if v is REQUIRED],
            }
        )
    return out
