"""What every text-to-video adapter shares: 5-D latents [B, C, F, h, w], the frame count, and decoding to frames.

A video family sets `default_num_frames`, the names of its VAE config's spatial / temporal compression ratios
(`spatial_scale_key`, `temporal_scale_key`), and un-scales latents for its VAE in `_unscale`. Then:

- F = (num_frames - 1) // temporal_scale + 1 latent frames; `latent_shape(height, width)` returns (C, F, h, w) with the
  adapter's `num_frames`, so the sampler draws video noise without knowing about frames (kernels, log-probs and the
  rollout tree are shape-agnostic; a log-prob is the mean over every latent dim, frames included).
- `image_seq_len`: the video tokens the transformer sees (F / pt) x (h / p) x (w / p).
- The VAE decodes one video at a time (slicing); `vae_tiling` adds its spatial tiles. Videos come back as
  [B, F, 3, H, W] in [0, 1] (the pipelines' "pt" output).
"""

from __future__ import annotations

import abc
from typing import Any, ClassVar, Optional

import torch
from torch import Tensor

from .base import Adapter


class VideoAdapter(Adapter):
    """The video geometry and decode over `Adapter`. See the module docstring."""

    latent_ndim = 5
    default_num_frames: ClassVar[int]
    tiny_num_frames: ClassVar[int] = 5
    spatial_scale_key: ClassVar[str]  # the VAE config's spatial compression ratio (pixels per latent cell)
    temporal_scale_key: ClassVar[str]  # the VAE config's temporal compression ratio
    options = (*Adapter.options, "num_frames", "vae_tiling")

    def __init__(self, pipe: Any, *, num_frames: int | None = None, vae_tiling: bool = False, **kw: Any):
        super().__init__(pipe, **kw)
        self.num_frames = int(num_frames or self.default_num_frames)
        if problem := self.frames_problem(self.num_frames):
            raise ValueError(problem)
        self.vae.enable_slicing()  # one video at a time through the VAE
        if vae_tiling:
            self.vae.enable_tiling()
        self.vae_tiling = bool(vae_tiling)

    @classmethod
    def tiny(cls, seed: int = 0, dtype: torch.dtype = torch.float32, device: Any = "cpu", **kw: Any) -> "Adapter":
        kw.setdefault("num_frames", cls.tiny_num_frames)
        return super().tiny(seed=seed, dtype=dtype, device=device, **kw)

    # ---- geometry ------------------------------------------------------------------------------

    @classmethod
    def vae_scale_of(cls, vae_config: Any) -> int:
        return int(vae_config[cls.spatial_scale_key])

    @classmethod
    def patch_of(cls, denoiser_config: Any) -> int:
        # diffusers' video transformers give patch_size as (t, h, w) (Wan) or as the side, with patch_size_t
        patch = denoiser_config["patch_size"]
        return int(patch[1] if isinstance(patch, (list, tuple)) else patch)

    def _temporal_patch(self) -> int:
        """Latent frames per video token, from the denoiser's config."""
        config = self.denoiser.config
        patch = config["patch_size"]
        return int(patch[0] if isinstance(patch, (list, tuple)) else config.get("patch_size_t") or 1)

    @property
    def temporal_scale(self) -> int:
        return int(self.vae.config[self.temporal_scale_key])

    def frames_problem(self, num_frames: int) -> Optional[str]:
        k = self.temporal_scale
        if num_frames < 1 or (num_frames - 1) % k:
            return (
                f"{self.family}: num_frames must be 1 + a multiple of {k} (e.g. {4 * k + 1}, "
                f"{self.default_num_frames}), got {num_frames}"
            )
        return None

    def latent_frames(self, num_frames: int | None = None) -> int:
        return (int(num_frames or self.num_frames) - 1) // self.temporal_scale + 1

    def latent_shape(self, height: int, width: int, num_frames: int | None = None) -> tuple[int, ...]:
        """Video latent (C, F, h, w) for `num_frames` (default: the adapter's) of height x width pixels."""
        frames = int(num_frames or self.num_frames)
        problem = self.frames_problem(frames) or self.resolution_problem(
            height, width, self.denoiser.config, self.vae.config
        )
        if problem:
            raise ValueError(problem)
        s = self.vae_scale_factor
        return (self._latent_channels(), self.latent_frames(frames), height // s, width // s)

    def image_seq_len(self, height: int, width: int) -> int:
        """Video tokens the transformer sees: latent frames / pt x (h / p) x (w / p)."""
        _, f, h, w = self.latent_shape(height, width)
        p = self._patch_size()
        return (f // self._temporal_patch()) * (h // p) * (w // p)

    # ---- video ---------------------------------------------------------------------------------

    def _decode(self, latents: Tensor) -> Tensor:
        """[B, C, F, h, w] -> frames [B, F', 3, H, W] in [0, 1] (F' = the pixel frame count)."""
        vae = self.vae
        z = latents.to(device=next(vae.parameters()).device, dtype=vae.dtype)
        video = vae.decode(self._unscale(z), return_dict=False)[0]  # [B, 3, F', H, W] in [-1, 1]
        return (video.float() / 2 + 0.5).clamp(0, 1).permute(0, 2, 1, 3, 4).contiguous()

    @abc.abstractmethod
    def _unscale(self, z: Tensor) -> Tensor:
        """Latents as the family's VAE decodes them (its scaling / per-channel statistics undone)."""
