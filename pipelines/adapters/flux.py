"""FLUX.1 dev / schnell: FluxTransformer2DModel, CLIP-L (pooled) + T5 text encoders, flow matching.

The sampler sees unpacked latents [B, C, h, w]; 2x2 patches are packed into tokens only around the
transformer call. dev has a guidance embedding (guidance-distilled): with cfg_mode "none" the
guidance_scale goes to that embedding; in the CFG modes ("true CFG" with a negative prompt) the
embedding gets `embedded_guidance` (3.5, the FluxPipeline default). schnell has no such embedding.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from . import tiny_parts
from .base import Adapter


def pack(x: Tensor) -> Tensor:
    """[N, C, h, w] -> [N, h/2 * w/2, 4C] tokens of 2x2 patches (FLUX's layout): token channel c*4 + 2*dy + dx."""
    n, c, h, w = x.shape
    if x.requires_grad:  # pixel_unshuffle: the same elements, and a plain copy back for the gradient
        return F.pixel_unshuffle(x, 2).reshape(n, c * 4, (h // 2) * (w // 2)).transpose(1, 2).contiguous()
    order = _order("pack", x.shape, x.device, lambda i: i.view(n, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5))
    return x.reshape(-1).index_select(0, order).view(n, (h // 2) * (w // 2), c * 4)


def unpack(tokens: Tensor, h: int, w: int) -> Tensor:
    """Inverse of `pack` for latents of height h and width w (contiguous [N, C, h, w])."""
    n, _, d = tokens.shape
    if tokens.requires_grad:
        return F.pixel_shuffle(tokens.transpose(1, 2).reshape(n, d, h // 2, w // 2), 2).contiguous()
    c = d // 4
    order = _order("unpack", (n, c, h, w), tokens.device,
                   lambda i: i.view(n, h // 2, w // 2, c, 2, 2).permute(0, 3, 1, 4, 2, 5))  # fmt: skip
    return tokens.reshape(-1).index_select(0, order).view(n, c, h, w)


_ORDERS: dict[tuple, Tensor] = {}


def _order(kind: str, shape: Any, device: Any, permute: Any) -> Tensor:
    """Flat source index of every output element of pack / unpack for one shape, built once: one gather moves
    the elements 3-4x faster than the 6-d permute copy, whose inner runs are 2 elements long. Without grad only
    (a permutation's gradient through index_select would be added onto zeros, turning -0.0 into +0.0)."""
    key = (kind, tuple(shape), str(device))
    order = _ORDERS.get(key)
    if order is None:
        if len(_ORDERS) >= 16:
            _ORDERS.clear()
        with torch.inference_mode(False):
            order = permute(torch.arange(math.prod(shape), device=device)).reshape(-1)
        _ORDERS[key] = order
    return order


def image_ids(h: int, w: int, device: Any, dtype: torch.dtype) -> Tensor:
    """[h/2 * w/2, 3] rotary positions (0, row, col) of the packed tokens."""
    rows, cols = torch.meshgrid(torch.arange(h // 2), torch.arange(w // 2), indexing="ij")
    ids = torch.stack([torch.zeros_like(rows), rows, cols], dim=-1).reshape(-1, 3)
    return ids.to(device=device, dtype=dtype)


class FluxAdapter(Adapter):
    family = "flux"
    prediction = "velocity"
    pipeline_class = "FluxPipeline"
    denoiser_name = "transformer"
    # Attention projections of the double-stream blocks (image + text) and single-stream blocks.
    lora_targets = ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out")
    default_max_sequence_length = 512  # FLUX.1-dev's T5 length (schnell: 256, set in __init__)
    block_names = ("transformer_blocks", "single_transformer_blocks")  # double- then single-stream

    options = (*Adapter.options, "embedded_guidance")

    def __init__(self, pipe: Any, *, embedded_guidance: float = 3.5, max_sequence_length: int | None = None, **kw):
        if max_sequence_length is None and not pipe.transformer.config.guidance_embeds:
            max_sequence_length = 256  # schnell's T5 length
        super().__init__(pipe, max_sequence_length=max_sequence_length, **kw)
        self.embedded_guidance = embedded_guidance
        self._ids: dict[tuple, Tensor] = {}  # image_ids by (h, w, device, dtype)

    @property
    def guidance_embeds(self) -> bool:
        return bool(self.denoiser.config.guidance_embeds)

    def _latent_channels(self) -> int:
        return self.denoiser.config.in_channels // 4

    @classmethod
    def patch_of(cls, denoiser_config: Any) -> int:
        return 2  # 2x2 packing

    def _encode(self, texts: list[str]) -> dict[str, Tensor]:
        embeds, pooled, _ = self.pipe.encode_prompt(
            prompt=texts, prompt_2=None, device=self.device, max_sequence_length=self.max_sequence_length
        )
        return {"embeds": embeds.to(self.dtype), "pooled": pooled.to(self.dtype)}

    def _guidance(self, n: int, guidance: float | None, device: torch.device) -> Tensor | None:
        """The embedded guidance per row (FLUX.1-dev, Kontext); None for a model without the embedding."""
        if not self.guidance_embeds:
            return None
        scale = self.embedded_guidance if guidance is None else guidance
        return torch.full((n,), float(scale), device=device, dtype=torch.float32)

    def _forward(self, x: Tensor, sigma: Tensor, text: dict[str, Tensor | None], guidance: float | None) -> Tensor:
        n, _, h, w = x.shape
        g = self._guidance(n, guidance, x.device)
        embeds = text["embeds"]
        out = self.denoiser(
            hidden_states=pack(x),
            timestep=sigma,  # FluxPipeline passes t / 1000 = sigma; the model scales by 1000 itself
            guidance=g,
            pooled_projections=text["pooled"],
            encoder_hidden_states=embeds,
            txt_ids=torch.zeros(embeds.shape[1], 3, device=x.device, dtype=x.dtype),
            img_ids=self._image_ids(h, w, x.device, x.dtype),
            return_dict=False,
        )[0]
        return unpack(out, h, w)

    def _image_ids(self, h: int, w: int, device: Any, dtype: torch.dtype) -> Tensor:
        """`image_ids`, built once per latent size (the transformer only reads them)."""
        key = (h, w, str(device), dtype)
        if key not in self._ids:
            self._ids[key] = image_ids(h, w, device, dtype)
        return self._ids[key]

    @classmethod
    def _tiny_pipeline(cls, guidance_embeds: bool = True) -> Any:
        """guidance_embeds=True: dev-like; False: schnell-like."""
        from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel

        transformer = FluxTransformer2DModel(
            patch_size=1, in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=16,
            num_attention_heads=4, joint_attention_dim=64, pooled_projection_dim=32,
            guidance_embeds=guidance_embeds, axes_dims_rope=(4, 6, 6),
        )  # fmt: skip
        # FLUX.1's scheduler: resolution-dependent shift (mu from the image sequence length).
        scheduler = FlowMatchEulerDiscreteScheduler(
            shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
            base_image_seq_len=256, max_image_seq_len=4096,
        )  # fmt: skip
        return FluxPipeline(
            scheduler=scheduler,
            vae=tiny_parts.vae(4, shift_factor=0.1159, scaling_factor=0.3611, use_quant_conv=False,
                               use_post_quant_conv=False),
            text_encoder=tiny_parts.clip_text_model(False),  # pooled 32 = pooled_projection_dim
            tokenizer=tiny_parts.clip_tokenizer(),
            text_encoder_2=tiny_parts.t5_encoder(64),  # d_model = joint_attention_dim
            tokenizer_2=tiny_parts.t5_tokenizer(),
            transformer=transformer,
        )  # fmt: skip
