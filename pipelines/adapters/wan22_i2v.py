"""Wan 2.2 TI2V-5B image-to-video (family "wan2.2_i2v"), over diffusers' WanImageToVideoPipeline.

TI2V-5B is one text + image model; `wan22.Wan22Adapter` runs it as text-to-video. Image-to-video, as
WanImageToVideoPipeline runs it with `expand_timesteps=True` (diffusers 0.42, pipelines/wan/pipeline_wan_i2v.py):
- the conditioning image, resized to the video size, goes through the VAE as a one-frame video (the latent
  distribution's mode), normalised (z - mean) / std per channel: the first latent frame;
- every step the transformer sees [that frame; the noisy frames] with per-token timesteps mask * t (0 on the first
  frame's tokens, t on the others); the scheduler steps every frame and the first is overwritten again
  (latents = (1 - mask) * condition + mask * latents), so only the other frames' velocity ever matters;
- no CLIP image encoder (TI2V's transformer has no image_dim), no channel-concatenated mask (that is Wan 2.1 /
  Wan2.2-I2V-A14B's I2V, not supported here).

Here the prompts are editing rows (`editing.EditPrompt`, a `data.path` .jsonl with "images": [one path]), and the
policy's latent is the generated frames alone: `latent_shape` gives (C, F - 1, h, w). The conditioning frame is a
reference latent like the editing families' (`editing.EditAdapter`: encoded once per image, cached, a constant:
no gradient reaches it). `_forward` puts it in front of the generated frames and returns the generated frames'
output, so the sampler's kernels draw noise, and read log-probs, over the generated frames only (the action), and
the first frame is the encoded image at every step of a rollout and of its re-score. Because the pipeline's
elementwise scheduler update of the generated frames never reads the first frame, this is the pipeline's loop.

Decoding needs the first frame: `decode(latents, prompts)` (one prompt per row) decodes [first frame; generated
frames] into the whole clip, whose first frame is the image's VAE reconstruction (the Wan VAE is causal in time).
"""

from __future__ import annotations

import threading
from typing import Any, Optional, Sequence

import torch
from torch import Tensor

from .editing import EditAdapter, EditPrompt, to_vae_input
from .wan22 import Wan22Adapter


