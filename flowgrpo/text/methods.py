"""The text trainer's method plug-ins: their registry and what they receive (never the trainer).

`method: grpo` (flowgrpo/text/grpo.py: advantages, old / reference log-probs, the clipped token-level update)
is the one entry today; a new text method is a plug-in registered here plus a config, as on the image side.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..core.registry import Registry
from ..run.method import MethodContext

METHODS = Registry("text method")


@dataclass(frozen=True)
class TextContext(MethodContext):
    """What a text method may use besides the shared context."""

    model: Any = None  # the policy (transformers / peft model)
    rewards: Any = None  # the configured reward functions (flowgrpo.text.reward_functions), in config order
    device: Any = None  # where the policy's forward runs
    prompt_state: Any = None  # the run's per-prompt state (flowgrpo.core.prompt_state.PromptTable), if a part reads it
    tokenizer: Any = None  # the policy's tokenizer
    data: Any = None  # the run's prompts (flowgrpo.text.data.load_prompts: rows with their gold answers)


def build_method(ctx: TextContext) -> Any:
    return METHODS.get(ctx.cfg.method).fn(ctx)


def method_class(name: str) -> Any:
    return METHODS.get(name).fn
