"""Qwen-Image-Edit and Qwen-Image-Edit-Plus (2509 / 2511): QwenImageTransformer2DModel with reference latents and
a Qwen2.5-VL text encoder that sees the source image(s).

What enters the denoiser, as QwenImageEditPipeline / QwenImageEditPlusPipeline build it:
- text: the pipeline's own `encode_prompt(prompt, image)`: its chat template with the image placeholder(s), the
  processor's pixel patches through the VL encoder, the template's first tokens dropped. The negative prompt is
  encoded with the same image(s), so each source has its own uncond row. Edit: the VL encoder sees the source
  image; Plus: "Picture k:" placeholders and each image resized to `condition_area` pixels (384 x 384 as the
  pipeline) at its aspect ratio.
- reference latents: each source image through the VAE (mode, (z - latents_mean) / latents_std), packed into
  2x2 tokens after the generated image's tokens; `img_shapes` = [generated grid, each reference grid] gives each
  its own rotary frame. Only the generated tokens' output is kept. Several images (Plus) are concatenated in order.

Resolution: the pipelines resize the VAE input (and Edit's VL input) to about 1024 x 1024 pixels at the image's
aspect; here the source arrives at the configured height x width (the data loader resizes it) and is used as it
is, unless `reference_area` is set: then it is resized to that many pixels first, as the pipelines do
(`reference_area: 1048576` reproduces them exactly, at the cost of 4x more reference tokens at 512 px).

The tiny model (`tiny()`): a random Qwen2.5-VL built from transformers' config (2 text layers of width 16, one
vision block with 4 px patches merged 2x2) with a byte-level tokenizer that knows the chat and vision markers,
and a Qwen2VLProcessor whose image processor keeps images between 16 x 16 and 64 x 64 pixels: the VL encoder
sees every source image as the real one does, only smaller.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
from torch import Tensor

from .editing import EditAdapter, to_pil, to_vae_input
from .flux import pack, unpack
from .qwenimage import QwenImageAdapter


def area_dimensions(area: int, height: int, width: int) -> tuple[int, int]:
    """(height, width) of about `area` pixels at height / width's aspect, multiples of 32 (the pipelines' rule)."""
    ratio = width / height
    w = math.sqrt(area * ratio)
    return int(round(w / ratio / 32) * 32), int(round(w / 32) * 32)


class QwenImageEditAdapter(EditAdapter, QwenImageAdapter):
    family = "qwenimage_edit"
    pipeline_class = "QwenImageEditPipeline"
    text_sees_images = True
    max_references = 1
    options = (*QwenImageAdapter.options, "reference_area")

    def __init__(self, pipe: Any, *, reference_area: int | None = None, **kw: Any):
        super().__init__(pipe, **kw)
        self.reference_area = reference_area

    def _resized(self, image: Tensor, area: int | None) -> Any:
        """The source as a PIL image, resized to `area` pixels (the pipeline's image processor) when set."""
        pil = to_pil(image)
        if area is None:
            return pil
        h, w = area_dimensions(area, pil.height, pil.width)
        return self.pipe.image_processor.resize(pil, h, w)

    def _vl_images(self, images: tuple[Tensor, ...]) -> Any:
        return self._resized(images[0], self.reference_area)

    def _encode_edit_text(self, text: str, images: tuple[Tensor, ...]) -> dict[str, Tensor]:
        embeds, mask = self.pipe.encode_prompt([text], image=self._vl_images(images), device=self.device)
        if mask is None:
            mask = torch.ones(embeds.shape[:2], dtype=torch.long, device=embeds.device)
        return {"embeds": embeds.to(self.dtype), "mask": mask}

    def _encode_reference(self, image: Tensor) -> tuple[Tensor, tuple[int, int]]:
        vae, cfg = self.vae, self.vae.config
        if self.reference_area is not None:
            pil = self._resized(image, self.reference_area)
            image = torch.from_numpy(np.asarray(pil).copy()).permute(2, 0, 1)
        x = to_vae_input(image)[:, :, None].to(device=vae.device, dtype=vae.dtype)
        z = vae.encode(x).latent_dist.mode()
        shape = (1, cfg.z_dim, 1, 1, 1)
        mean = torch.tensor(cfg.latents_mean, device=z.device, dtype=z.dtype).view(shape)
        std = torch.tensor(cfg.latents_std, device=z.device, dtype=z.dtype).view(shape)
        z = ((z - mean) / std)[:, :, 0]
        h, w = z.shape[2:]
        return pack(z.to(self.dtype)), (h // 2, w // 2)

    def _forward(self, x: Tensor, sigma: Tensor, text: dict[str, Tensor | None], guidance: float | None) -> Tensor:
        return self._per_layout(x, sigma, text, self._forward_layout)

    def _forward_layout(self, x: Tensor, sigma: Tensor, text: dict, layout: tuple) -> Tensor:
        n, _, h, w = x.shape
        mask = text["mask"]
        generated = pack(x)
        out = self.denoiser(
            hidden_states=torch.cat([generated, text["reference"].to(x.dtype)], dim=1),
            timestep=sigma.to(x.dtype),
            encoder_hidden_states=text["embeds"],
            encoder_hidden_states_mask=None if mask is None or bool(mask.all()) else mask,
            img_shapes=[[(1, h // 2, w // 2), *[(1, rh, rw) for rh, rw in layout]]] * n,
            return_dict=False,
        )[0]
        return unpack(out[:, : generated.shape[1]], h, w)

    @classmethod
    def _tiny_pipeline(cls) -> Any:
        from diffusers import QwenImageEditPipeline

        return QwenImageEditPipeline(**_tiny_components())


class QwenImageEditPlusAdapter(QwenImageEditAdapter):
    family = "qwenimage_edit_plus"
    pipeline_class = "QwenImageEditPlusPipeline"
    max_references = None
    options = (*QwenImageEditAdapter.options, "condition_area")

    def __init__(self, pipe: Any, *, condition_area: int = 384 * 384, **kw: Any):
        super().__init__(pipe, **kw)
        self.condition_area = condition_area

    def _vl_images(self, images: tuple[Tensor, ...]) -> Any:
        return [self._resized(im, self.condition_area) for im in images]

    @classmethod
    def _tiny_pipeline(cls) -> Any:
        from diffusers import QwenImageEditPlusPipeline

        return QwenImageEditPlusPipeline(**_tiny_components())


def _tiny_components() -> dict[str, Any]:
    """Qwen-Image's tiny transformer / VAE / scheduler + a tiny Qwen2.5-VL with a vision tower, its tokenizer and
    processor (seeded by the caller)."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2Tokenizer, Qwen2VLProcessor
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

    from . import tiny_parts

    base = QwenImageAdapter._tiny_pipeline()
    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
               "<|video_pad|>"]  # fmt: skip
    tokens = [*tiny_parts._byte_chars(), *special]
    ids = {t: i for i, t in enumerate(tokens)}
    tokenizer = Qwen2Tokenizer(vocab=ids, merges=[], model_max_length=4096, additional_special_tokens=special[1:])
    text = dict(
        hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
        vocab_size=len(tokens), max_position_embeddings=4096, rope_theta=1e6,
        rope_scaling={"type": "mrope", "rope_type": "default", "mrope_section": [1, 1, 2]},
        bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"],
    )  # fmt: skip
    patch = dict(patch_size=4, temporal_patch_size=2)
    vision = dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=16, window_size=16,
                  fullatt_block_indexes=[0], spatial_merge_size=2, **patch)  # fmt: skip
    text_encoder = Qwen2_5_VLForConditionalGeneration(
        Qwen2_5_VLConfig(
            text_config=text, vision_config=vision, image_token_id=ids["<|image_pad|>"],
            video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
            vision_end_token_id=ids["<|vision_end|>"],
        )
    )  # fmt: skip
    pixels = dict(merge_size=2, min_pixels=16 * 16, max_pixels=64 * 64, **patch)
    processor = Qwen2VLProcessor(
        image_processor=Qwen2VLImageProcessor(**pixels), tokenizer=tokenizer,
        video_processor=Qwen2VLVideoProcessor(**pixels),
    )  # fmt: skip
    return dict(
        scheduler=base.scheduler, vae=base.vae, transformer=base.transformer, text_encoder=text_encoder,
        tokenizer=tokenizer, processor=processor,
    )  # fmt: skip
