"""Reward models for text-to-image RL: scorers by name, pointwise and pairwise, local and remote.

    from reward_models import build_scorer
    scorer = build_scorer({"name": "pickscore", "dtype": "bfloat16"})
    scores = scorer(images, prompts)        # {"pickscore": float32 [B]}, NaN = could not score

Importing this package is light (no torch, no transformers); scorer modules load on first lookup.
"""

import torchvision_cpu_hook  # noqa: F401  (first: torchvision on a CPU torch)
from .registry import ScorerConfig, UnknownScorerError, available, build_scorer, get_entry, register

__all__ = ["ScorerConfig", "UnknownScorerError", "available", "build_scorer", "get_entry", "register"]
