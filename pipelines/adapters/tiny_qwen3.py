"""Tiny offline Qwen3 text encoders (FLUX.2 [klein], Z-Image) and their chat-template tokenizer.

The real families encode a prompt as a chat turn (`apply_chat_template`, Qwen3's template with its
`enable_thinking` switch); the tiny tokenizer is byte-level (one token per byte) with the template's three
special tokens and a template of the same shape, so a prompt becomes ~30 tokens + its bytes.
"""

from __future__ import annotations

from typing import Any

from .tiny_parts import _byte_chars

SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# Qwen3's layout of a single user turn and the generation prompt; with enable_thinking false the template
# closes an empty think block, as Qwen3's own does.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)


def tokenizer():
    from transformers import Qwen2Tokenizer

    tokens = [*_byte_chars(), *SPECIAL]
    tok = Qwen2Tokenizer(
        vocab={t: i for i, t in enumerate(tokens)}, merges=[], model_max_length=4096,
        additional_special_tokens=list(SPECIAL[1:]),
    )  # fmt: skip
    tok.chat_template = CHAT_TEMPLATE
    return tok


def config(hidden: int = 16, layers: int = 2) -> Any:
    from transformers import Qwen3Config

    vocab = len(_byte_chars()) + len(SPECIAL)
    return Qwen3Config(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=2, num_key_value_heads=1, head_dim=hidden // 2, max_position_embeddings=4096,
        rope_theta=1e6, bos_token_id=vocab - 3, eos_token_id=vocab - 1, pad_token_id=vocab - 3,
        tie_word_embeddings=True,
    )  # fmt: skip


def causal_lm(hidden: int = 16, layers: int = 2):
    """Qwen3ForCausalLM (FLUX.2 [klein]'s text encoder class)."""
    from transformers import Qwen3ForCausalLM

    return Qwen3ForCausalLM(config(hidden, layers))


def model(hidden: int = 16, layers: int = 2):
    """Qwen3Model (Z-Image's text encoder class: the LM without its head)."""
    from transformers import Qwen3Model

    return Qwen3Model(config(hidden, layers))
