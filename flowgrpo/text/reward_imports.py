"""User reward functions named by an import path: `package.module:function` or `path/to/file.py:function`.

A relative `file.py` is looked for beside the config file whose `rewards:` is in force (the first of its `base:`
chain that sets them; `flowgrpo train-text` says which through `reward_files_relative_to`), then in the working
directory; a file in neither is one line naming both places. An import that fails is one line too.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import sys
from pathlib import Path
from typing import Callable, Optional

# where a relative `file.py:function` is looked for first: beside the config file that names the rewards
# (set by `flowgrpo train-text` through reward_files_relative_to); then the working directory
_CONFIG_DIR: Optional[Path] = None


def rewards_config_dir(config: str | Path) -> Path:
    """The folder of the config file whose `rewards:` is in force: the first file of the `base:` chain (from the
    named file down) that sets `rewards` (a list replaces, it does not merge); the named file's folder if none."""
    from ..config import parse_yaml, read_text_file

    path, seen = Path(config), set()
    while path.is_file() and path.resolve() not in seen:
        seen.add(path.resolve())
        try:
            data = parse_yaml(read_text_file(path, "config"), str(path)) or {}
        except ValueError:
            break
        if not isinstance(data, dict) or "rewards" in data or data.get("base") is None:
            return (path.parent if isinstance(data, dict) and "rewards" in data else Path(config).parent).resolve()
        path = path.parent / str(data["base"])
    return Path(config).parent.resolve()


def reward_files_relative_to(config: Optional[str | Path]) -> None:
    """Resolve relative `file.py:function` rewards beside `config` (see rewards_config_dir) before the working
    directory; None: the working directory only."""
    global _CONFIG_DIR
    _CONFIG_DIR = None if config is None else rewards_config_dir(config).resolve()


def _reward_file(ref: str, target: str) -> Path:
    path = Path(target).expanduser()
    if path.is_absolute():
        if not path.is_file():
            raise ValueError(f"reward '{ref}': file not found: {path}")
        return path
    places = ([("beside the config that names it", _CONFIG_DIR / path)] if _CONFIG_DIR is not None else []) + [
        ("in the working directory", Path.cwd() / path)
    ]
    for _, candidate in places:
        if candidate.is_file():
            return candidate
    looked = " and ".join(f"{where} ({candidate})" for where, candidate in places)
    raise ValueError(f"reward '{ref}': file not found: {target}; looked {looked}")


def import_callable(ref: str) -> Callable:
    """`package.module:function` or `path/to/file.py:function` (a relative file: see _reward_file)."""
    target, _, attr = ref.rpartition(":")
    if not target or not attr:
        raise ValueError(f"reward '{ref}': expected a registered name, 'module:function' or 'file.py:function'")
    if target.endswith(".py"):
        path = _reward_file(ref, target)
        mod_name = f"flowgrpo_user_rewards_{abs(hash(str(path.resolve())))}"
        spec = importlib.util.spec_from_file_location(mod_name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[mod_name] = module
        try:
            spec.loader.exec_module(module)
        except Exception as err:  # the user's file fails on import: name it and the reason, in one line
            del sys.modules[mod_name]
            raise ValueError(f"reward '{ref}': importing {path} failed: {type(err).__name__}: {err}") from None
    else:
        try:
            module = importlib.import_module(target)
        except Exception as err:
            raise ValueError(f"reward '{ref}': cannot import {target}: {type(err).__name__}: {err}") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"reward '{ref}': {target} has no callable '{attr}'")
    return fn


def keyword_parameters(fn: Callable) -> Optional[list[str]]:
    """The names a function takes as keywords; None when it takes **kwargs (or cannot be inspected)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return None
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None
    return [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
