"""Qwen-Image: QwenImageTransformer2DModel (MMDiT), a Qwen2.5-VL text encoder, flow matching.

Text embeddings have per-prompt lengths (the pipeline drops its chat template's first tokens and
keeps a token mask), so cached rows keep their real tokens and batches are padded with mask 0.
The VAE is a video VAE: latents carry a frame axis of 1, added / removed around decode only.

Schedule: QwenImagePipeline (and its Edit / Edit-Plus pipelines) always walks uniform sigmas linspace(1, 1/n, n)
under the scheduler's dynamic shift, mu from the image tokens (`flow_grid`); diffusers' own `set_timesteps(n)` spacing
differs (up to 0.035 in sigma at 4 steps).

CFG: QwenImagePipeline rescales the guided output to the norm of the conditional one, per token
(`cfg_renorm=True`, the default, matches it); `cfg_renorm=False` gives the plain
uncond + w * (cond - uncond) of the other families.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from . import tiny_parts
from .base import Adapter
from .flux import pack, unpack


class QwenImageAdapter(Adapter):
    family = "qwenimage"
    prediction = "velocity"
    pipeline_class = "QwenImagePipeline"
    denoiser_name = "transformer"
    lora_targets = ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out")
    default_max_sequence_length = 1024  # the pipeline's default
    # The tiny byte-level tokenizer turns the chat template into ~150 tokens: keep them all, or
    # truncation would cut off the prompt itself.
    tiny_max_sequence_length = 1024

    options = (*Adapter.options, "cfg_renorm")

    def __init__(self, pipe: Any, *, cfg_renorm: bool = True, **kw: Any):
        super().__init__(pipe, **kw)
        self.cfg_renorm = cfg_renorm

    @classmethod
    def vae_scale_of(cls, vae_config: Any) -> int:
        return int(2 ** len(vae_config["temperal_downsample"]))

    def _latent_channels(self) -> int:
        return self.vae.config.z_dim

    @classmethod
    def patch_of(cls, denoiser_config: Any) -> int:
        return 2  # 2x2 packing

    def flow_grid(self, num_steps: int, height: int, width: int, shift: float | None) -> Any:
        """The pipeline's grid: uniform sigmas, shifted by mu of the image tokens (or the config's static shift)."""
        from pipelines.schedules import flow_schedule

        config = self.scheduler_config
        if not config.get("use_dynamic_shifting"):
            return flow_schedule(num_steps, shift=shift, spacing="uniform", config=config)
        if shift is not None:
            raise ValueError(
                f"{self.family}: sampler.shift does not apply: the scheduler shifts by mu from the image tokens "
                "(leave shift unset, or use schedule {name: time_shift, shift: ...})"
            )
        seq = self.image_seq_len(height, width)
        return flow_schedule(num_steps, image_seq_len=seq, spacing="uniform", config=config)

    def _encode(self, texts: list[str]) -> dict[str, Tensor]:
        embeds, mask = self.pipe.encode_prompt(texts, device=self.device, max_sequence_length=self.max_sequence_length)
        if mask is None:  # the pipeline drops an all-ones mask
            mask = torch.ones(embeds.shape[:2], dtype=torch.long, device=embeds.device)
        return {"embeds": embeds.to(self.dtype), "mask": mask}

    def _forward(self, x: Tensor, sigma: Tensor, text: dict[str, Tensor | None], guidance: float | None) -> Tensor:
        n, _, h, w = x.shape
        mask = text["mask"]
        out = self.denoiser(
            hidden_states=pack(x),
            timestep=sigma.to(x.dtype),  # the pipeline passes t / 1000 = sigma in the latents' dtype
            encoder_hidden_states=text["embeds"],
            encoder_hidden_states_mask=None if mask is None or bool(mask.all()) else mask,
            img_shapes=[[(1, h // 2, w // 2)]] * n,
            return_dict=False,
        )[0]
        return unpack(out, h, w)

    def _combine(self, uncond: Tensor, cond: Tensor, w: float) -> Tensor:
        guided = uncond + w * (cond - uncond)
        if not self.cfg_renorm:
            return guided
        # per token = per latent 2x2 patch: the pipeline takes norms over packed channels
        h, wd = cond.shape[2:]
        c, g = pack(cond), pack(guided)
        return unpack(g * (c.norm(dim=-1, keepdim=True) / g.norm(dim=-1, keepdim=True)), h, wd)

    def _decode(self, latents: Tensor) -> Tensor:
        cfg = self.vae.config
        shape = (1, cfg.z_dim, 1, 1, 1)
        mean = torch.tensor(cfg.latents_mean, device=latents.device).view(shape)
        std = torch.tensor(cfg.latents_std, device=latents.device).view(shape)
        z = (latents.float()[:, :, None] * std + mean).to(self.vae.dtype)
        image = self.vae.decode(z, return_dict=False)[0][:, :, 0]
        return (image.float() / 2 + 0.5).clamp(0, 1)

    @classmethod
    def _tiny_pipeline(cls) -> Any:
        from diffusers import (
            AutoencoderKLQwenImage,
            FlowMatchEulerDiscreteScheduler,
            QwenImagePipeline,
            QwenImageTransformer2DModel,
        )
        from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2Tokenizer

        special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # the chat template's markers
        tokens = [*tiny_parts._byte_chars(), *special]
        tokenizer = Qwen2Tokenizer(
            vocab={t: i for i, t in enumerate(tokens)}, merges=[], model_max_length=2048,
            additional_special_tokens=special[1:],
        )  # fmt: skip
        text = dict(
            hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=2, vocab_size=len(tokens), max_position_embeddings=2048, rope_theta=1e6,
            rope_scaling={"type": "mrope", "rope_type": "default", "mrope_section": [1, 1, 2]},
            bos_token_id=len(tokens) - 3, eos_token_id=len(tokens) - 1, pad_token_id=len(tokens) - 3,
        )  # fmt: skip
        vision = dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=16,
                      fullatt_block_indexes=[0])  # fmt: skip
        text_encoder = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(text_config=text, vision_config=vision))
        transformer = QwenImageTransformer2DModel(
            patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=16,
            num_attention_heads=3, joint_attention_dim=16, guidance_embeds=False, axes_dims_rope=(8, 4, 4),
        )  # fmt: skip
        vae = AutoencoderKLQwenImage(  # one downsampling: 32 px -> 16 x 16 latents, as the other tiny families
            base_dim=4, z_dim=4, dim_mult=[1, 2], num_res_blocks=1, temperal_downsample=[False],
            latents_mean=[0.1, -0.2, 0.0, 0.3], latents_std=[1.5, 0.8, 1.2, 2.0],
        )  # fmt: skip
        # Resolution-dependent shift as Qwen-Image's scheduler (exact released values not verified here).
        scheduler = FlowMatchEulerDiscreteScheduler(
            shift=1.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=0.9, base_image_seq_len=256,
            max_image_seq_len=8192, time_shift_type="exponential", shift_terminal=0.02,
        )  # fmt: skip
        return QwenImagePipeline(
            scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, transformer=transformer
        )
