"""HunyuanVideo text-to-video (13B, DanceGRPO's video model): HunyuanVideoTransformer3DModel, a Llama text encoder
+ CLIP-L (pooled), AutoencoderKLHunyuanVideo, flow matching, guidance-distilled.

What HunyuanVideoPipeline does, and where it lives here:

- Latents are 5-D [B, C, F, h, w] (`video.VideoAdapter`): F = (num_frames - 1) // 4 + 1 latent frames (129 frames ->
  33), h, w = pixels // 8; the transformer packs 2x2 patches itself.
- Text: the prompt goes into a chat template (system turn + user turn), the Llama encoder's third-to-last hidden
  state is taken and the template's system part is cropped off (`crop_start` tokens, 95 for the published Llama 3
  tokenizer), with a token mask; CLIP-L's pooled output is the pooled vector. `prompt_template` swaps the template
  (the tiny model uses a short one written for its byte tokenizer). Cached rows keep their real tokens only; the
  transformer masks the padding, so the pipeline's max_sequence_length padding changes nothing.
- Guidance: the model is guidance-distilled: the transformer takes guidance * 1000 as an embedding. With cfg_mode
  "none" the sampler's guidance_scale goes to that embedding (the pipeline's `guidance_scale`, 6.0); in the CFG modes
  (the pipeline's "true CFG": negative prompt, true_cfg_scale) the embedding gets `embedded_guidance` (6.0) and
  the CFG scale is the sampler's guidance_scale: uncond + w (cond - uncond).
- Time: the transformer is conditioned on t = 1000 sigma. Grid: the pipeline passes sigmas linspace(1, 0, N+1)[:-1]
  to FlowMatchEulerDiscreteScheduler, which applies its static shift (7.0 published; DanceGRPO samples with 5):
  `flow_grid` builds the same ("uniform" spacing); `sampler.shift` overrides the shift.
- Decode: latents / scaling_factor (0.476986), then the VAE. Frames come back as [B, F, 3, H, W] in [0, 1] (the
  pipeline's "pt" output). Memory: the VAE always decodes long videos in temporal tiles (diffusers'
  framewise decoding: 16-frame tiles, stride 12, blended), but each tile goes through the decoder at full
  resolution at once, and this decoder has no causal per-frame cache (unlike Wan's); at 720x1280 one 16-frame
  tile is tens of GB of activations. So `vae_tiling=True` is the default here: spatial tiles of 256 px (stride 192,
  blended), diffusers' own `enable_tiling`, as the pipeline's documented example does; with slicing (one video at a
  time) decode memory is bounded by one tile whatever the frame count, resolution or batch. Below 256 px a side
  nothing is tiled spatially (the tiny tests decode exactly as the pipeline).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from . import tiny_parts
from .base import Adapter
from .video import VideoAdapter

# The published transformer config (hunyuanvideo-community/HunyuanVideo, transformer/config.json) is
# HunyuanVideoTransformer3DModel's defaults: diffusers' scripts/convert_hunyuan_video_to_diffusers.py@04614753 builds
# `HunyuanVideoTransformer3DModel()` and loads the original weights into it strictly (and its scheduler:
# FlowMatchEulerDiscreteScheduler(shift=7.0)). `HunyuanVideoTransformer3DModel(**spec)` builds it (meta device: no
# memory).
HUNYUAN_VIDEO_SPECS: dict[str, dict[str, Any]] = {
    "hunyuanvideo-13b": dict(
        in_channels=16, out_channels=16, num_attention_heads=24, attention_head_dim=128, num_layers=20,
        num_single_layers=40, num_refiner_layers=2, mlp_ratio=4.0, patch_size=2, patch_size_t=1, qk_norm="rms_norm",
        guidance_embeds=True, text_embed_dim=4096, pooled_projection_dim=768, rope_theta=256.0,
        rope_axes_dim=(16, 56, 56),
    ),
}  # fmt: skip

# The tiny model's template: the published one's layout (system turn, then the user turn) in few tokens; with the
# tiny byte tokenizer the system part is 38 tokens, cropped as the pipeline crops the published template's 95.
TINY_PROMPT_TEMPLATE = {
    "template": "<|start_header_id|>system<|end_header_id|>\n\nDescribe the video.<|eot_id|>"
    "<|start_header_id|>user<|end_header_id|>\n\n{}<|eot_id|>",
    "crop_start": 38,
}


class HunyuanVideoAdapter(VideoAdapter):
    family = "hunyuan_video"
    pipeline_class = "HunyuanVideoPipeline"
    # DanceGRPO's LoRA targets (fastvideo/train_grpo_flux_lora.py@15cc71d, its only LoRA recipe: to_q / to_k / to_v /
    # to_out.0); its HunyuanVideo run (train_grpo_hunyuan.py@15cc71d) fine-tunes the whole transformer. Here these
    # names hit the image-stream attention of the double-stream blocks, the single-stream blocks' q/k/v and the
    # token refiner's attention.
    lora_targets = ("to_q", "to_k", "to_v", "to_out.0")
    default_max_sequence_length = 256  # HunyuanVideoPipeline's
    block_names = ("transformer_blocks", "single_transformer_blocks")  # double- then single-stream
    default_num_frames = 129  # the pipeline's (DanceGRPO trains on 53 frames at 480x480)
    spatial_scale_key, temporal_scale_key = "spatial_compression_ratio", "temporal_compression_ratio"

    options = (*VideoAdapter.options, "embedded_guidance", "prompt_template")

    def __init__(
        self,
        pipe: Any,
        *,
        num_frames: int | None = None,
        vae_tiling: bool = True,
        embedded_guidance: float = 6.0,
        prompt_template: dict[str, Any] | None = None,
        **kw: Any,
    ):
        # spatial tiles on top of the VAE's temporal ones by default (module docstring)
        super().__init__(pipe, num_frames=num_frames, vae_tiling=vae_tiling, **kw)
        if prompt_template is not None and "{}" not in str(prompt_template.get("template", "")):
            raise ValueError(f"{self.family}: prompt_template needs a 'template' with a '{{}}', got {prompt_template}")
        self.prompt_template = prompt_template  # None: the pipeline's own
        self.embedded_guidance = float(embedded_guidance)

    @classmethod
    def tiny(cls, seed: int = 0, dtype: torch.dtype = torch.float32, device: Any = "cpu", **kw: Any) -> "Adapter":
        kw.setdefault("prompt_template", TINY_PROMPT_TEMPLATE)
        return super().tiny(seed=seed, dtype=dtype, device=device, **kw)

    # ---- geometry (frames, latent shape, tokens: video.VideoAdapter) ----------------------------

    def flow_grid(self, num_steps: int, height: int, width: int, shift: float | None) -> Any:
        """The pipeline's grid: sigmas linspace(1, 0, N + 1)[:-1] through the scheduler's static shift, then 0."""
        from pipelines.schedules import flow_schedule

        return flow_schedule(num_steps, shift=shift, spacing="uniform", config=self.scheduler_config)

    # ---- prompts and the denoiser --------------------------------------------------------------

    def _encode(self, texts: list[str]) -> dict[str, Tensor]:
        kw = {} if self.prompt_template is None else {"prompt_template": self.prompt_template}
        embeds, pooled, mask = self.pipe.encode_prompt(
            prompt=list(texts), device=self.device, max_sequence_length=self.max_sequence_length, **kw
        )
        return {"embeds": embeds.to(self.dtype), "pooled": pooled.to(self.dtype), "mask": mask}

    def _forward(self, x: Tensor, sigma: Tensor, text: dict[str, Tensor | None], guidance: float | None) -> Tensor:
        scale = self.embedded_guidance if guidance is None else float(guidance)
        g = torch.full((x.shape[0],), scale * 1000.0, device=x.device, dtype=x.dtype)  # the pipeline's * 1000
        return self.denoiser(
            hidden_states=x,
            timestep=sigma * self.pipe.scheduler.config.num_train_timesteps,
            encoder_hidden_states=text["embeds"],
            encoder_attention_mask=text["mask"],
            pooled_projections=text["pooled"],
            guidance=g,
            return_dict=False,
        )[0]

    # ---- video ---------------------------------------------------------------------------------

    def _unscale(self, z: Tensor) -> Tensor:
        return z / self.vae.config.scaling_factor

    # ---- construction --------------------------------------------------------------------------

    @classmethod
    def _tiny_pipeline(cls, shift: float = 7.0) -> Any:
        """HunyuanVideo-like at test size: 4 latent channels, 4x temporal / 4x spatial VAE, one double- and one
        single-stream block, 2x2 patches (32 px -> 8 x 8 latent cells -> 4 x 4 tokens a frame)."""
        from diffusers import (
            AutoencoderKLHunyuanVideo, FlowMatchEulerDiscreteScheduler, HunyuanVideoPipeline,
            HunyuanVideoTransformer3DModel,
        )  # fmt: skip

        tokenizer = tiny_parts.llama3_tokenizer()
        transformer = HunyuanVideoTransformer3DModel(
            in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=8, num_layers=1,
            num_single_layers=1, num_refiner_layers=1, patch_size=2, text_embed_dim=16, pooled_projection_dim=32,
            rope_axes_dim=(2, 2, 4),
        )  # fmt: skip
        vae = AutoencoderKLHunyuanVideo(
            latent_channels=4, block_out_channels=(8, 8, 8), down_block_types=("HunyuanVideoDownBlock3D",) * 3,
            up_block_types=("HunyuanVideoUpBlock3D",) * 3, layers_per_block=1, norm_num_groups=4,
            spatial_compression_ratio=4, temporal_compression_ratio=4, mid_block_add_attention=False,
        )  # fmt: skip
        return HunyuanVideoPipeline(
            text_encoder=tiny_parts.llama_encoder(len(tokenizer), hidden=16),  # hidden = text_embed_dim
            tokenizer=tokenizer,
            transformer=transformer,
            vae=vae,
            scheduler=FlowMatchEulerDiscreteScheduler(shift=shift),
            # the pipeline pads CLIP to 77 tokens whatever max_sequence_length says
            text_encoder_2=tiny_parts.clip_text_model(False, max_len=77),  # pooled 32 = pooled_projection_dim
            tokenizer_2=tiny_parts.clip_tokenizer(77),
        )
