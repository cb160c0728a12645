"""Z-Image (6B; Turbo: step-distilled, ~8 steps, no CFG): ZImageTransformer2DModel, a Qwen3 text encoder, flow
matching.

What ZImagePipeline does, and where it lives here:

- The transformer takes lists (one [C, 1, h, w] latent and one [L_i, D] caption per sample) and patchifies 2x2
  itself; latents are the FLUX.1 VAE's, scaled / shifted (base class decode).
- Time and sign: the model is conditioned on 1 - sigma (its "t" runs from noise 0 to data 1) and predicts
  data - noise, so the velocity (noise - data) is its output negated.
- Text: the prompt as a Qwen3 chat turn (thinking on), the encoder's second-to-last hidden states of the real
  tokens only: captions have per-prompt lengths (cached rows keep their real tokens; a batch is padded with a
  mask that `_forward` drops again). Caption length moves the image's RoPE positions, so padding must never reach
  the model.
- CFG, the pipeline's form: cond + w * (cond - uncond) (w = 0: no CFG, Z-Image-Turbo's setting), optionally with
  its norm cap `cfg_normalization` (> 0: the guided output's norm is capped at that multiple of cond's, per
  sample). Its `cfg_truncation` (CFG off late in sampling) is not supported: it needs the step, the combination
  does not see it.
- Schedule: uniform sigmas linspace(1, 1/n, n) under the scheduler config's shift (Turbo: static 3.0), or its
  dynamic shift from the image tokens when the config asks for it (`flow_grid`).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor

from . import tiny_parts, tiny_qwen3
from .base import Adapter


class ZImageAdapter(Adapter):
    family = "zimage"
    prediction = "velocity"
    pipeline_class = "ZImagePipeline"
    denoiser_name = "transformer"
    lora_targets = ("to_q", "to_k", "to_v", "to_out.0")  # the attention projections of every block
    default_max_sequence_length = 512  # the pipeline's
    tiny_max_sequence_length = 64  # the tiny byte tokenizer: chat template (~30) + a prompt
    block_names = ("noise_refiner", "context_refiner", "layers")  # image / caption refiners, then the main stack

    options = (*Adapter.options, "cfg_normalization")

    def __init__(self, pipe: Any, *, cfg_normalization: float = 0.0, **kw: Any):
        super().__init__(pipe, **kw)
        if cfg_normalization < 0:
            raise ValueError(f"zimage: cfg_normalization must be >= 0 (0: off), got {cfg_normalization}")
        self.cfg_normalization = float(cfg_normalization)

    @classmethod
    def patch_of(cls, denoiser_config: Any) -> int:
        return int(denoiser_config["all_patch_size"][0])

    @classmethod
    def resolution_problem(cls, height: int, width: int, denoiser_config: Any, vae_config: Any) -> Optional[str]:
        if problem := cls.multiple_problem(height, width, denoiser_config, vae_config):
            return problem
        # RoPE tables stop at axes_lens positions per axis (rows, columns of image tokens)
        cells = cls.vae_scale_of(vae_config) * cls.patch_of(denoiser_config)
        largest = min(denoiser_config["axes_lens"][1:])
        if max(height, width) // cells > largest:
            return (
                f"zimage: {height}x{width} px is larger than this model takes ({largest * cells} px a side); "
                "set a smaller height / width"
            )
        return None

    def flow_grid(self, num_steps: int, height: int, width: int, shift: float | None) -> Any:
        """The pipeline's grid: uniform sigmas, the config's static shift (or its dynamic one from the tokens)."""
        from pipelines.schedules import flow_schedule

        config = self.scheduler_config
        if config.get("use_dynamic_shifting"):
            if shift is not None:
                raise ValueError("zimage: sampler.shift does not apply to a scheduler with use_dynamic_shifting")
            seq = self.image_seq_len(height, width)
            return flow_schedule(num_steps, image_seq_len=seq, spacing="uniform", config=config)
        return flow_schedule(num_steps, shift=shift, spacing="uniform", config=config)

    def _encode(self, texts: list[str]) -> dict[str, Tensor]:
        rows, _ = self.pipe.encode_prompt(
            prompt=list(texts), device=self.device, do_classifier_free_guidance=False,
            max_sequence_length=self.max_sequence_length,
        )  # fmt: skip
        n = max(r.shape[0] for r in rows)
        embeds = torch.zeros(len(rows), n, rows[0].shape[-1], dtype=self.dtype, device=rows[0].device)
        mask = torch.zeros(len(rows), n, dtype=torch.long, device=rows[0].device)
        for i, r in enumerate(rows):  # real tokens first (the base class keeps a row's first mask.sum() tokens)
            embeds[i, : r.shape[0]] = r
            mask[i, : r.shape[0]] = 1
        return {"embeds": embeds, "mask": mask}

    def _forward(self, x: Tensor, sigma: Tensor, text: dict[str, Tensor | None], guidance: float | None) -> Tensor:
        embeds, mask = text["embeds"], text["mask"]
        captions = list(embeds.unbind(0)) if mask is None else [e[m.bool()] for e, m in zip(embeds, mask)]
        t = (1000 - sigma.float() * 1000) / 1000  # the pipeline's (1000 - timestep) / 1000, timestep = 1000 sigma
        out = self.denoiser(list(x.unsqueeze(2).unbind(0)), t, captions, return_dict=False)[0]
        return -torch.stack(out).squeeze(2)

    def _combine(self, uncond: Tensor, cond: Tensor, w: float) -> Tensor:
        guided = cond + w * (cond - uncond)
        if self.cfg_normalization <= 0:
            return guided
        cap = self.cfg_normalization * cond.flatten(1).norm(dim=1)
        norm = guided.flatten(1).norm(dim=1)
        scale = torch.where(norm > cap, cap / norm, torch.ones_like(norm))
        return guided * scale.view(-1, *([1] * (guided.dim() - 1)))

    @classmethod
    def _tiny_pipeline(cls, dynamic_shift: bool = False) -> Any:
        """Z-Image-Turbo-like (static shift 3); dynamic_shift=True: the scheduler shifts from the image tokens."""
        from diffusers import FlowMatchEulerDiscreteScheduler, ZImagePipeline, ZImageTransformer2DModel

        hidden = 16
        transformer = ZImageTransformer2DModel(
            all_patch_size=(2,), all_f_patch_size=(1,), in_channels=4, dim=32, n_layers=2, n_refiner_layers=1,
            n_heads=2, n_kv_heads=2, cap_feat_dim=hidden, axes_dims=[4, 6, 6], axes_lens=[256, 64, 64],
        )  # fmt: skip
        with torch.no_grad():  # learned pad tokens start at 0; make them count, as trained ones do
            transformer.x_pad_token.normal_()
            transformer.cap_pad_token.normal_()
        if dynamic_shift:
            scheduler = FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15)
        else:  # Z-Image-Turbo's scheduler_config: shift 3.0, no dynamic shifting
            scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=False)
        return ZImagePipeline(
            scheduler=scheduler,
            vae=tiny_parts.vae(4, shift_factor=0.1159, scaling_factor=0.3611, use_quant_conv=False,
                               use_post_quant_conv=False),  # the FLUX.1 VAE's factors
            text_encoder=tiny_qwen3.model(hidden, layers=2),
            tokenizer=tiny_qwen3.tokenizer(),
            transformer=transformer,
        )  # fmt: skip
