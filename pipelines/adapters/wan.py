"""Wan 2.1 text-to-video (1.3B / 14B): WanTransformer3DModel, a UMT5 text encoder, AutoencoderKLWan, flow matching.

What WanPipeline does, and where it lives here:

- Latents are 5-D [B, C, F, h, w] (`video.VideoAdapter`): F = (num_frames - 1) // scale_factor_temporal + 1 latent
  frames (81 frames -> 21), h, w = pixels // scale_factor_spatial.
- Text: UMT5 last hidden states of the real tokens, zero-padded to `max_sequence_length` (512); the transformer
  gets no mask and attends to the zero rows, so cached rows keep the full padded length.
- Time: the transformer is conditioned on t = 1000 sigma and predicts the flow velocity (noise - data).
- CFG: uncond + w (cond - uncond) (the pipeline runs two forwards; here one batched forward, or two with
  `cfg_forward = "split"`).
- Schedule: the published checkpoints ship UniPCMultistepScheduler with flow sigmas (flow_shift 3.0 at 480p, 5.0 at
  720p); `flow_grid` walks that scheduler's own sigma grid, and the integer timesteps it feeds the model
  (model_sigmas). With a FlowMatchEulerDiscreteScheduler the sampler's default grid applies. The sampler's kernels
  (Euler / SDE) replace UniPC's multistep update; only the grid is shared.
- Decode: latents * std + mean per channel, then the VAE, which decodes one latent frame at a time with its causal
  cache (temporal chunks: memory does not grow with the frame count); `vae_tiling=True` also decodes in spatial
  tiles, and the VAE's slicing decodes one video at a time. Videos come back as [B, F, 3, H, W] in [0, 1].

Wan 2.2 pipelines (two experts with `boundary_ratio`, or TI2V's per-token timesteps) are refused here, not
silently mis-sampled: they are family "wan2.2" (`wan22.Wan22Adapter`).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor

from . import tiny_parts
from .video import VideoAdapter

# The published transformer configs (Wan-AI/Wan2.1-T2V-{1.3B,14B}-Diffusers, transformer/config.json), as specs:
# `WanTransformer3DModel(**WAN_SPECS[name])` builds the architecture (on the meta device: no memory).
_COMMON = dict(
    patch_size=(1, 2, 2), in_channels=16, out_channels=16, text_dim=4096, freq_dim=256, cross_attn_norm=True,
    qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024,
)  # fmt: skip
WAN_SPECS: dict[str, dict[str, Any]] = {
    "wan2.1-t2v-1.3b": {**_COMMON, "num_attention_heads": 12, "attention_head_dim": 128, "ffn_dim": 8960,
                        "num_layers": 30},
    "wan2.1-t2v-14b": {**_COMMON, "num_attention_heads": 40, "attention_head_dim": 128, "ffn_dim": 13824,
                       "num_layers": 40},
}  # fmt: skip
DEFAULT_FLOW_SHIFT = {480: 3.0, 720: 5.0}  # the Wan 2.1 recipes' flow_shift by output height


class WanAdapter(VideoAdapter):
    family = "wan"
    pipeline_class = "WanPipeline"
    # self- (attn1) and cross-attention (attn2) projections of every block: blocks.N.attn{1,2}.{to_q,...}
    lora_targets = ("to_q", "to_k", "to_v", "to_out.0")
    default_max_sequence_length = 512  # WanPipeline's
    block_names = ("blocks",)
    default_num_frames = 81  # Wan 2.1's 5 s at 16 fps
    spatial_scale_key, temporal_scale_key = "scale_factor_spatial", "scale_factor_temporal"

    def __init__(self, pipe: Any, **kw: Any):
        self._check_pipeline(pipe)
        super().__init__(pipe, **kw)

    @classmethod
    def _check_pipeline(cls, pipe: Any) -> None:
        if getattr(pipe, "transformer_2", None) is not None or pipe.config.get("boundary_ratio") is not None:
            raise ValueError("wan: a two-expert pipeline (Wan 2.2 A14B, boundary_ratio): use family 'wan2.2'")
        if pipe.config.get("expand_timesteps"):
            raise ValueError("wan: per-token timesteps (Wan 2.2 TI2V, expand_timesteps): use family 'wan2.2'")

    # ---- geometry (frames, latent shape, tokens: video.VideoAdapter) ----------------------------

    def _latent_channels(self) -> int:
        return int(self.vae.config.z_dim)

    @classmethod
    def resolution_problem(cls, height: int, width: int, denoiser_config: Any, vae_config: Any) -> Optional[str]:
        if problem := cls.multiple_problem(height, width, denoiser_config, vae_config):
            return problem
        cells = cls.vae_scale_of(vae_config) * cls.patch_of(denoiser_config)
        largest = denoiser_config.get("rope_max_seq_len")  # RoPE positions per axis
        if largest and max(height, width) // cells > largest:
            return f"wan: {height}x{width} px is larger than this model takes ({largest * cells} px a side)"
        return None

    def flow_grid(self, num_steps: int, height: int, width: int, shift: float | None) -> Any:
        """The published scheduler's own grid (UniPC / DPM with flow sigmas); None for FlowMatchEuler (default)."""
        config = self.scheduler_config
        if not config.get("use_flow_sigmas"):
            return None
        from pipelines.schedules import FlowSchedule

        scheduler = type(self.pipe.scheduler).from_config(
            {**config, **({} if shift is None else {"flow_shift": shift})}
        )
        scheduler.set_timesteps(num_steps)
        sigmas = scheduler.sigmas.float()
        timesteps = scheduler.timesteps.float()  # integers: what the pipeline conditions the model on
        n = config.get("num_train_timesteps", 1000)
        return FlowSchedule(sigmas, timesteps, model_sigmas=timesteps / n)

    # ---- prompts and the denoiser --------------------------------------------------------------

    def _encode(self, texts: list[str]) -> dict[str, Tensor]:
        embeds, _ = self.pipe.encode_prompt(
            prompt=list(texts), do_classifier_free_guidance=False, max_sequence_length=self.max_sequence_length,
            device=self.device,
        )  # fmt: skip
        return {"embeds": embeds.to(self.dtype)}  # zero-padded to max_sequence_length, as the pipeline feeds them

    def _forward(self, x: Tensor, sigma: Tensor, text: dict[str, Tensor | None], guidance: float | None) -> Tensor:
        t = sigma * self.pipe.scheduler.config.num_train_timesteps
        return self.denoiser(hidden_states=x, timestep=t, encoder_hidden_states=text["embeds"], return_dict=False)[0]

    # ---- video ---------------------------------------------------------------------------------

    def _unscale(self, z: Tensor) -> Tensor:
        """latents * std + mean per channel (the pipeline's)."""
        cfg = self.vae.config
        mean = torch.tensor(cfg.latents_mean).view(1, cfg.z_dim, 1, 1, 1).to(z.device, z.dtype)
        inv_std = 1.0 / torch.tensor(cfg.latents_std).view(1, cfg.z_dim, 1, 1, 1).to(z.device, z.dtype)
        return z / inv_std + mean

    # ---- construction --------------------------------------------------------------------------

    @classmethod
    def _tiny_pipeline(cls, scheduler: str = "unipc", flow_shift: float = 3.0) -> Any:
        """Wan 2.1-like at test size: 4 latent channels, 2x temporal / 4x spatial VAE, 2 blocks. `scheduler`:
        "unipc" (the published one: UniPC with flow sigmas) or "euler" (FlowMatchEulerDiscreteScheduler)."""
        from diffusers import (
            AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, UniPCMultistepScheduler, WanPipeline,
            WanTransformer3DModel,
        )  # fmt: skip
        from transformers import UMT5Config, UMT5EncoderModel

        tokenizer = tiny_parts.t5_tokenizer()
        text_encoder = UMT5EncoderModel(
            UMT5Config(vocab_size=len(tokenizer), d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                       pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)
        )  # fmt: skip
        transformer = WanTransformer3DModel(
            patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=4,
            text_dim=32, freq_dim=16, ffn_dim=32, num_layers=2, rope_max_seq_len=32,
        )  # fmt: skip
        vae = AutoencoderKLWan(
            base_dim=4, z_dim=4, dim_mult=[1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True],
            latents_mean=[0.1, -0.2, 0.3, 0.0], latents_std=[1.5, 0.8, 1.2, 2.0],
            scale_factor_temporal=2, scale_factor_spatial=4,
        )  # fmt: skip
        if scheduler == "unipc":
            sched = UniPCMultistepScheduler(
                prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=flow_shift
            )
        elif scheduler == "euler":
            sched = FlowMatchEulerDiscreteScheduler(shift=flow_shift)
        else:
            raise ValueError(f"wan: tiny scheduler must be 'unipc' or 'euler', got '{scheduler}'")
        return WanPipeline(
            tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, scheduler=sched, transformer=transformer
        )
