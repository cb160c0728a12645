"""Whole recipes: a paper's advantage estimator (with its transforms), its loss and its prompt sampler, under one name.

`recipe: NAME` in a text config (flowgrpo.text.config) replaces the config's `advantage.estimator`,
`advantage.transforms`, `loss` and `prompt_sampling` (uniform unless the recipe names one) with these; key=value overrides still apply on top. `flowgrpo list recipes`
prints them; docs/text_trainer.md names each one's source.
"""

from __future__ import annotations

from typing import Any

from .offpolicy import REC_PRESETS
from . import egae, knapsack, spae  # noqa: F401  (register egae, spae and the knapsack prompt sampler)


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
    # REAL (Red-RL/REAL scripts/train/1.5b_real.sh; real.py): rewards as labels, the group classification loss at
    # tau 0.5, summed per sequence over the sequence count
    "real": _recipe(
        {"name": "real"}, {"surrogate": {"name": "real", "tau": 0.5}, "aggregation": "seq_mean_token_mean"}
    ),
    # ETR (arXiv 2601.03723, paper only; etr.py): GRPO (biased std, so the bounds can read each group's pass-rate
    # variance from A) with elastic bounds around eps 0.2; the widening functions are ours
    "etr": _recipe(
        {"name": "grpo", "unbiased": False}, {"bounds": {"name": "etr"}, "aggregation": "seq_mean_token_mean"}
    ),
    # ROVER (yuxiaooye/ROVER Math/scripts/deepscaler/train/rover_qwen3_8b.sh; rover.py): GRPO-normalised centred
    # reward as the target of the relative log-prob, squared error, token mean, rover_t 1
    "rover": _recipe({"name": "rover", "std_normalize": True}, {"surrogate": "rover", "aggregation": "token_mean"}),
    # THR (arXiv 2510.03669, paper only; thr.py): the GRPO loss (clip 0.2) with each group's dominant tokens (|s| over
    # NTHR's anchor threshold, beta 1; s a proxy of the influence) reweighted by 1 + 0.1 sign(THR), exploitation
    # (p ours: the paper's values were not recovered)
    "thr": _recipe(
        {"name": "grpo"},
        {
            "bounds": {"name": "symmetric", "eps": 0.2},
            "aggregation": "seq_mean_token_mean",
            "step_weighting": {"name": "thr", "p": 0.1, "select": "tau", "beta": 1.0},
        },
    ),
    # Knapsack RL (arXiv 2509.25849, paper only; knapsack.py): GRPO on ragged groups, each prompt's rollouts from a
    # knapsack over the prompts' learning value, 2..32 per prompt (bounds ours), the DAPO loss (ours)
    "knapsack": _recipe({"name": "grpo"}, {"preset": "dapo"}, sampling={"name": "knapsack", "low": 2, "high": 32}),
    # SPAE (cii030/SPAE-RL README @ 98b2f46, probe example @ 1f8c839; spae.py): per-step advantages from the
    # teacher-forced probes (text/step_probe.py) at the source's ".\n\n" steps; the DAPO loss (ours: the source
    # trains on verl with DAPO-Math-17k, its loss settings are not public)
    "spae": _recipe({"name": "spae"}, {"preset": "dapo"}),
    # T-PPO (arXiv 2506.15050, paper only; egae.py): Extended GAE from a critic, gamma 1 / lambda 0.95 (ours, the
    # paper's are not recovered), PPO's clip 0.2 with a token mean. Needs `method: tppo` (configs/text/tiny_tppo.yaml)
    "tppo": _recipe(
        {"name": "egae", "gamma": 1.0, "lam": 0.95},
        {"bounds": {"name": "symmetric", "eps": 0.2}, "aggregation": "token_mean"},
    ),
}
