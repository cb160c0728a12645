"""The checked models: real sizes with random weights (no hub), or the tiny test models.

SD3.5-Medium and FLUX.1-dev transformers take their published configs from flowgrpo.scaling.memory
(SPECS, each with the URL of its config.json); the VAE has SD3's / FLUX's published shape. Text
encoders are small random stand-ins whose output widths match the transformer's inputs (CLIP pooled
2 x 1024 / 768, T5 width 4096) and whose token counts are the real ones (CLIP 77, T5 256 / 512), so
the denoiser sees what it sees with the real encoders. Qwen2.5-0.5B is its published config with the
byte-level tiny tokenizer (its ids are a subset of the 151,936-entry vocabulary, which is kept).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterator

import torch

from flowgrpo.scaling.memory import SPECS
from pipelines.adapters import tiny_parts

# https://huggingface.co/Qwen/Qwen2.5-0.5B/blob/main/config.json
QWEN25_05B = dict(
    vocab_size=151936,
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    max_position_embeddings=32768,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
)
TINY_QWEN = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    tie_word_embeddings=True,
)
# SD3's / FLUX.1's VAE (stabilityai/stable-diffusion-3.5-medium and FLUX.1-dev vae/config.json shapes)
SD3_VAE = dict(
    block_out_channels=(128, 256, 512, 512),
    layers_per_block=2,
    norm_num_groups=32,
    latent_channels=16,
    use_quant_conv=False,
    use_post_quant_conv=False,
)


@dataclass(frozen=True)
class Sizes:
    """What one run of the check does: real sizes on a GPU, or the tiny models (CPU, tests)."""

    tiny: bool
    resolution: int
    steps: int
    prompts: int
    group: int
    lora_rank: int
    micro_batch: int
    repeats: int  # timed repetitions after one warm-up
    flux_resolution: int
    flux_steps: int
    flux_micro_batch: int
    text_prompts: int
    text_group: int
    text_new_tokens: int
    compile_backend: str  # inductor on a GPU; eager for the tiny CPU run (dynamo graph capture only)


FULL = Sizes(
    tiny=False,
    resolution=512,
    steps=10,
    prompts=2,
    group=4,
    lora_rank=32,
    micro_batch=8,
    repeats=3,
    flux_resolution=512,
    flux_steps=4,
    flux_micro_batch=4,
    text_prompts=4,
    text_group=8,
    text_new_tokens=128,
    compile_backend="inductor",
)
TINY = Sizes(
    tiny=True,
    resolution=32,
    steps=3,
    prompts=1,
    group=2,
    lora_rank=4,
    micro_batch=2,
    repeats=1,
    flux_resolution=32,
    flux_steps=2,
    flux_micro_batch=2,
    text_prompts=2,
    text_group=2,
    text_new_tokens=6,
    compile_backend="eager",
)


def stand_in(sizes: Sizes) -> str:
    """Title prefix that keeps a tiny run from reading as the real-size check."""
    return "tiny stand-in for " if sizes.tiny else ""


def spec_config(name: str) -> dict[str, Any]:
    return dict(next(s for s in SPECS if s.name == name).config)


@contextlib.contextmanager
def built_on(device: str, dtype: torch.dtype, seed: int = 0) -> Iterator[None]:
    """Modules created inside are created on `device` in `dtype` (no CPU fp32 copy of a 12 B model)."""
    old = torch.get_default_dtype()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if device.startswith("cuda"):
            torch.cuda.manual_seed(seed)
        torch.set_default_dtype(dtype)
        try:
            with torch.device(device):
                yield
        finally:
            torch.set_default_dtype(old)


def _vae(scaling_factor: float, shift_factor: float):
    from diffusers import AutoencoderKL

    cfg = dict(SD3_VAE)
    n = len(cfg["block_out_channels"])
    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * n,
        up_block_types=("UpDecoderBlock2D",) * n,
        sample_size=1024,
        scaling_factor=scaling_factor,
        shift_factor=shift_factor,
        **cfg,
    )


def sd35_medium(sizes: Sizes, device: str, dtype: torch.dtype):
    """An SD3Adapter over an SD3.5-Medium-size StableDiffusion3Pipeline (random weights)."""
    from pipelines.adapters import SD3Adapter

    if sizes.tiny:
        return SD3Adapter.tiny(qk_norm=True, dtype=dtype, device=device)  # SD3.5's block types, tiny widths
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline

    with built_on(device, dtype):
        pipe = StableDiffusion3Pipeline(
            transformer=SD3Transformer2DModel(**spec_config("SD3.5-Medium")),
            scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
            vae=_vae(1.5305, 0.0609),
            text_encoder=tiny_parts.clip_text_model(True, projection=1024, max_len=77),
            tokenizer=tiny_parts.clip_tokenizer(77),
            text_encoder_2=tiny_parts.clip_text_model(True, projection=1024, max_len=77),
            tokenizer_2=tiny_parts.clip_tokenizer(77),
            text_encoder_3=tiny_parts.t5_encoder(4096),
            tokenizer_3=tiny_parts.t5_tokenizer(),
        )
    return SD3Adapter(pipe, max_sequence_length=256)


def flux_dev(sizes: Sizes, device: str, dtype: torch.dtype):
    """A FluxAdapter over a FLUX.1-dev-size FluxPipeline (random weights, guidance embedding)."""
    from pipelines.adapters import FluxAdapter

    if sizes.tiny:
        return FluxAdapter.tiny(dtype=dtype, device=device)
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel

    with built_on(device, dtype):
        pipe = FluxPipeline(
            transformer=FluxTransformer2DModel(**spec_config("FLUX.1-dev")),
            scheduler=FlowMatchEulerDiscreteScheduler(
                shift=3.0,
                use_dynamic_shifting=True,
                base_shift=0.5,
                max_shift=1.15,
                base_image_seq_len=256,
                max_image_seq_len=4096,
            ),
            vae=_vae(0.3611, 0.1159),
            text_encoder=tiny_parts.clip_text_model(False, hidden=768, max_len=77),  # pooled 768
            tokenizer=tiny_parts.clip_tokenizer(77),
            text_encoder_2=tiny_parts.t5_encoder(4096),
            tokenizer_2=tiny_parts.t5_tokenizer(),
        )
    return FluxAdapter(pipe, max_sequence_length=512)


def save_qwen(sizes: Sizes, folder: str, dtype: torch.dtype) -> str:
    """Write a random Qwen2.5-0.5B-size (or tiny) causal LM and the byte-level tokenizer to `folder`,
    so the text trainer and vLLM load it like any local model."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from flowgrpo.text.models import build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer()
    dims = dict(TINY_QWEN, vocab_size=len(tokenizer)) if sizes.tiny else QWEN25_05B
    config = Qwen2Config(
        **dims,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.eos_token_id,
        attention_dropout=0.0,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(config).to(dtype)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
