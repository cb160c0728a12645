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


# A config file is a few KiB; this bounds what a wrong path (a checkpoint, a dataset) makes the loader read.
MAX_CONFIG_BYTES = 4 * 2**20
MAX_NESTING = 64  # mappings / lists inside each other (a config needs a handful)


class _Refused(yaml.YAMLError):
    """YAML that parses but is not a plain config (a duplicate key, an alias, a tag): the message says where."""


class _Loader(yaml.SafeLoader):
    """Plain YAML only: mappings, lists and scalars (block or flow style).

    YAML 1.1 reads `1e-4` as a string; ML configs mean a float. A key given twice in one mapping is refused (the
    second would silently replace the first), and so are anchors / aliases / merge keys (`&a`, `*a`, `<<`: a few
    lines can expand to gigabytes, the 'billion laughs') and explicit tags (`!!python/...`, `!custom`).
    """

    _depth = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        event = self.peek_event()
        line = event.start_mark.line + 1
        if isinstance(event, yaml.AliasEvent):
            raise _Refused(f"alias '*{event.anchor}' at line {line}: anchors and aliases are not supported in a "
                           "config (write the value out, or share a file through `base:`)")  # fmt: skip
        if event.anchor is not None:
            raise _Refused(f"anchor '&{event.anchor}' at line {line}: anchors and aliases are not supported in a "
                           "config (write the value out, or share a file through `base:`)")  # fmt: skip
        tag = getattr(event, "tag", None)
        if tag is not None:
            raise _Refused(f"tag '{tag}' at line {line}: YAML tags are not supported in a config (plain values only)")
        if self._depth >= MAX_NESTING:
            raise _Refused(f"nesting deeper than {MAX_NESTING} levels at line {line}")
        self._depth += 1
        try:
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_mapping(self, node: Any, deep: bool = False) -> Any:
        if isinstance(node, yaml.MappingNode):
            first: dict[Any, Any] = {}
            for key_node, _ in node.value:
                line = key_node.start_mark.line + 1
                if key_node.tag == "tag:yaml.org,2002:merge":
                    raise _Refused(f"merge key '<<' at line {line}: merge keys are not supported in a config")
                key = self.construct_object(key_node, deep=True)
                try:
                    earlier = first.setdefault(key, key_node)
                except TypeError:  # an unhashable key: the constructor says so
                    break
                if earlier is not key_node:
                    raise _Refused(
                        f"duplicate key '{key}' at line {line} (first at line {earlier.start_mark.line + 1}): "
                        "the second would silently replace the first; keep one"
                    )
        return super().construct_mapping(node, deep=deep)


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


class SettingError(ValueError):
    """A bad value at `key`, a dotted path below the model whose validator raised it (`estimator.eps` in the
    advantage section): `load_config` prefixes the section, so the line names the whole key."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(f"{key}: {message}" if key else message)
        self.key, self.message = key, message


def parse_yaml(text: str, where: str = "YAML") -> Any:
    """YAML -> Python; a syntax error, a duplicate key or YAML beyond plain values (anchors, aliases, merge keys,
    tags) is a one-line ConfigError naming `where` and the line."""
    if len(text) > MAX_CONFIG_BYTES:
        raise ConfigError(f"{where}: {len(text)} characters; a config is at most {MAX_CONFIG_BYTES // 2**20} MiB")
    try:
        return yaml.load(text, Loader=_Loader)  # noqa: S506 - a SafeLoader subclass
    except _Refused as err:
        raise ConfigError(f"{where}: {err}") from None
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
    if (size := p.stat().st_size) > MAX_CONFIG_BYTES:
        raise ConfigError(
            f"{p}: {size} bytes; a config file is at most {MAX_CONFIG_BYTES // 2**20} MiB (is this the right file?)"
        )
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
        where = f" ({path})" if path is not None else ""
        raise ConfigError(f"invalid {model.__name__}{where}:\n" + "\n".join(map(_error_line, err.errors()))) from None


def _error_line(e: Any) -> str:
    """One pydantic error as `  dotted.key: message` (a SettingError's key is added to the error's location)."""
    loc = [str(x) for x in e["loc"]]
    cause = (e.get("ctx") or {}).get("error")
    if isinstance(cause, SettingError):
        return f"  {'.'.join(loc + [cause.key] if cause.key else loc) or '(top level)'}: {cause.message}"
    return f"  {'.'.join(loc) or '(top level)'}: {e['msg']}"


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
