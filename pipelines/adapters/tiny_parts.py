"""Tiny offline building blocks shared by the families' `tiny()` constructors.

Tokenizers are built from in-memory vocabularies (transformers >= 5 accepts them), so nothing is
downloaded: a byte-level CLIP BPE with no merges (one token per byte) and a character T5 unigram.
Sizes are those of a CPU test model: a 32 px image gives 16 x 16 latents.
"""

from __future__ import annotations

import string
from typing import Any

MAX_LEN = 16  # tokenizer length; set explicitly or pipelines pad to enormous lengths


def _byte_chars() -> list[str]:
    # GPT-2 / CLIP byte -> printable unicode map (printable bytes map to themselves, the rest to 256+).
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = [b for b in range(256) if b not in keep]
    return [chr(b) for b in keep] + [chr(256 + i) for i in range(len(extra))]


def clip_tokenizer(max_len: int = MAX_LEN):
    """max_len: 16 for tiny models; 77 (CLIP's real length) for the real-size random checks."""
    from transformers import CLIPTokenizer

    chars = _byte_chars()
    tokens = ["<|startoftext|>", "<|endoftext|>", *chars, *(c + "</w>" for c in chars)]
    return CLIPTokenizer(vocab={t: i for i, t in enumerate(tokens)}, merges=[], model_max_length=max_len)


def t5_tokenizer():
    from transformers import T5Tokenizer

    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0)]
    for c in string.printable[:95]:
        pieces += [("\u2581" + c, -2.0), (c, -3.0)]
    return T5Tokenizer(vocab=pieces, extra_ids=0, model_max_length=MAX_LEN)


def clip_config(hidden: int = 32, projection: int = 32, max_len: int = MAX_LEN) -> Any:
    from transformers import CLIPTextConfig

    return CLIPTextConfig(
        vocab_size=514, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=max_len, projection_dim=projection,
        bos_token_id=0, eos_token_id=1, pad_token_id=1,
    )  # fmt: skip


def clip_text_model(with_projection: bool, **cfg: Any):
    from transformers import CLIPTextModel, CLIPTextModelWithProjection

    return (CLIPTextModelWithProjection if with_projection else CLIPTextModel)(clip_config(**cfg))


def t5_encoder(d_model: int = 64):
    from transformers import T5Config, T5EncoderModel

    return T5EncoderModel(
        T5Config(vocab_size=len(t5_tokenizer()), d_model=d_model, d_kv=16, d_ff=2 * d_model, num_layers=2,
                 num_heads=4, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)
    )  # fmt: skip


def vae(latent_channels: int, **cfg: Any):
    """AutoencoderKL with 2 blocks: scale factor 2 (32 px -> 16 x 16 latents)."""
    from diffusers import AutoencoderKL

    return AutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=latent_channels,
        down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
        block_out_channels=(8, 16), layers_per_block=1, norm_num_groups=4, sample_size=32, **cfg,
    )  # fmt: skip


LLAMA3_SPECIAL = ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")


def llama3_tokenizer():
    """Byte-level (one token per byte) with Llama 3's chat-header tokens, for HunyuanVideo's Llama text encoder:
    its prompt template is written in those tokens (a tiny stand-in for LlamaTokenizerFast; pads on the right)."""
    from transformers import Qwen2Tokenizer

    tokens = [*_byte_chars(), *LLAMA3_SPECIAL]
    return Qwen2Tokenizer(
        vocab={t: i for i, t in enumerate(tokens)}, merges=[], model_max_length=4096, pad_token=LLAMA3_SPECIAL[0],
        additional_special_tokens=list(LLAMA3_SPECIAL[1:]),
    )  # fmt: skip


def llama_encoder(vocab_size: int, hidden: int = 16, layers: int = 3):
    """LlamaModel (HunyuanVideo's text encoder class; it reads the third-to-last hidden state, so >= 2 layers)."""
    from transformers import LlamaConfig, LlamaModel

    return LlamaModel(
        LlamaConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                    num_attention_heads=2, num_key_value_heads=1, head_dim=hidden // 2, max_position_embeddings=4096,
                    pad_token_id=vocab_size - 4, bos_token_id=vocab_size - 4, eos_token_id=vocab_size - 1)
    )  # fmt: skip