class Wan22I2VAdapter(EditAdapter, Wan22Adapter):
    family = "wan2.2_i2v"
    pipeline_class = "WanImageToVideoPipeline"
    text_sees_images = False  # UMT5 reads the text alone: the negative prompt's rows are shared by every image
    max_references = 1  # the first frame

    def __init__(self, pipe: Any, **kw: Any):
        # the Wan VAE keeps its causal cache on the module: a reference encoded by the rollout thread while a reward
        # worker decodes would corrupt both, so the VAE is used under one lock
        self._vae_lock = threading.Lock()
        super().__init__(pipe, **kw)

    @classmethod
    def _check_pipeline(cls, pipe: Any) -> None:
        if getattr(pipe, "transformer_2", None) is not None or pipe.config.get("boundary_ratio") is not None:
            raise ValueError(
                "wan2.2_i2v: image-to-video of TI2V-5B (one transformer, expand_timesteps); a two-expert pipeline "
                "(Wan2.2-I2V-A14B: channel-concatenated condition) is not supported"
            )
        if not pipe.config.get("expand_timesteps"):
            raise ValueError(
                "wan2.2_i2v: the pipeline must have expand_timesteps=True (TI2V-5B: the first latent frame clean); "
                "a Wan 2.1 I2V pipeline is not supported"
            )
        config = pipe.transformer.config
        if config.get("image_dim") is not None:
            raise ValueError("wan2.2_i2v: a transformer with a CLIP image input (image_dim) is Wan 2.1 I2V, not TI2V")
        if config["patch_size"][0] != 1:
            raise ValueError(
                f"wan2.2_i2v: the first frame is its own tokens: temporal patch 1, got {config['patch_size']}"
            )

    # ---- geometry: the policy's latent is the generated frames -----------------------------------

    def frames_problem(self, num_frames: int) -> Optional[str]:
        if problem := super().frames_problem(num_frames):
            return problem
        if num_frames < 1 + self.temporal_scale:
            k = self.temporal_scale
            return f"wan2.2_i2v: num_frames must give a frame after the image: at least {1 + k}, got {num_frames}"
        return None

    def latent_shape(self, height: int, width: int, num_frames: int | None = None) -> tuple[int, ...]:
        """(C, F - 1, h, w): the generated latent frames (the first one is the conditioning image's)."""
        c, f, h, w = super().latent_shape(height, width, num_frames)
        return (c, f - 1, h, w)

    def image_seq_len(self, height: int, width: int) -> int:
        """Video tokens the transformer sees: the conditioning frame's too."""
        c, f, h, w = self.latent_shape(height, width)
        p = self._patch_size()
        return (f + 1) // self._temporal_patch() * (h // p) * (w // p)

    # ---- prompts: text + the first frame ----------------------------------------------------------

    def _encode_edit_text(self, text: str, images: tuple[Tensor, ...]) -> dict[str, Tensor]:
        return self._encode([text])

    def _encode_reference(self, image: Tensor) -> tuple[Tensor, tuple[int, int]]:
        """The image as the pipeline's first latent frame, as tokens [1, h w, C] (channels last) on an (h, w) grid."""
        vae = self.vae
        x = to_vae_input(image)[:, :, None].to(device=vae.device, dtype=vae.dtype)  # a one-frame video
        with self._vae_lock:
            z = vae.encode(x).latent_dist.mode().float()  # retrieve_latents(sample_mode="argmax")
        cfg = vae.config
        mean = torch.tensor(cfg.latents_mean).view(1, cfg.z_dim, 1, 1, 1).to(z.device, z.dtype)
        inv_std = 1.0 / torch.tensor(cfg.latents_std).view(1, cfg.z_dim, 1, 1, 1).to(z.device, z.dtype)
        z = (z - mean) * inv_std  # the pipeline's arithmetic (prepare_latents)
        h, w = z.shape[-2:]
        return z[:, :, 0].flatten(2).transpose(1, 2).to(self.dtype), (int(h), int(w))

    def first_frames(self, prompts: Sequence[str]) -> Tensor:
        """The conditioning latent frames [N, C, 1, h, w] of `prompts` (EditPrompts), cached per image."""
        self._check(prompts)
        frames = []
        for p in prompts:
            # read, never reorder or fill, the cache: decode also runs on reward threads beside the rollout's
            # encode_prompts; an image evicted since its rollout is encoded again here
            hit = self._references.get(p.image_key)  # type: ignore[attr-defined]
            if hit is not None:
                frames.append(_frame(hit[0], tuple(hit[1][0].tolist())))
            else:
                frames.append(_frame(*self._encode_reference(p.images[0])))  # type: ignore[attr-defined]
        return torch.cat(frames)

    # ---- the denoiser ------------------------------------------------------------------------------

    def _forward(self, x: Tensor, sigma: Tensor, text: dict[str, Tensor | None], guidance: float | None) -> Tensor:
        return self._per_layout(x, sigma, text, self._forward_layout)

    def _forward_layout(self, x: Tensor, sigma: Tensor, text: dict, layout: tuple) -> Tensor:
        (grid,) = layout
        if tuple(x.shape[-2:]) != grid:
            raise ValueError(
                f"wan2.2_i2v: the image's latent grid {grid} differs from the video's {tuple(x.shape[-2:])}: "
                "data images are resized to the sampler's height x width"
            )
        first = _frame(text["reference"], grid).to(x.dtype)
        model = self.denoiser
        _, ph, pw = model.config.patch_size  # temporal patch 1 (_check_pipeline): one token row per frame
        per_frame = (grid[0] // ph) * (grid[1] // pw)
        t = sigma * self.pipe.scheduler.config.num_train_timesteps
        # mask * t per token: 0 on the conditioning frame's tokens (clean), t on the generated frames'
        timestep = torch.cat([t.new_zeros(t.shape[0], per_frame), t[:, None].expand(-1, x.shape[2] * per_frame)], 1)
        out = model(
            hidden_states=torch.cat([first, x], dim=2), timestep=timestep, encoder_hidden_states=text["embeds"],
            return_dict=False,
        )[0]  # fmt: skip
        return out[:, :, 1:]  # the generated frames' velocity: the action

    # ---- video ---------------------------------------------------------------------------------

    def decode(self, latents: Tensor, prompts: Sequence[str] | None = None) -> Tensor:
        """Clips [B, F, 3, H, W] in [0, 1] of generated latents [B, C, F - 1, h, w] and their prompts (one per row):
        each decoded after its prompt's first frame, as the pipeline decodes (its first frame: the image's
        reconstruction)."""
        if prompts is None or isinstance(prompts, str) or len(prompts) != latents.shape[0]:
            got = "none" if prompts is None else f"{1 if isinstance(prompts, str) else len(prompts)}"
            raise ValueError(
                f"wan2.2_i2v decodes with the prompts' first frames: decode(latents, prompts) with one prompt per "
                f"row ({latents.shape[0]}), got {got}"
            )
        first = self.first_frames(prompts).to(device=latents.device, dtype=latents.dtype)
        with self._vae_lock:
            return super().decode(torch.cat([first, latents], dim=2))

    # ---- construction --------------------------------------------------------------------------

    @classmethod
    def _tiny_pipeline(cls, scheduler: str = "unipc", flow_shift: float = 5.0) -> Any:  # type: ignore[override]
        """The tiny TI2V pipeline of `Wan22Adapter` ("ti2v": 8 latent channels, 8x spatial) as
        WanImageToVideoPipeline (no image encoder). `scheduler`: "unipc" or "euler"."""
        from diffusers import WanImageToVideoPipeline

        parts = Wan22Adapter._tiny_pipeline(variant="ti2v", scheduler=scheduler, flow_shift=flow_shift).components
        keep = ("tokenizer", "text_encoder", "vae", "scheduler", "transformer")
        return WanImageToVideoPipeline(**{k: parts[k] for k in keep}, expand_timesteps=True)


def _frame(tokens: Any, grid: tuple[int, int]) -> Tensor:
    """Reference tokens [N, >= h w, C] (zero-padded) -> latent frames [N, C, 1, h, w]."""
    h, w = grid
    n, _, c = tokens.shape
    return tokens[:, : h * w].transpose(1, 2).reshape(n, c, 1, h, w)


__all__ = ["EditPrompt", "Wan22I2VAdapter"]
