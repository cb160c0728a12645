"""A toy velocity / epsilon model with the adapter contract, for sampler tests that need no diffusers model."""

from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class ToyEmbeds:
    cond: torch.Tensor  # [B, C]

    def index(self, idx):
        return ToyEmbeds(self.cond[idx])


class ToyAdapter:
    family = "toy"

    def __init__(self, prediction="velocity", channels=4, seed=0):
        torch.manual_seed(seed)
        self.prediction = prediction
        self.channels = channels
        self.denoiser = nn.Conv2d(channels, channels, 1)
        self.scheduler_config = {"shift": 3.0} if prediction == "velocity" else {}
        self.calls = 0

    def latent_shape(self, height, width):
        return (self.channels, height // 8, width // 8)

    def encode_prompts(self, prompts, negative_prompt=""):
        return ToyEmbeds(torch.stack([torch.full((self.channels,), float(len(p)) / 10) for p in prompts]))

    def model_output(self, latents, t, embeds, guidance_scale, cfg_mode="full"):
        self.calls += 1
        t = t.float().view(-1, 1, 1, 1) / (1000.0 if self.prediction == "epsilon" else 1.0)
        base = self.denoiser(latents.float())
        cond = base + embeds.cond.view(-1, self.channels, 1, 1) * (1 + t)
        if cfg_mode == "none":
            return cond
        uncond = base.detach() if cfg_mode == "detach_uncond" else base
        return uncond + guidance_scale * (cond - uncond)
