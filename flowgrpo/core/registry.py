"""Named registries for estimators and loss parts.

Every entry is a plain function. Its keyword-only parameters are its *settings* (what a config may
set); `requires` names the optional inputs it reads, so a missing input is reported before any
work is done. An estimator that reads rewards only one rollout plan produces says so once here
(`plan`, `final_reward_step`): the trainers' config checks and credit assignment read it from the entry.
Duplicate names raise; a typo gets the valid names and the closest match.
"""

from __future__ import annotations

import difflib
import functools
import inspect
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Optional, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


class UnknownNameError(ValueError):
    """A registry lookup with a name that is not registered."""


@dataclass(frozen=True)
class Entry:
    name: str
    fn: Callable[..., Any]
    requires: frozenset[str] = field(default_factory=frozenset)
    doc: str = ""
    plan: Optional[str] = None  # the rollout plan whose rewards it reads (None: any plan's final rewards)
    final_reward_step: bool = False  # per-step rewards end with the final sample's reward

    @property
    def settings(self) -> dict[str, Any]:
        """Keyword-only parameters and their defaults: what a config may set."""
        return dict(self._settings)

    @functools.cached_property
    def _settings(self) -> dict[str, Any]:
        # read once: check_settings runs on every sampler step, and inspect.signature is slow
        sig = inspect.signature(self.fn)
        return {p.name: p.default for p in sig.parameters.values() if p.kind is inspect.Parameter.KEYWORD_ONLY}

    def check_settings(self, settings: Mapping[str, Any], where: str) -> None:
        valid = self._settings
        for key in settings:
            if key not in valid:
                raise ValueError(
                    f"{where} '{self.name}' has no setting '{key}'"
                    f"{_suggest(key, valid)}; valid settings: {sorted(valid) or 'none'}"
                )


def _suggest(name: str, choices: Iterable[str]) -> str:
    close = difflib.get_close_matches(name, list(choices), n=1)
    return f" (did you mean '{close[0]}'?)" if close else ""


class Registry:
    """A name -> function table for one slot (advantage estimators, ratio functions, ...)."""

    def __init__(self, kind: str):
        self.kind = kind
        self._entries: dict[str, Entry] = {}

    def register(
        self, name: str, *, requires: Iterable[str] = (), plan: Optional[str] = None, final_reward_step: bool = False
    ) -> Callable[[F], F]:
        def decorate(fn: F) -> F:
            if name in self._entries:
                raise ValueError(f"{self.kind} '{name}' is already registered")
            doc = inspect.getdoc(fn) or ""
            self._entries[name] = Entry(name, fn, frozenset(requires), doc.split("\n")[0], plan, final_reward_step)
            return fn

        return decorate

    def get(self, name: str) -> Entry:
        try:
            return self._entries[name]
        except KeyError:
            raise UnknownNameError(
                f"unknown {self.kind} '{name}'{_suggest(name, self._entries)}; valid names: {sorted(self._entries)}"
            ) from None

    def names(self) -> list[str]:
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def describe(self) -> dict[str, str]:
        return {n: e.doc for n, e in sorted(self._entries.items())}
