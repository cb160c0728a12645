"""FLUX.2 [klein] (4B / 9B, distilled and base): Flux2Transformer2DModel, a Qwen3 text encoder, flow matching.

What Flux2KleinPipeline does, and where it lives here:

- Latents: the VAE's 2x2 patches are the model's channels ([B, 4C, h/2, w/2]), batch-normalised with the VAE's
  `bn` running statistics, then flattened to tokens. The sampler sees the un-patchified normalised latent
  [B, C, h, w] (a permutation of the pipeline's: its Gaussian noise is the same distribution, and log-probs are
  means over latent dims); `pack` (FLUX's 2x2 layout, the same channel order c*4 + 2*dy + dx) makes the tokens.
  Decode un-normalises per patch channel, un-patchifies and runs the VAE (no scaling / shift factors).
- Position ids are 4-d (t, h, w, l): image tokens (0, row, col, 0), text tokens (0, 0, 0, index).
- Text: the prompt as a Qwen3 chat turn, padded to `max_sequence_length` (every token, padding included, goes to
  the transformer: no mask), hidden states of layers `text_encoder_out_layers` (9, 18, 27) concatenated.
- Guidance: no guidance embedding. The base models use true CFG with the empty negative prompt (w 4.0 by default);
  the step-distilled models (`is_distilled` in the pipeline config) run without CFG (cfg_mode "none", 4 steps).
- Schedule: `compute_empirical_mu(image tokens, steps)` shifts a uniform grid linspace(1, 1/n, n) (`flow_grid`):
  mu depends on the step count too, not only on the image size as FLUX.1's.

Editing (`Flux2KleinEditAdapter`, family "flux2_edit"): Flux2KleinPipeline's `image=` path. Each source image goes
through the VAE (the distribution's mode), 2x2-patchified, batch-normalised with the VAE's `bn` statistics and
flattened to tokens, appended after the generated tokens; reference i gets position ids (10 + 10 i, row, col, 0).
The text encoder sees only the instruction; the references are the same in both CFG branches; only the generated
tokens' output is the action. Any number of reference images per prompt.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from . import tiny_qwen3
from .base import Adapter
from .editing import EditAdapter, to_vae_input
from .flux import pack, unpack

PIPELINE_OUT_LAYERS = (9, 18, 27)  # Flux2KleinPipeline's text_encoder_out_layers
TINY_OUT_LAYERS = (1, 2, 3)  # the tiny 3-layer Qwen3


def empirical_mu(image_seq_len: int, num_steps: int) -> float:
    """FLUX.2's shift exponent (Flux2KleinPipeline's `compute_empirical_mu`): two lines in the token count, at 10
    and 200 steps, interpolated linearly in the step count; above 4300 tokens the 200-step line alone."""
    a1, b1 = 8.73809524e-05, 1.89833333
    a2, b2 = 0.00016927, 0.45666666
    if image_seq_len > 4300:
        return float(a2 * image_seq_len + b2)
    m_200 = a2 * image_seq_len + b2
    m_10 = a1 * image_seq_len + b1
    a = (m_200 - m_10) / 190.0
    return float(a * num_steps + m_200 - 200.0 * a)


class Flux2Adapter(Adapter):
    family = "flux2"
    prediction = "velocity"
    pipeline_class = "Flux2KleinPipeline"
    denoiser_name = "transformer"
    # Attention projections of the double-stream blocks and the fused QKV + MLP-in projection of the single-stream
    # blocks (their `attn.to_out` shares its name with the double blocks' ModuleList, so a name list cannot pick it).
    lora_targets = (
        "to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out", "to_qkv_mlp_proj",
    )  # fmt: skip
    default_max_sequence_length = 512  # the pipeline's
    tiny_max_sequence_length = 48  # the tiny byte tokenizer: chat template (~30) + a short prompt
    block_names = ("transformer_blocks", "single_transformer_blocks")

    options = (*Adapter.options, "text_encoder_out_layers")

    def __init__(self, pipe: Any, *, text_encoder_out_layers: Sequence[int] = PIPELINE_OUT_LAYERS, **kw: Any):
        super().__init__(pipe, **kw)
        layers = tuple(int(i) for i in text_encoder_out_layers)
        depth = pipe.text_encoder.config.num_hidden_layers
        if not layers or not all(0 <= i <= depth for i in layers):
            raise ValueError(f"flux2: text_encoder_out_layers {layers} must lie in [0, {depth}] (the encoder's layers)")
        self.text_encoder_out_layers = layers
        if pipe.transformer.config.guidance_embeds:
            raise ValueError(
                "flux2: a transformer with a guidance embedding is FLUX.2 [dev] (Flux2Pipeline), not klein"
            )
        self._ids: dict[tuple, tuple[Tensor, Tensor]] = {}

    @property
    def is_distilled(self) -> bool:
        """Step-distilled klein (4 steps, no CFG: sample with cfg_mode none) rather than a base model."""
        return bool(self.pipe.config.get("is_distilled", False))

    def _latent_channels(self) -> int:
        return self.denoiser.config.in_channels // 4

    @classmethod
    def patch_of(cls, denoiser_config: Any) -> int:
        return 2  # the VAE latent's 2x2 patches are the transformer's tokens

    def flow_grid(self, num_steps: int, height: int, width: int, shift: float | None) -> Any:
        """The pipeline's grid: uniform sigmas shifted by `empirical_mu` of the image tokens and the step count."""
        from pipelines.schedules import flow_schedule

        config = self.scheduler_config
        if not config.get("use_dynamic_shifting"):  # the pipeline's mu is then unused: the config's static shift
            return flow_schedule(num_steps, shift=shift, spacing="uniform", config=config)
        if shift is not None:
            raise ValueError(
                "flux2: sampler.shift does not apply: FLUX.2 shifts by mu from the image tokens and the step count "
                "(leave shift unset, or use schedule {name: time_shift, shift: ...})"
            )
        mu = empirical_mu(self.image_seq_len(height, width), num_steps)
        return flow_schedule(num_steps, mu=mu, spacing="uniform", config=config)

    def _encode(self, texts: list[str]) -> dict[str, Tensor]:
        embeds, _ = self.pipe.encode_prompt(
            prompt=list(texts), device=self.device, max_sequence_length=self.max_sequence_length,
            text_encoder_out_layers=self.text_encoder_out_layers,
        )  # fmt: skip
        return {"embeds": embeds.to(self.dtype)}

    def _forward(self, x: Tensor, sigma: Tensor, text: dict[str, Tensor | None], guidance: float | None) -> Tensor:
        _, _, h, w = x.shape
        embeds = text["embeds"]
        img_ids, txt_ids = self._position_ids(h, w, embeds.shape[1], x.device)
        out = self.denoiser(
            hidden_states=pack(x),
            timestep=sigma.to(x.dtype),  # the pipeline passes t / 1000 = sigma in the latents' dtype
            guidance=None,
            encoder_hidden_states=embeds,
            txt_ids=txt_ids,
            img_ids=img_ids,
            return_dict=False,
        )[0]
        return unpack(out, h, w)

    def _position_ids(self, h: int, w: int, text_len: int, device: Any) -> tuple[Tensor, Tensor]:
        """(image ids [h/2 * w/2, 4] = (0, row, col, 0), text ids [L, 4] = (0, 0, 0, l)), built once per size."""
        key = (h, w, text_len, str(device))
        if key not in self._ids:
            zero = torch.zeros(1, dtype=torch.long)
            img = torch.cartesian_prod(zero, torch.arange(h // 2), torch.arange(w // 2), zero)
            txt = torch.cartesian_prod(zero, zero, zero, torch.arange(text_len))
            self._ids[key] = (img.to(device), txt.to(device))
        return self._ids[key]

    def _decode(self, latents: Tensor) -> Tensor:
        vae = self.vae
        patches = F.pixel_unshuffle(latents.to(vae.dtype), 2)  # [B, 4C, h/2, w/2], channel c*4 + 2*dy + dx
        mean = vae.bn.running_mean.view(1, -1, 1, 1).to(patches)
        std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps).to(patches)
        image = vae.decode(F.pixel_shuffle(patches * std + mean, 2), return_dict=False)[0]
        return (image.float() / 2 + 0.5).clamp(0, 1)

    @classmethod
    def tiny(cls, seed: int = 0, dtype: torch.dtype = torch.float32, device: Any = "cpu", **kw: Any) -> "Adapter":
        kw.setdefault("text_encoder_out_layers", TINY_OUT_LAYERS)
        return super().tiny(seed=seed, dtype=dtype, device=device, **kw)

    @classmethod
    def _tiny_pipeline(cls, is_distilled: bool = False) -> Any:
        """is_distilled=False: klein base-like (CFG); True: the step-distilled klein."""
        from diffusers import AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler, Flux2KleinPipeline
        from diffusers import Flux2Transformer2DModel

        hidden = 16  # Qwen3 width: the transformer reads 3 of its layers concatenated
        transformer = Flux2Transformer2DModel(
            patch_size=1, in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=16,
            num_attention_heads=4, joint_attention_dim=3 * hidden, timestep_guidance_channels=32,
            axes_dims_rope=(4, 4, 4, 4), guidance_embeds=False,
        )  # fmt: skip
        vae = AutoencoderKLFlux2(
            down_block_types=("DownEncoderBlock2D",) * 2,
            up_block_types=("UpDecoderBlock2D",) * 2,
            block_out_channels=(8, 16),
            layers_per_block=1,
            latent_channels=4,
            norm_num_groups=4,
            sample_size=32,
            use_quant_conv=False,
            use_post_quant_conv=False,
            mid_block_add_attention=False,
        )  # fmt: skip  (no mid-block attention: a random one nearly flattens the decoded images' brightness)
        with torch.no_grad():  # non-trivial patch statistics, so that decode's un-normalisation is tested
            vae.bn.running_mean.normal_(0.0, 0.5)
            vae.bn.running_var.uniform_(0.5, 2.0)
        # FLUX.2's scheduler: dynamic shifting, mu given by the pipeline (base / max shift unused; released
        # values of the other keys not verified here).
        scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True, time_shift_type="exponential")
        return Flux2KleinPipeline(
            scheduler=scheduler, vae=vae, text_encoder=tiny_qwen3.causal_lm(hidden, layers=3),
            tokenizer=tiny_qwen3.tokenizer(), transformer=transformer, is_distilled=is_distilled,
        )  # fmt: skip


