"""Every field of every config model is read by some code: a field nothing reads is a setting that silently
does nothing. Walks the pydantic models reachable from the image and text trainers' configs (and the
evaluation and core demo configs) and looks for a read of each field in the package sources: an attribute access
`.field`, or the name as a string key (`"field"`, for getattr / dumped dicts)."""

from __future__ import annotations

import re
import typing
from pathlib import Path

import pytest
from pydantic import BaseModel

from flowgrpo.demo import DemoConfig
from flowgrpo.evaluation.config import EvalConfig as EvaluationConfig
from flowgrpo.t2i.config import T2IConfig
from flowgrpo.text.config import TextConfig

ROOT = Path(__file__).resolve().parents[1]
SOURCES = [p for d in ("flowgrpo", "pipelines", "reward_models") for p in (ROOT / d).rglob("*.py")]

# Fields read only by generic code that no search can see; each says who reads it.
ALLOWED: dict[str, str] = {}


def _models(root: type[BaseModel]) -> dict[str, type[BaseModel]]:
    """Every BaseModel class reachable from `root` through field annotations (lists, optionals, unions)."""
    seen: dict[str, type[BaseModel]] = {}
    todo: list[typing.Any] = [root]
    while todo:
        t = todo.pop()
        if isinstance(t, type) and issubclass(t, BaseModel):
            key = f"{t.__module__}.{t.__qualname__}"
            if key in seen:
                continue
            seen[key] = t
            todo.extend(f.annotation for f in t.model_fields.values())
        else:
            todo.extend(typing.get_args(t))
    return seen


def _source_without_declarations() -> str:
    """All package sources with field declaration lines (`name: type = ...` in a class body) removed."""
    declaration = re.compile(r"^\s+\w+\s*:\s*[^=]+?(=.*)?$")
    lines = []
    for path in SOURCES:
        for line in path.read_text().splitlines():
            if not declaration.match(line.split("#", 1)[0].rstrip()):
                lines.append(line)
    return "\n".join(lines)


SOURCE = _source_without_declarations()
FIELDS = sorted(
    {
        (name, field)
        for root in (T2IConfig, TextConfig, EvaluationConfig, DemoConfig)
        for name, model in _models(root).items()
        for field in model.model_fields
    }
)


@pytest.mark.parametrize("model,field", FIELDS, ids=[f"{m.split('.', 1)[-1]}.{f}" for m, f in FIELDS])
def test_every_config_field_is_read(model, field):
    if f"{model.rsplit('.', 1)[-1]}.{field}" in ALLOWED:
        return
    read = re.search(rf"\.{field}\b|[\"']{field}[\"']", SOURCE)
    assert read, (
        f"{model}.{field}: no code reads this config field (read it, remove it, or allow-list it with a reason)"
    )


def test_the_walk_finds_the_nested_models():
    names = {k.rsplit(".", 1)[-1] for k in (*_models(T2IConfig), *_models(TextConfig))}
    assert {
        "T2IConfig",
        "TextConfig",
        "OptimConfig",
        "CheckpointConfig",
        "NFTConfig",
        "ImageLoraConfig",
        "TextLoraConfig",
        "UpdateConfig",
        "TextUpdateConfig",
        "SamplerConfig",
        "AdvantageConfig",
        "LossConfig",
        "PartSpec",
        "KLSpec",
    } <= names
