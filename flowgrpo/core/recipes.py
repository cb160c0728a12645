"""Whole recipes: a paper's advantage estimator (with its transforms), its loss and its prompt sampler, under one name.

`recipe: NAME` in a text config (flowgrpo.text.config) replaces the config's `advantage.estimator`,
`advantage.transforms`, `loss` and `prompt_sampling` (uniform unless the recipe names one) with these; key=value overrides still apply on top. `flowgrpo list recipes`
prints them; docs/text_trainer.md names each one's source.
"""

from __future__ import annotations

from typing import Any

from .offpolicy import REC_PRESETS


def _recipe(
    estimator: dict[str, Any], loss: dict[str, Any], transforms: tuple[Any, ...] = (), sampling: Any = None
) -> dict[str, Any]:
    recipe = {"advantage": {"estimator": estimator, "transforms": list(transforms)}, "loss": loss}
    if sampling is not None:
        recipe["prompt_sampling"] = sampling
    return recipe


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
    # SPO (arXiv 2509.13232; spo.py): the Beta value tracker, batch-whitened advantages, prioritised prompts; PPO's
    # clip 0.2 with a token mean (the verl defaults the recipe runs on)
    "spo": _recipe(
        {"name": "spo"}, {"bounds": {"name": "symmetric", "eps": 0.2}, "aggregation": "token_mean"}, sampling="spo"
    ),
    # Prompt Replay (prompt_state.py; abstract only): GRPO with half of each batch re-served from the buffer
    "prompt_replay": _recipe({"name": "grpo"}, {"preset": "dapo"}, sampling={"name": "replay", "fraction": 0.5}),
    # ACE (arXiv 2602.21420; spo.py): GRPO whose negative advantages grow with the policy's confidence over the
    # reference (alpha 1: ours, unverified), on the GRPO loss without KL
    "ace": _recipe({"name": "grpo"}, {"preset": "grpo"}, transforms=({"name": "ace", "alpha": 1.0},)),
}
