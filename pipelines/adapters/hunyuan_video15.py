"""HunyuanVideo 1.5 text-to-video (8.3B): HunyuanVideo15Transformer3DModel, Qwen2.5-VL (chat template) + byT5 (glyph
text) encoders, AutoencoderKLHunyuanVideo15 (16x spatial, 4x temporal, 32 channels), flow matching, true CFG.

What HunyuanVideo15Pipeline does, and where it lives here (geometry, grid and decode as HunyuanVideoAdapter's):

- Latents [B, 32, F, h, w] with h, w = pixels // 16, patch 1. The transformer takes 65 channels: the latents, then
  an all-zero condition latent and an all-zero mask channel (text-to-video), and 729 all-zero vision tokens (its
  image stream, masked out for t2v); `_forward` builds those as the pipeline does.
- Text: the prompt is a chat turn (system message + user turn, `apply_chat_template`) through Qwen2.5-VL, third-to-
  last hidden state, the first `prompt_template_encode_start_idx` (108) tokens cropped, with a mask; the pipeline's
  `tokenizer_max_length` (1000) is the adapter's max_sequence_length. Quoted text in the prompt ("...") is also
  encoded by byT5 (256 tokens + mask, all-zero when there is none): `PromptEmbeds`' second token stream (cond2 /
  mask2; no pooled vector). Cached rows of both streams keep their real tokens; the transformer moves masked tokens
  behind the valid ones and masks them, so the pipeline's padding (1000 / 256 tokens) changes nothing.
- Guidance: real CFG through the pipeline's ClassifierFreeGuidance guider (6.0 published; the CFG-distilled
  checkpoints ship 1.0: use cfg_mode "none"): uncond + w (cond - uncond) with w the sampler's guidance_scale.
  A guider with guidance_rescale, the "original formulation" or a start / stop window is refused, not mis-sampled.
  No guidance embedding.
- Grid: sigmas linspace(1, 0, N + 1)[:-1] through FlowMatchEulerDiscreteScheduler's static shift (5.0 at 480p,
  9.0 at 720p t2v); the transformer sees t = 1000 sigma.
- Decode: latents / scaling_factor (1.03682), then the VAE. diffusers 0.42's AutoencoderKLHunyuanVideo15 has
  spatial tiles only (256 px, overlap 0.25; no temporal tiling): `vae_tiling=True` (default) turns them on, with
  slicing, so decode memory is bounded in height / width / batch but grows with the frame count.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from . import tiny_qwen3
from .base import Adapter
from .hunyuan_video import HunyuanVideoAdapter

# The published transformer configs (hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-*, transformer/config.json),
# from diffusers' scripts/convert_hunyuan_video1_5_to_diffusers.py@38c42b4d (TRANSFORMER_CONFIGS; the t2v ones;
# its SCHEDULER_CONFIGS: shift 5.0 at 480p, 9.0 at 720p; GUIDANCE_CONFIGS: 6.0, 1.0 for the distilled one).
_COMMON = dict(
    in_channels=65, out_channels=32, num_attention_heads=16, attention_head_dim=128, num_layers=54,
    num_refiner_layers=2, mlp_ratio=4.0, patch_size=1, patch_size_t=1, qk_norm="rms_norm", text_embed_dim=3584,
    text_embed_2_dim=1472, image_embed_dim=1152, rope_theta=256.0, rope_axes_dim=(16, 56, 56), use_meanflow=False,
    task_type="t2v",
)  # fmt: skip
HUNYUAN_VIDEO15_SPECS: dict[str, dict[str, Any]] = {
    "hunyuanvideo1.5-480p-t2v": {**_COMMON, "target_size": 640},
    "hunyuanvideo1.5-480p-t2v-distilled": {**_COMMON, "target_size": 640},
    "hunyuanvideo1.5-720p-t2v": {**_COMMON, "target_size": 960},
}
TINY_SYSTEM_MESSAGE = "Describe the video."
TINY_CROP_START = 35  # "<|im_start|>system\n" + TINY_SYSTEM_MESSAGE + "<|im_end|>\n<|im_start|>user\n" in bytes


class HunyuanVideo15Adapter(HunyuanVideoAdapter):
    family = "hunyuan_video15"
    pipeline_class = "HunyuanVideo15Pipeline"
    # the attention projections (image stream) of every double-stream block and of the token refiner
    lora_targets = ("to_q", "to_k", "to_v", "to_out.0")
    default_max_sequence_length = 1000  # the pipeline's tokenizer_max_length
    tiny_max_sequence_length = 32
    block_names = ("transformer_blocks",)
    default_num_frames = 121  # the pipeline's
    # HunyuanVideo15Pipeline has no `load_lora_weights` (diffusers 0.42): the same diffusers-format file
    # (`transformer.` keys + LoraConfig metadata) is written with HunyuanVideo's writer; it loads with
    # `pipe.transformer.load_lora_adapter(path, prefix="transformer")` or `load_lora` here
    lora_writer = "HunyuanVideoLoraLoaderMixin"

    options = tuple(o for o in HunyuanVideoAdapter.options if o not in ("embedded_guidance", "prompt_template"))

    def __init__(self, pipe: Any, **kw: Any):
        if unused := sorted({"embedded_guidance", "prompt_template"} & set(kw)):
            raise ValueError(
                f"{self.family}: {unused} do not apply (no guidance embedding; the pipeline's own chat template)"
            )
        guider = pipe.guider
        window = (getattr(guider, "_start", 0.0), getattr(guider, "_stop", 1.0))
        if guider.guidance_rescale or guider.use_original_formulation or window != (0.0, 1.0):
            raise ValueError(
                f"{self.family}: only plain CFG is supported (guidance_rescale 0, use_original_formulation False, "
                f"start 0 / stop 1), got {guider.guidance_rescale}, {guider.use_original_formulation}, {window}"
            )
        super().__init__(pipe, **kw)
        pipe.tokenizer_max_length = self.max_sequence_length  # the pipeline reads its text length from here

    @classmethod
    def tiny(cls, seed: int = 0, dtype: torch.dtype = torch.float32, device: Any = "cpu", **kw: Any) -> "Adapter":
        return super(HunyuanVideoAdapter, cls).tiny(seed=seed, dtype=dtype, device=device, **kw)

    # ---- prompts and the denoiser --------------------------------------------------------------

    def _encode(self, texts: list[str]) -> dict[str, Tensor]:
        embeds, mask, glyph, glyph_mask = self.pipe.encode_prompt(
            prompt=list(texts), device=self.device, dtype=self.dtype, batch_size=len(texts)
        )
        return {"embeds": embeds, "mask": mask, "embeds2": glyph, "mask2": glyph_mask}  # byT5: the second stream

    def _forward(self, x: Tensor, sigma: Tensor, text: dict[str, Tensor | None], guidance: float | None) -> Tensor:
        n, cfg = x.shape[0], self.denoiser.config
        # t2v: an all-zero condition latent, an all-zero mask channel, all-zero vision tokens (the pipeline's)
        inputs = torch.cat([x, torch.zeros_like(x), x.new_zeros(n, 1, *x.shape[2:])], dim=1)
        image = x.new_zeros(n, self.pipe.vision_num_semantic_tokens, cfg.image_embed_dim)
        return self.denoiser(
            hidden_states=inputs,
            image_embeds=image,
            timestep=sigma * self.pipe.scheduler.config.num_train_timesteps,
            encoder_hidden_states=text["embeds"],
            encoder_attention_mask=text["mask"],
            encoder_hidden_states_2=text["embeds2"],
            encoder_attention_mask_2=text["mask2"],
            return_dict=False,
        )[0]

    # ---- construction --------------------------------------------------------------------------

    @classmethod
    def _tiny_pipeline(cls, shift: float = 5.0, guidance_scale: float = 6.0) -> Any:
        """HunyuanVideo 1.5-like at test size: 4 latent channels, 4x temporal / 4x spatial VAE, one block, patch 1.
        The instance's text settings are shrunk too (system message, crop, byT5 length, vision tokens): the
        transformer's byT5 projection is 2048 wide whatever its config, so 8 glyph tokens instead of 256."""
        from diffusers import (
            AutoencoderKLHunyuanVideo15, ClassifierFreeGuidance, FlowMatchEulerDiscreteScheduler,
            HunyuanVideo15Pipeline, HunyuanVideo15Transformer3DModel,
        )  # fmt: skip
        from transformers import ByT5Tokenizer, Qwen2_5_VLTextConfig, Qwen2_5_VLTextModel, T5Config, T5EncoderModel

        tokenizer = tiny_qwen3.tokenizer()
        vocab = len(tokenizer)
        text_encoder = Qwen2_5_VLTextModel(
            Qwen2_5_VLTextConfig(vocab_size=vocab, hidden_size=16, intermediate_size=32, num_hidden_layers=3,
                                 num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=4096,
                                 rope_parameters={"rope_type": "default", "mrope_section": [1, 1, 2], "rope_theta": 1e6}, bos_token_id=vocab - 3,
                                 eos_token_id=vocab - 1, pad_token_id=vocab - 3)
        )  # fmt: skip
        tokenizer_2 = ByT5Tokenizer()
        text_encoder_2 = T5EncoderModel(
            T5Config(vocab_size=len(tokenizer_2), d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2,
                     pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)
        )  # fmt: skip
        transformer = HunyuanVideo15Transformer3DModel(
            in_channels=9, out_channels=4, num_attention_heads=2, attention_head_dim=8, num_layers=1,
            num_refiner_layers=1, text_embed_dim=16, text_embed_2_dim=16, image_embed_dim=8, rope_axes_dim=(2, 2, 4),
            task_type="t2v",
        )  # fmt: skip
        vae = AutoencoderKLHunyuanVideo15(
            latent_channels=4, block_out_channels=(8, 8, 8), layers_per_block=1, spatial_compression_ratio=4,
            temporal_compression_ratio=4,
        )  # fmt: skip
        pipe = HunyuanVideo15Pipeline(
            text_encoder=text_encoder, tokenizer=tokenizer, transformer=transformer, vae=vae,
            scheduler=FlowMatchEulerDiscreteScheduler(shift=shift), text_encoder_2=text_encoder_2,
            tokenizer_2=tokenizer_2, guider=ClassifierFreeGuidance(guidance_scale=guidance_scale),
        )  # fmt: skip
        pipe.system_message, pipe.prompt_template_encode_start_idx = TINY_SYSTEM_MESSAGE, TINY_CROP_START
        pipe.tokenizer_2_max_length, pipe.vision_num_semantic_tokens = 8, 4
        return pipe
