"""Whole recipes: a paper's advantage estimator (with its transforms) and its loss, under one name.

`recipe: NAME` in a text config (flowgrpo.text.config) replaces the config's `advantage.estimator`,
`advantage.transforms` and `loss` with these; key=value overrides still apply on top. `flowgrpo list recipes`
prints them; docs/text_trainer.md names each one's source.
"""

from __future__ import annotations

from typing import Any

from .offpolicy import REC_PRESETS


def _recipe(estimator: dict[str, Any], loss: dict[str, Any], transforms: tuple[Any, ...] = ()) -> dict[str, Any]:
    return {"advantage": {"estimator": estimator, "transforms": list(transforms)}, "loss": loss}


_REC = {"name": "rec", "std_normalize": False}

RECIPES: dict[str, dict[str, Any]] = {
    # Group-relative REINFORCE is secretly off-policy (Trinity-RFT examples/rec_gsm8k): r - mean, no std
    **{name: _recipe(_REC, {"preset": name}) for name in REC_PRESETS},
    "rec_reinforce": _recipe(_REC, {"surrogate": {"name": "rec", "clip_mode": "none"}, "aggregation": "token_mean"}),
    "rec_grpo": _recipe({**_REC, "std_normalize": True}, {"preset": "rec_one_side_is"}),
    "red_drop": _recipe(
        {**_REC, "drop": "balance"}, {"surrogate": {"name": "rec", "clip_mode": "none"}, "aggregation": "token_mean"}
    ),
    # CANON (biuboomc/CANON scripts/setups.sh): entropy halves, lambda 1, clip 0.2 / 0.28, seq-mean-token-sum
    "canon": _recipe({"name": "canon", "metric": "entropy", "lam": 1.0}, {"preset": "canon"}),
    "canon_length": _recipe({"name": "canon", "metric": "length", "lam": 1.0}, {"preset": "canon"}),
    # "Cosin-First-Intra-Later-Inter": the intra weight follows a cosine with restarts, 0.6 -> 0
    "canon_cosine": _recipe({"name": "canon", "schedule": "cosine_restart", "scheduled": "intra"}, {"preset": "canon"}),
    # "Cosin-First-Inter-Later-Intra": the inter weight follows a cosine with restarts, 1 -> 0.4
    "canon_cosine_r": _recipe(
        {"name": "canon", "schedule": "cosine_restart", "scheduled": "inter", "sched_high": 1.0, "sched_low": 0.4},
        {"preset": "canon"},
    ),
    # Stratified GRPO (grpo-composer configs/papers/stratified_grpo.yaml): SAN, clip 0.2, token mean
    "stratified_grpo": _recipe(
        {"name": "stratified_grpo", "stratum_head": "stratum", "alpha": 1.0},
        {"bounds": {"name": "symmetric", "eps": 0.2}, "aggregation": "token_mean"},
    ),
}
