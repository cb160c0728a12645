"""Tiny random CLIP and DINOv2 built from configs, for tests and demos (no hub, no files).

They are the same classes the real checkpoints load into, so every scorer code path runs on CPU in
milliseconds. The CLIP tokenizer is byte-level: the two specials, the 256 byte symbols and the
same with the end-of-word mark, no merges (514 tokens), built in memory.
"""

from __future__ import annotations

import torch

from .preprocess import clip_image_processor_class

TINY_IMAGE_SIZE = 32
TINY_TEXT_LENGTH = 16


def byte_symbols() -> list[str]:
    """The 256 printable symbols byte-level BPE uses for bytes: printable Latin-1 bytes map to
    themselves, the others to code points from 256 upward, in byte order."""
    printable = set(range(ord("!"), ord("~") + 1)) | set(range(0xA1, 0xAD)) | set(range(0xAE, 0x100))
    symbols, extra = [], 0
    for b in range(256):
        if b in printable:
            symbols.append(chr(b))
        else:
            symbols.append(chr(256 + extra))
            extra += 1
    return symbols


def tiny_clip_tokenizer(max_length: int = TINY_TEXT_LENGTH):
    from transformers import CLIPTokenizer

    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for s in byte_symbols():
        vocab[s] = len(vocab)
    for s in byte_symbols():
        vocab[s + "</w>"] = len(vocab)
    return CLIPTokenizer(vocab=vocab, merges=[], model_max_length=max_length)


def tiny_clip_processor(image_size: int = TINY_IMAGE_SIZE):
    """A CLIP image processor with the published statistics at a tiny size."""
    return clip_image_processor_class()(
        size={"shortest_edge": image_size}, crop_size={"height": image_size, "width": image_size}
    )


def tiny_clip_model(seed: int = 0, projection_dim: int = 16):
    from transformers import CLIPConfig, CLIPModel

    common = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
    config = CLIPConfig(
        text_config=dict(
            common,
            vocab_size=514,
            max_position_embeddings=TINY_TEXT_LENGTH,
            bos_token_id=0,
            eos_token_id=1,
            pad_token_id=1,
        ),
        vision_config=dict(common, image_size=TINY_IMAGE_SIZE, patch_size=8),
        projection_dim=projection_dim,
    )
    with torch.random.fork_rng(devices=[]):  # seed the weights without touching the caller's RNG
        torch.manual_seed(seed)
        return CLIPModel(config).eval()


def tiny_dinov2_model(seed: int = 0):
    from transformers import Dinov2Config, Dinov2Model

    config = Dinov2Config(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, image_size=16, patch_size=4
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return Dinov2Model(config).eval()
