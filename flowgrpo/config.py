"""Load typed configs: a YAML file, then `key.sub=value` overrides, validated strictly.

Values in overrides are parsed as YAML (`lr=1e-4`, `use_lora=true`, `steps=[1,2]`). Errors name the
key path and, for unknown keys, the valid ones.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable, Mapping, Optional, Type, TypeVar

import copy
import re
import warnings

import yaml
from pydantic import BaseModel, ValidationError

M = TypeVar("M", bound=BaseModel)


class _Loader(yaml.SafeLoader):
    """YAML 1.1 reads `1e-4` as a string; ML configs mean a float."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"^[-+]?(?:\d[\d_]*\.?[\d_]*(?:[eE][-+]?\d+)|\d[\d_]*\.[\d_]*|\.\d[\d_]*(?:[eE][-+]?\d+)?"
        r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"
    ),
    list("-+0123456789."),
)


class ConfigError(ValueError):
    """A config that cannot be used; the message says where and why."""


def parse_yaml(text: str, where: str = "YAML") -> Any:
    """YAML -> Python; a syntax error is a one-line ConfigError with the line and column."""
    try:
        return yaml.load(text, Loader=_Loader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise ConfigError(f"{where}: not valid YAML{at}: {problem}") from None


def read_text_file(path: str | Path, what: str) -> str:
    """A UTF-8 text file; a file in another encoding is a one-line ConfigError naming it and the byte."""
    try:
        return Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ConfigError(
            f"{what}: {path} is not UTF-8 text (byte {err.start}: {err.object[err.start : err.start + 1]!r}); "
            "save it as UTF-8"
        ) from None


def output_dir_problem(path: str | Path) -> Optional[str]:
    """Why `path` cannot be an output folder (it, or a folder above it, is a file), or None."""
    p = Path(path)
    for q in (p, *p.parents):
        if q.exists() and not q.is_dir():
            return f"output_dir '{path}': '{q}' is a file, not a folder"
    return None


def apply_override(data: dict, override: str) -> None:
    """Set `a.b.c=value` in a nested dict, creating levels as needed."""
    if "=" not in override:
        raise ConfigError(f"override '{override}': expected key=value")
    key, raw = override.split("=", 1)
    path = key.strip().split(".")
    if not all(path):
        raise ConfigError(f"override '{override}': empty key segment")
    node = data
    for i, part in enumerate(path[:-1]):
        child = node.setdefault(part, {})
        if isinstance(child, str):  # a part given by name only ("bounds: symmetric") gains settings
            child = node[part] = {"name": child}
        if not isinstance(child, dict):
            raise ConfigError(f"override '{override}': '{'.'.join(path[: i + 1])}' is not a section")
        node = child
    node[path[-1]] = parse_yaml(raw, f"override '{override}'") if raw.strip() else None


def deep_merge(base: dict, update: dict) -> dict:
    """`update` over `base`, merging nested mappings key by key."""
    out = copy.deepcopy(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def read_yaml_config(p: Path, _seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    """A YAML mapping; a top-level `base: other.yaml` (relative to this file) is read first, then this file over it."""
    if not p.is_file():
        raise ConfigError(f"config file not found: {p}")
    if p.resolve() in _seen:
        raise ConfigError(f"{p}: `base` chain loops back to itself")
    loaded = parse_yaml(read_text_file(p, "config"), str(p)) or {}
    if not isinstance(loaded, dict):
        raise ConfigError(f"{p}: expected a mapping at the top level, got {type(loaded).__name__}")
    base = loaded.pop("base", None)
    if base is None:
        return loaded
    return deep_merge(read_yaml_config(p.parent / str(base), (*_seen, p.resolve())), loaded)


def load_config(
    model: Type[M],
    path: Optional[str | Path] = None,
    overrides: Iterable[str] = (),
    defaults: Optional[dict] = None,
    renamed: Mapping[str, str] = {},
) -> M:
    """Build `model` from defaults, then a YAML file, then overrides (each merged key by key). `renamed`: old dotted
    keys -> new ones; a file or an override that uses an old key still loads, with a warning naming the new key."""
    data: dict[str, Any] = deep_merge({}, defaults or {})
    if path is not None:
        data = deep_merge(data, move_renamed_keys(read_yaml_config(Path(path)), renamed))
    for item in overrides:
        apply_override(data, _renamed_override(item, renamed))
    try:
        return model.model_validate(data)
    except ValidationError as err:
        lines = [f"  {'.'.join(str(x) for x in e['loc']) or '(top level)'}: {e['msg']}" for e in err.errors()]
        where = f" ({path})" if path is not None else ""
        raise ConfigError(f"invalid {model.__name__}{where}:\n" + "\n".join(lines)) from None


def _renamed_override(item: str, renamed: Mapping[str, str]) -> str:
    """`old.key=value` -> `new.key=value` (with a warning), so an override of an old name wins over the file's new one."""
    key, sep, value = item.partition("=")
    for old, new in renamed.items():
        if key.strip() == old or key.strip().startswith(old + "."):
            warnings.warn(f"config key '{old}' is now '{new}' (the old name still loads, for now)", FutureWarning,
                          stacklevel=3)  # fmt: skip
            return new + key.strip()[len(old) :] + sep + value
    return item


def move_renamed_keys(data: Any, renamed: Mapping[str, str], warn: bool = True) -> Any:
    """Move each old dotted key of `data` to its new name (`renamed`: old -> new), so that a config or a checkpoint
    written before a rename keeps loading; warns naming the new key. Both names given: a ConfigError."""
    if not isinstance(data, dict):
        return data
    data = copy.deepcopy(data)
    for old, new in renamed.items():
        *old_path, old_leaf = old.split(".")
        parent = data
        for part in old_path:
            parent = parent.get(part) if isinstance(parent, dict) else None
        if not isinstance(parent, dict) or old_leaf not in parent:
            continue
        value = parent.pop(old_leaf)
        *new_path, new_leaf = new.split(".")
        target = data
        for part in new_path:
            target = target.setdefault(part, {})
        if new_leaf in target:
            raise ConfigError(f"config key '{old}' was renamed '{new}': give only '{new}'")
        target[new_leaf] = value
        if warn:
            warnings.warn(f"config key '{old}' is now '{new}' (the old name still loads, for now)", FutureWarning,
                          stacklevel=2)  # fmt: skip
    return data


def dump_config(config: BaseModel, path: str | Path) -> None:
    """Write the resolved config as YAML (what the run actually used)."""
    Path(path).write_text(yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False))
