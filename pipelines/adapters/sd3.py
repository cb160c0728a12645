"""SD3 / SD3.5: SD3Transformer2DModel (MMDiT), CLIP-L + CLIP-G + T5 text encoders, flow matching."""

from __future__ import annotations

from typing import Any

from torch import Tensor

from . import tiny_parts
from .base import Adapter


class SD3Adapter(Adapter):
    family = "sd3"
    prediction = "velocity"
    pipeline_class = "StableDiffusion3Pipeline"
    denoiser_name = "transformer"
    # Flow-GRPO's SD3 targets: joint attention (image and text streams); bare names also catch
    # SD3.5's second attention (attn2) in dual-attention blocks.
    lora_targets = ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out")
    default_max_sequence_length = 256  # the SD3 pipeline's default T5 length

    @classmethod
    def patch_of(cls, denoiser_config: Any) -> int:
        return int(denoiser_config["patch_size"])

    def _encode(self, texts: list[str]) -> dict[str, Tensor]:
        embeds, _, pooled, _ = self.pipe.encode_prompt(
            prompt=texts, prompt_2=None, prompt_3=None, device=self.device,
            do_classifier_free_guidance=False, max_sequence_length=self.max_sequence_length,
        )  # fmt: skip
        return {"embeds": embeds.to(self.dtype), "pooled": pooled.to(self.dtype)}

    def _forward(self, x: Tensor, sigma: Tensor, text: dict[str, Tensor | None], guidance: float | None) -> Tensor:
        # The SD3 pipeline feeds timestep = sigma * num_train_timesteps (float).
        t = sigma * self.pipe.scheduler.config.num_train_timesteps
        return self.denoiser(
            hidden_states=x, timestep=t, encoder_hidden_states=text["embeds"],
            pooled_projections=text["pooled"], return_dict=False,
        )[0]  # fmt: skip

    @classmethod
    def _tiny_pipeline(cls, qk_norm: bool = False, shift: float = 3.0) -> Any:
        """qk_norm=True gives the SD3.5 variant (RMS qk-norm, a dual-attention first block)."""
        from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline

        transformer = SD3Transformer2DModel(
            sample_size=16, patch_size=2, in_channels=16, out_channels=16, num_layers=2,
            attention_head_dim=16, num_attention_heads=4, joint_attention_dim=64,
            caption_projection_dim=64, pooled_projection_dim=64, pos_embed_max_size=32,
            qk_norm="rms_norm" if qk_norm else None, dual_attention_layers=(0,) if qk_norm else (),
        )  # fmt: skip
        return StableDiffusion3Pipeline(
            transformer=transformer,
            scheduler=FlowMatchEulerDiscreteScheduler(shift=shift),
            vae=tiny_parts.vae(16, shift_factor=0.0609, scaling_factor=1.5305, use_quant_conv=False,
                               use_post_quant_conv=False),
            text_encoder=tiny_parts.clip_text_model(True),  # pooled 32 + 32 = pooled_projection_dim
            tokenizer=tiny_parts.clip_tokenizer(),
            text_encoder_2=tiny_parts.clip_text_model(True),
            tokenizer_2=tiny_parts.clip_tokenizer(),
            text_encoder_3=tiny_parts.t5_encoder(64),  # d_model = joint_attention_dim
            tokenizer_3=tiny_parts.t5_tokenizer(),
        )  # fmt: skip
