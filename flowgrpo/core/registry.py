"""Named registries for estimators and loss parts.

Every entry is a plain function. Its keyword-only parameters are its *settings* (what a config may
set); `requires` names the optional inputs it reads, so a missing input is reported before any
work is done. An estimator declares once, here, which rewards it reads (`reads`, one of READS; the rollout
plan that produces them follows from it) and whether its per-step rewards end with the final sample's
(`final_reward_step`): the trainers' config checks and credit assignment dispatch on `reads` alone.
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


# What an estimator reads -> the rollout plan whose rewards those are (None: the final samples of any plan)
READS: dict[str, Optional[str]] = {
    "final": None,  # each final sample's reward (one advantage per sample)
    "preferences": None,  # pairwise preferences among a group's final samples
    "step_rewards": "probes",  # rewards of probe completions along each chain (one advantage per step)
    "siblings": "branch_points",  # completed rewards of the side children of each branch point
    "tree": "tree",  # leaf rewards fused up a rollout tree (one advantage per node)
}


@dataclass(frozen=True)
class Entry:
    name: str
    fn: Callable[..., Any]
    requires: frozenset[str] = field(default_factory=frozenset)
    doc: str = ""
    reads: str = "final"  # estimators: which rewards (a key of READS)
    final_reward_step: bool = False  # per-step rewards end with the final sample's reward

    @property
    def plan(self) -> Optional[str]:
        """The rollout plan whose rewards the estimator reads (None: any plan's final samples)."""
        return READS[self.reads]

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
        self, name: str, *, requires: Iterable[str] = (), reads: str = "final", final_reward_step: bool = False
    ) -> Callable[[F], F]:
        if reads not in READS:
            raise ValueError(f"{self.kind} '{name}': reads must be one of {sorted(READS)}, got {reads!r}")

        def decorate(fn: F) -> F:
            if name in self._entries:
                raise ValueError(f"{self.kind} '{name}' is already registered")
            doc = inspect.getdoc(fn) or ""
            self._entries[name] = Entry(name, fn, frozenset(requires), doc.split("\n")[0], reads, final_reward_step)
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
