"""A resume keeps the settings it was saved with: a changed setting is refused, in one line naming each key.

A checkpoint's optimizer and schedule would otherwise silently win over the new value (a resumed
`optim.lr=0.001` kept training at the saved 0.03). Each trainer names the top-level keys that may change
(run length, output, ...); `_ALWAYS_FREE` never change what a resumed run computes.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

from ..config import ConfigError

# settings that never change what a resumed run computes
_ALWAYS_FREE = {"resume", "progress", "num_threads", "guards"}
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


def check_resume_config(
    now: Mapping[str, Any],
    saved: Optional[Mapping[str, Any]],
    free: set[str],
    defaults: Optional[Mapping[str, Any]] = None,
) -> None:
    """Refuse (ConfigError, naming each key and both values) a resume whose config differs from the checkpoint's
    outside the top-level keys in `free`: the checkpoint's optimizer and schedule would silently win over the
    new value (a resumed `optim.lr=0.001` kept training at the saved 0.03)."""
    if saved is None:
        return
    diff = _config_diff(dict(now), dict(saved), _MISSING if defaults is None else dict(defaults))
    changed = [d for d in diff if d[0].split(".")[0] not in free | _ALWAYS_FREE]
    if changed:
        show = lambda v: "(unset)" if v is _MISSING else repr(v)  # noqa: E731
        listed = "; ".join(f"{key}: {show(old)} in the checkpoint, {show(new)} now" for key, old, new in changed[:4])
        more = f" (and {len(changed) - 4} more)" if len(changed) > 4 else ""
        raise ConfigError(
            f"resume: {listed}{more}. A resumed run keeps its settings: drop these overrides, or "
            "start a new run (another output_dir)"
        )
