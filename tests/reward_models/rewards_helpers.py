"""Helpers shared by the reward_models tests (a uniquely named module: tests/ has other conftests).

Images are multiples of 1/255 so the uint8 round trip (PIL, PNG over the wire) is exact and local
and remote scores can be compared for equality.
"""

import torch

PROMPTS = ["a red cat", "a red cat", "a blue dog on a bike", "", "a red cat"]


def quantised_images(n: int, h: int = 32, w: int = 32, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, 3, h, w), generator=g).float() / 255.0
