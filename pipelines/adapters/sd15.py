"""SD1.5-style latent diffusion: UNet2DConditionModel, one CLIP text encoder, DDIM (epsilon prediction)."""

from __future__ import annotations

from typing import Any

from torch import Tensor

from . import tiny_parts
from .base import Adapter


class SD15Adapter(Adapter):
    family = "sd15"
    # "epsilon" marks the DDIM family for the sampler; an SD2-style v-prediction model keeps it and
    # carries scheduler_config["prediction_type"] = "v_prediction", which the ddim kernel reads.
    prediction = "epsilon"
    pipeline_class = "StableDiffusionPipeline"
    denoiser_name = "unet"
    # Attention projections of the UNet's self- and cross-attention (diffusers' text-to-image LoRA).
    lora_targets = ("to_q", "to_k", "to_v", "to_out.0")
    default_max_sequence_length = 77  # fixed by CLIP; unused, the tokenizer's length rules
    block_names = ("down_blocks", "mid_block", "up_blocks")  # UNet stages (compiled one by one)

    def __init__(self, pipe: Any, **kw: Any):
        from diffusers import DDIMScheduler

        super().__init__(pipe, **kw)
        # SD1.5 ships a PNDM config; the RL kernel is DDIM on the same betas.
        if not isinstance(pipe.scheduler, DDIMScheduler):
            pipe.scheduler = DDIMScheduler.from_config(pipe.scheduler.config)

    def _encode(self, texts: list[str]) -> dict[str, Tensor]:
        embeds, _ = self.pipe.encode_prompt(texts, self.device, 1, do_classifier_free_guidance=False)
        return {"embeds": embeds.to(self.dtype)}

    def _forward(self, x: Tensor, sigma: Tensor, text: dict[str, Tensor | None], guidance: float | None) -> Tensor:
        # For DDIM `sigma` is the integer timestep; the UNet takes it as is.
        return self.denoiser(x, sigma, encoder_hidden_states=text["embeds"], return_dict=False)[0]

    @classmethod
    def _load_kwargs(cls) -> dict[str, Any]:
        # The safety checker is not part of RL sampling; skip loading it (a user kw overrides).
        return {"safety_checker": None, "feature_extractor": None, "requires_safety_checker": False}

    @classmethod
    def _tiny_pipeline(cls) -> Any:
        from diffusers import DDIMScheduler, StableDiffusionPipeline, UNet2DConditionModel

        unet = UNet2DConditionModel(
            sample_size=16, in_channels=4, out_channels=4, block_out_channels=(16, 32), layers_per_block=1,
            down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
            up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
            cross_attention_dim=32, norm_num_groups=4, attention_head_dim=8,
        )  # fmt: skip
        scheduler = DDIMScheduler(
            beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", clip_sample=False,
            set_alpha_to_one=False, steps_offset=1,
        )  # fmt: skip
        return StableDiffusionPipeline(
            vae=tiny_parts.vae(4, scaling_factor=0.18215),
            text_encoder=tiny_parts.clip_text_model(False),  # hidden 32 = cross_attention_dim
            tokenizer=tiny_parts.clip_tokenizer(),
            unet=unet,
            scheduler=scheduler,
            safety_checker=None,
            feature_extractor=None,
            requires_safety_checker=False,
        )
