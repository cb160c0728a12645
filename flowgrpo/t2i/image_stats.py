"""Image statistics that betray reward hacking, on decoded images [B, 3, H, W] in [0, 1] (no weights, no downloads).
Video clips [B, F, 3, H, W] (a video family's decode): every frame counts as an image, diversity is between clips.

saturation        HSV saturation (max - min) / max per pixel, averaged over the image (0: grey, 1: pure hues).
                  Over-saturation is the classic hack of aesthetic / preference rewards.
clipped           share of channel values within `tol` (2/255) of 0 or 1: blown-out highlights, crushed shadows.
grid8, grid16     share of the luma's non-DC spectral power that lies on the lattice of a p-periodic pattern
                  (p = 8, 16 pixels: the VAE stride and VAE stride x patch size, where the grid artifacts of
                  flow_grpo #204 live). A pattern that repeats every p pixels has its whole spectrum on the bins
                  (u, v) with u a multiple of H/p and v a multiple of W/p, so an exactly p-periodic image scores 1.
                  The lattice has p^2 bins: white noise scores (p^2 - 1) / (HW - 1) (grid8 of a 32 x 32 image: 0.062); smooth natural
                  images less at large sizes. The image is cropped to a multiple of p first (NaN below 2p).
                  grid16's lattice contains grid8's, so grid16 >= grid8.
high_freq         share of non-DC luma power at radial frequencies above a quarter of the sampling rate
                  (fine noise, speckle, checkerboards).
diversity         mean pairwise RMS distance between the images of a group, each downsampled to 16 x 16 by area
                  (0: identical images; mode collapse drives it down). One value per group.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

REC601 = (0.299, 0.587, 0.114)
CLIP_TOL = 2.0 / 255.0
DIVERSITY_SIZE = 16
GRID_PERIODS = (8, 16)


def _luma(x: torch.Tensor) -> torch.Tensor:
    w = torch.tensor(REC601, dtype=x.dtype, device=x.device)
    return torch.einsum("bchw,c->bhw", x, w)


def saturation(x: torch.Tensor) -> torch.Tensor:
    """[B] mean HSV saturation."""
    hi, lo = x.amax(1), x.amin(1)
    s = torch.where(hi > 1e-6, (hi - lo) / hi.clamp_min(1e-6), torch.zeros_like(hi))
    return s.flatten(1).mean(1)


def clipped_fraction(x: torch.Tensor, tol: float = CLIP_TOL) -> torch.Tensor:
    """[B] share of channel values <= tol or >= 1 - tol."""
    return ((x <= tol) | (x >= 1 - tol)).flatten(1).float().mean(1)


def _power(y: torch.Tensor) -> torch.Tensor:
    """|FFT|^2 of the mean-free luma [B, H, W] (the DC bin is then 0)."""
    y = y - y.mean((1, 2), keepdim=True)
    return torch.fft.fft2(y.double()).abs().pow(2)


def _varies(total: torch.Tensor, pixels: int) -> torch.Tensor:
    """Whether the luma varies at all: total power (Parseval: pixels^2 x its variance) above rounding noise."""
    return total > 1e-12 * pixels**2


def grid_energy(x: torch.Tensor, period: int) -> torch.Tensor:
    """[B] share of non-DC luma power on the lattice of a `period`-periodic pattern (module docstring)."""
    H, W = (x.shape[-2] // period) * period, (x.shape[-1] // period) * period
    if H < 2 * period or W < 2 * period:
        return torch.full((x.shape[0],), math.nan)
    p = _power(_luma(x[..., :H, :W].float()))
    u = torch.arange(H) % (H // period) == 0
    v = torch.arange(W) % (W // period) == 0
    on = (u[:, None] & v[None, :]).to(p.device)
    total = p.flatten(1).sum(1)
    grid = (p * on).flatten(1).sum(1)
    return torch.where(_varies(total, H * W), grid / total.clamp_min(1e-30), torch.zeros_like(total)).float()


def high_freq_energy(x: torch.Tensor, cutoff: float = 0.25) -> torch.Tensor:
    """[B] share of non-DC luma power at radial frequency > cutoff cycles per pixel (Nyquist: 0.5)."""
    H, W = x.shape[-2:]
    p = _power(_luma(x.float()))
    fu, fv = torch.fft.fftfreq(H).abs(), torch.fft.fftfreq(W).abs()
    high = ((fu[:, None] ** 2 + fv[None, :] ** 2).sqrt() > cutoff).to(p.device)
    total = p.flatten(1).sum(1)
    share = (p * high).flatten(1).sum(1) / total.clamp_min(1e-30)
    return torch.where(_varies(total, H * W), share, torch.zeros_like(total)).float()


def group_diversity(x: torch.Tensor, group_size: int, size: int = DIVERSITY_SIZE) -> torch.Tensor:
    """[P] mean pairwise RMS distance within each group of `group_size` consecutive images (NaN: a group of 1);
    clips [B, F, 3, H, W]: between whole clips, every frame downsampled."""
    B = x.shape[0]
    if group_size < 2 or B % group_size:
        return torch.full((max(B // max(group_size, 1), 1),), math.nan)
    frames = x.float().flatten(0, x.dim() - 4)  # [B (x F), 3, H, W]
    small = F.adaptive_avg_pool2d(frames, (min(size, x.shape[-2]), min(size, x.shape[-1])))
    flat = small.flatten(1).view(B // group_size, group_size, -1)
    d = torch.cdist(flat.double(), flat.double()) / math.sqrt(flat.shape[-1])  # [P, G, G] RMS distances
    off = ~torch.eye(group_size, dtype=torch.bool, device=d.device)
    return d[:, off].mean(1).float()


def image_stats(images: torch.Tensor, group_size: int) -> dict[str, float]:
    """Mean of each statistic over the images, or over every frame of clips [B, F, 3, H, W] (diversity: over the
    groups); keys as in the module docstring."""
    x = images.detach().float().clamp(0, 1).cpu()
    frames = x.flatten(0, 1) if x.dim() == 5 else x  # a clip's frames are images of their own
    out = {
        "saturation": saturation(frames),
        "clipped": clipped_fraction(frames),
        **{f"grid{p}": grid_energy(frames, p) for p in GRID_PERIODS},
        "high_freq": high_freq_energy(frames),
        "diversity": group_diversity(x, group_size),
    }
    return {k: float(v.nanmean()) if bool(torch.isfinite(v).any()) else math.nan for k, v in out.items()}
