"""A resume keeps the settings it was saved with: a changed setting is refused, in one line naming each key.

A checkpoint's optimizer and schedule would otherwise silently win over the new value (a resumed
`optim.lr=0.001` kept training at the saved 0.03). Each trainer names the top-level keys that may change
(run length, output, ...); `_ALWAYS_FREE` never change what a resumed run computes. A free key is a top-level
key or a dotted path ("model.context_parallel"): everything under it may change.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

from ..config import ConfigError

# settings that never change what a resumed run computes. `model.context_parallel` is the launch's layout, as the
# world size is (its degree must divide the world size, so a resume on other ranks must change it): the ranks of
# a group split a sample's tokens, the result is the same to float32 reduction order (as FSDP2's sharding)
_ALWAYS_FREE = {"resume", "progress", "num_threads", "guards", "model.context_parallel"}
_MISSING = object()


def _config_diff(now: Any, saved: Any, default: Any = _MISSING, path: str = "") -> list[tuple[str, Any, Any]]:
    """(dotted key, saved value, new value) for every leaf that differs. A key the checkpoint lacks (a setting
    added since it was saved) is no change where the new value is that setting's default."""
    if saved is _MISSING and default is not _MISSING and now == default:
        return []
    if isinstance(now, Mapping) and isinstance(saved, Mapping):
        out = []
        defaults = default if isinstance(default, Mapping) else {}
        for k in sorted(set(now) | set(saved)):
            key = f"{path}.{k}" if path else str(k)
            out += _config_diff(now.get(k, _MISSING), saved.get(k, _MISSING), defaults.get(k, _MISSING), key)
        return out
    return [] if now == saved else [(path, saved, now)]


def _is_free(key: str, free: set[str]) -> bool:
    """Whether the dotted `key` or a path above it is in `free`."""
    parts = key.split(".")
    return any(".".join(parts[:n]) in free for n in range(1, len(parts) + 1))


def check_resume_config(
    now: Mapping[str, Any],
    saved: Optional[Mapping[str, Any]],
    free: set[str],
    defaults: Optional[Mapping[str, Any]] = None,
) -> None:
    """Refuse (ConfigError, naming each key and both values) a resume whose config differs from the checkpoint's
    outside the keys in `free` (top-level or dotted paths) and `_ALWAYS_FREE`: the checkpoint's optimizer and schedule would silently win over the
    new value (a resumed `optim.lr=0.001` kept training at the saved 0.03)."""
    if saved is None:
        return
    diff = _config_diff(dict(now), dict(saved), _MISSING if defaults is None else dict(defaults))
    free = free | _ALWAYS_FREE
    changed = [d for d in diff if not _is_free(d[0], free)]
    if changed:
        show = lambda v: "(unset)" if v is _MISSING else repr(v)  # noqa: E731
        listed = "; ".join(f"{key}: {show(old)} in the checkpoint, {show(new)} now" for key, old, new in changed[:4])
        more = f" (and {len(changed) - 4} more)" if len(changed) > 4 else ""
        raise ConfigError(
            f"resume: {listed}{more}. A resumed run keeps its settings: drop these overrides, or "
            "start a new run (another output_dir)"
        )
