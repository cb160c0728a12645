"""FLUX.1 Kontext: image editing with FluxTransformer2DModel (FluxKontextPipeline), CLIP-L + T5, flow matching.

The source image enters as FluxKontextPipeline feeds it: VAE latents (the distribution's mode, (z - shift) *
scale), packed into 2x2 tokens and concatenated after the generated image's tokens along the sequence, with
rotary positions (1, row, col): the generated tokens' positions with the first axis set to 1. The denoiser's
output for the reference tokens is dropped. The text encoders see only the instruction, so the negative prompt's
rows are shared by every image; the reference tokens are the same in both CFG branches. One input image per
prompt (the pipeline's contract). Kontext dev is guidance-distilled: sample with cfg_mode "none" and the guidance
scale (2.5 in the pipeline) going to its embedding.

Resolution: the pipeline resizes the input to a preferred Kontext resolution (`_auto_resize`); here the data
loader has already resized it to the configured height x width, which reaches the VAE as it is.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from .editing import EditAdapter, to_vae_input
from .flux import FluxAdapter, image_ids, pack, unpack


class FluxKontextAdapter(EditAdapter, FluxAdapter):
    family = "flux_kontext"
    pipeline_class = "FluxKontextPipeline"
    text_sees_images = False
    max_references = 1

    def _encode_edit_text(self, text: str, images: tuple[Tensor, ...]) -> dict[str, Tensor]:
        return self._encode([text])

    def _encode_reference(self, image: Tensor) -> tuple[Tensor, tuple[int, int]]:
        vae = self.vae
        x = to_vae_input(image).to(device=vae.device, dtype=vae.dtype)
        z = vae.encode(x).latent_dist.mode()
        z = (z - (vae.config.shift_factor or 0.0)) * vae.config.scaling_factor
        h, w = z.shape[2:]
        return pack(z.to(self.dtype)), (h // 2, w // 2)

    def _forward(self, x: Tensor, sigma: Tensor, text: dict[str, Tensor | None], guidance: float | None) -> Tensor:
        return self._per_layout(x, sigma, text, lambda *a: self._forward_layout(*a, guidance=guidance))

    def _forward_layout(self, x: Tensor, sigma: Tensor, text: dict, layout: tuple, guidance: float | None) -> Tensor:
        n, _, h, w = x.shape
        g = self._guidance(n, guidance, x.device)
        embeds = text["embeds"]
        generated = pack(x)
        out = self.denoiser(
            hidden_states=torch.cat([generated, text["reference"].to(x.dtype)], dim=1),
            timestep=sigma,
            guidance=g,
            pooled_projections=text["pooled"],
            encoder_hidden_states=embeds,
            txt_ids=torch.zeros(embeds.shape[1], 3, device=x.device, dtype=x.dtype),
            img_ids=self._kontext_ids(h, w, layout, x.device, x.dtype),
            return_dict=False,
        )[0]
        return unpack(out[:, : generated.shape[1]], h, w)

    def _kontext_ids(self, h: int, w: int, layout: tuple, device: Any, dtype: torch.dtype) -> Tensor:
        """[generated ids (0, row, col); reference ids (1, row, col)], built once per layout."""
        key = ("kontext", h, w, layout, str(device), dtype)
        if key not in self._ids:
            parts = [image_ids(h, w, device, dtype)]
            for rh, rw in layout:
                ref = image_ids(2 * rh, 2 * rw, device, dtype)
                ref[:, 0] = 1
                parts.append(ref)
            self._ids[key] = torch.cat(parts)
        return self._ids[key]

    @classmethod
    def _tiny_pipeline(cls, guidance_embeds: bool = True) -> Any:
        from diffusers import FluxKontextPipeline

        return FluxKontextPipeline(**FluxAdapter._tiny_pipeline(guidance_embeds=guidance_embeds).components)