class Flux2KleinEditAdapter(EditAdapter, Flux2Adapter):
    """FLUX.2 [klein] image editing: the source images as reference tokens (see the module docstring)."""

    family = "flux2_edit"
    text_sees_images = False  # klein's Qwen3 reads the instruction only
    max_references = None  # the pipeline takes a list of images
    reference_time_scale = 10  # Flux2KleinPipeline._prepare_image_ids: t = scale + scale * i

    def __init__(self, pipe: Any, **kw: Any):
        super().__init__(pipe, **kw)
        self._ref_ids: dict[tuple, Tensor] = {}

    def _encode_edit_text(self, text: str, images: tuple[Tensor, ...]) -> dict[str, Tensor]:
        return self._encode([text])

    def _encode_reference(self, image: Tensor) -> tuple[Tensor, tuple[int, int]]:
        vae = self.vae
        x = to_vae_input(image).to(device=vae.device, dtype=vae.dtype)
        patches = F.pixel_unshuffle(vae.encode(x).latent_dist.mode(), 2)  # [1, 4C, h/2, w/2], the pipeline's order
        mean = vae.bn.running_mean.view(1, -1, 1, 1).to(patches)
        std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps).to(patches)
        patches = (patches - mean) / std
        h, w = patches.shape[2:]
        return patches.flatten(2).transpose(1, 2).to(self.dtype), (h, w)

    def _forward(self, x: Tensor, sigma: Tensor, text: dict[str, Tensor | None], guidance: float | None) -> Tensor:
        return self._per_layout(x, sigma, text, self._forward_layout)

    def _forward_layout(self, x: Tensor, sigma: Tensor, text: dict, layout: tuple) -> Tensor:
        _, _, h, w = x.shape
        embeds = text["embeds"]
        generated = pack(x)
        img_ids, txt_ids = self._position_ids(h, w, embeds.shape[1], x.device)
        out = self.denoiser(
            hidden_states=torch.cat([generated, text["reference"].to(x.dtype)], dim=1),
            timestep=sigma.to(x.dtype),
            guidance=None,
            encoder_hidden_states=embeds,
            txt_ids=txt_ids,
            img_ids=torch.cat([img_ids, self._reference_ids(layout, x.device)]),
            return_dict=False,
        )[0]
        return unpack(out[:, : generated.shape[1]], h, w)

    def _reference_ids(self, layout: tuple, device: Any) -> Tensor:
        """(10 + 10 i, row, col, 0) of reference i's token grid, all references in order, built once per layout."""
        key = (layout, str(device))
        if key not in self._ref_ids:
            one = torch.zeros(1, dtype=torch.long)
            parts = [
                torch.cartesian_prod(one + self.reference_time_scale * (i + 1), torch.arange(rh), torch.arange(rw), one)
                for i, (rh, rw) in enumerate(layout)
            ]
            self._ref_ids[key] = torch.cat(parts).to(device)
        return self._ref_ids[key]
