"""Text-side GRPO: causal LM policies trained with the shared `flowgrpo.core` advantages and losses.

    from flowgrpo.text import load_text_config, train_text
    history = train_text(load_text_config("configs/text/tiny_pattern.yaml", ["optim.lr=0"]))

Modules, one job each: config (typed config), data (JSONL / built-in tasks, chat template, checks),
models (tiny random Qwen2 + byte tokenizer, real models, LoRA, KL reference), generation
(transformers generate -> Rollout), logprobs (micro-batched token log-probs), answers (math answer
extraction and equivalence), reward_functions (registry, TRL-compatible user functions, scoring), bleu
(batched sentence BLEU on token-id tensors), encoders (sentence embeddings for semantic similarity), collect
(generate + score + dynamic sampling), methods (the method plug-ins' registry and context), grpo (advantages,
old / reference log-probs, the token-level update), trainer (generation and scoring; the loop and the update
loop are flowgrpo.run).
"""

from .config import DEFAULTS, TextConfig, load_text_config
from .data import DataError
from .reward_functions import REWARDS, RewardError
from ..run.ratio_check import OnPolicyRatioWarning
from .trainer import TextGRPOTrainer, train_text

__all__ = [
    "DEFAULTS",
    "REWARDS",
    "DataError",
    "OnPolicyRatioWarning",
    "RewardError",
    "TextConfig",
    "TextGRPOTrainer",
    "load_text_config",
    "train_text",
]
