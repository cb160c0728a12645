"""GARDO: gated and adaptive regularisation with diversity-aware optimisation, over Flow-GRPO and DiffusionNFT.

What the authors' code does (tinnerhrhe/GARDO @ 1cc77fb; its Flow-GRPO script is also in yifan123/flow_grpo @
94e23ee as scripts/train_sd3_gardo.py, config/grpo_gardo.py, flow_grpo/stat_tracking.py), per iteration:

1. Reference reset (train_sd3_grpo_gardo.py, main loop, "if config.train.beta>0"; train_sd3_nft_gardo.py, the same
   block): the KL reference is a LoRA adapter of its own ("old" / "old_ref"), a copy of the policy at the start. After
   sampling, if (it != 0 and a reset was flagged) or it - last_reset > reset_freq (15): reference <- policy. A reset
   is flagged when an optimizer step's mean KL term exceeds kl_thres (GRPO: 3e-4, config kl_thres; NFT: 0.15 at the
   start, then at each reset thres <- max(thres - 0.01, 0.1) if the gap was > 15 and min(thres + 0.01, 0.05) if < 5:
   `kl_threshold_adapt`; the release's constants, the ceiling below the start value included).
2. Advantage (PerPromptStatTracker.update type 'gardo'; PerPromptStatTrackerNFT.update): the MAIN reward only
   (config.main_reward, unweighted), per group A_i = (R_i - mean_group R) * w_i, no std division, with
   w_i = 1 where R_i < mean, else d_i / mean_group(d),   d_i = min_{j != i} (1 - cos(f_i, f_j)),
   f = DINOv3 features of the image (timm vit_large_patch16_dinov3.lvd1689m), L2-normalised.
3. Uncertainty gate (the main loop after the stat tracker): global 1-based descending ranks of the main reward and
   of the auxiliary rewards (aesthetic, imagereward) over the whole batch; u_i = rank_main_i - mean_aux rank_i.
   The RiskCompensator takes mean(u[u >= 0]) and keeps the gated fraction kl_perc in [0.02, 0.2] (starts 0.1,
   x1.1 when that mean beats the max of its last 20 values, x0.9 below their min). threshold = percentile(u[u >= 0],
   100 - 100 kl_perc) (numpy linear); gated_i = u_i > threshold.
4. KL only on gated samples: GRPO  beta mean_{gated} mean_d (mu - mu_ref)^2 / (2 std_dev_t^2) (flow_grpo's KL;
   a micro-batch without gated samples adds 0); NFT  beta mean_{gated} mean_d (v - v_ref)^2 (a micro-batch without
   gated samples takes every sample: `ungated: all`). beta: 0.04 (OCR), 0.07 (GenEval), 0.01 (FLUX), 0.04 (NFT).
Our normalisation: each micro-batch's gated mean is weighted by its share of the mini-batch's rows, which is the
release's mean over micro-batches when they are equal. The sign of u is the release's: a sample is gated where the
main reward ranks it LOWER than the auxiliary rewards do (not where it over-rates it). Ties in ranks: stable order
(the release's torch.sort is unstable). Not ported: the GRPO script's `std_dev_t / mean(std_dev_t)` loss weight
(1 in its layout: every row of a micro-batch is the same step), NFT's `select_per` (computed, never used).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Optional

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import Tensor

from ..core import StrictModel


class RiskControllerConfig(StrictModel):
    """The RiskCompensator: the gated fraction kl_perc, adapted to the mean positive uncertainty."""

    base: float = Field(0.1, gt=0, le=1)
    rate: float = Field(0.1, ge=0, lt=1)
    low: float = Field(0.02, gt=0, le=1)
    high: float = Field(0.2, gt=0, le=1)
    window: int = Field(20, ge=1)


class ThresholdAdapt(StrictModel):
    """At each reset: thres <- max(thres - down, floor) if the gap exceeded slow_after; min(thres + up, ceiling) if
    it was below fast_before (train_sd3_nft_gardo.py's constants by default)."""

    slow_after: int = 15
    down: float = 0.01
    floor: float = 0.1
    fast_before: int = 5
    up: float = 0.01
    ceiling: float = 0.05


class DiversityConfig(StrictModel):
    enabled: bool = True
    features: Literal["pixels", "timm"] = "pixels"  # pixels: pooled RGB (tiny runs); timm: the release's DINOv3
    pixel_size: int = Field(8, ge=1)
    model: str = "vit_large_patch16_dinov3.lvd1689m"
    weights: Optional[str] = None  # timm: a local weights file (pretrained_cfg_overlay file); None: the hub's


class GardoConfig(StrictModel):
    """GARDO (methods grpo_gardo, nft_gardo: flowgrpo/t2i/gardo_methods.py)."""

    main_reward: Optional[str] = None  # the reward label that makes the advantage (None: the first reward)
    reward_scale: float = Field(1.0, gt=0)  # A uses scale x the raw main reward (release: 1; no std division)
    uncertainty_rewards: list[str] = Field(default_factory=list)  # auxiliary labels; none: every sample is gated
    kl_coef: float = Field(0.04, ge=0)  # beta of the gated KL (0: no reference, no gate)
    kl_fraction: RiskControllerConfig = Field(default_factory=RiskControllerConfig)
    ungated: Literal["none", "all"] = "none"  # a micro-batch without gated rows: no KL (GRPO) / every row (NFT)
    reset_every: int = Field(15, ge=1)  # reference <- policy when this many iterations passed without a reset
    kl_threshold: float = Field(3e-4, ge=0)  # an optimizer step's mean KL above it flags a reset
    kl_threshold_adapt: Optional[ThresholdAdapt] = None
    adv_clip_max: float = Field(5.0, gt=0)  # grpo_gardo: A clipped to +-this (nft_gardo: nft.adv_max)
    diversity: DiversityConfig = Field(default_factory=DiversityConfig)


# --- the formulas --------------------------------------------------------------------------------


def descending_ranks(x: Tensor) -> Tensor:
    """1-based ranks, the largest value 1 (ties: the earlier sample first), float64."""
    order = torch.sort(x.double(), descending=True, stable=True).indices
    ranks = torch.empty(x.numel(), dtype=torch.float64)
    ranks[order] = torch.arange(1, x.numel() + 1, dtype=torch.float64)
    return ranks


def uncertainty(main: Tensor, aux: Tensor) -> Tensor:
    """u = rank(main) - mean_a rank(aux_a) over the whole batch; main [N], aux [N, A]."""
    aux_ranks = torch.stack([descending_ranks(aux[:, a]) for a in range(aux.shape[1])], 1)
    return descending_ranks(main) - aux_ranks.mean(1)


def gate(u: Tensor, fraction: float) -> tuple[Tensor, float]:
    """(u > the (100 - 100 fraction)-th percentile of u[u >= 0] (linear), that threshold)."""
    pos = u[u >= 0].double()
    if pos.numel() == 0:
        return torch.zeros_like(u, dtype=torch.bool), float("inf")
    thr = float(torch.quantile(pos, 1.0 - fraction))
    return u > thr, thr


@dataclass
class RiskController:
    """The release's RiskCompensator (state: the gated fraction and the last `window` means)."""

    cfg: RiskControllerConfig
    fraction: float = 0.1
    buffer: list[float] = field(default_factory=list)

    def update(self, mean_u: float) -> float:
        c = self.cfg
        if not self.buffer:
            self.fraction = c.base
        elif mean_u > max(self.buffer):
            self.fraction *= 1 + c.rate
        elif mean_u < min(self.buffer):
            self.fraction *= 1 - c.rate
        self.fraction = min(max(self.fraction, c.low), c.high)
        self.buffer = (self.buffer + [mean_u])[-c.window :]
        return self.fraction


def diversity_weights(rewards: Tensor, features: Tensor) -> Tensor:
    """w [P, G] from rewards [P, G] (NaN: not scored, left out) and features [P, G, D]: 1 below the group mean, else
    the nearest-neighbour cosine distance over its group mean (1 where a group's images are all alike)."""
    f = F.normalize(features.double(), dim=-1)
    dist = 1 - (f @ f.transpose(1, 2)).clamp(-1, 1)  # [P, G, G]
    valid = torch.isfinite(rewards)
    pair_ok = valid.unsqueeze(1) & valid.unsqueeze(2) & ~torch.eye(rewards.shape[1], dtype=torch.bool)
    d = torch.where(pair_ok, dist, torch.full_like(dist, torch.inf)).amin(2)  # nearest other scored image
    d = torch.where(valid & torch.isfinite(d), d, torch.zeros_like(d))
    count = valid.sum(1, keepdim=True).clamp_min(1)
    mean_d = d.sum(1, keepdim=True) / count
    r = torch.where(valid, rewards.double(), torch.zeros_like(rewards.double()))
    mean_r = r.sum(1, keepdim=True) / count
    ratio = torch.where(mean_d > 0, d / mean_d.clamp_min(1e-300), torch.ones_like(d))
    return torch.where(r - mean_r < 0, torch.ones_like(d), ratio)


def gardo_advantages(rewards: Tensor, features: Optional[Tensor]) -> Tensor:
    """A [P, G] = (R - mean_group R) * w (w = 1 without features); NaN rewards: A = 0 (float64)."""
    valid = torch.isfinite(rewards)
    r = torch.where(valid, rewards.double(), torch.zeros_like(rewards.double()))
    mean_r = r.sum(1, keepdim=True) / valid.sum(1, keepdim=True).clamp_min(1)
    w = diversity_weights(rewards, features) if features is not None else torch.ones_like(r)
    return torch.where(valid, (r - mean_r) * w, torch.zeros_like(r))


# --- image features ------------------------------------------------------------------------------

_MODELS: dict[str, Any] = {}


@torch.no_grad()
def image_features(images: Tensor, cfg: DiversityConfig) -> Tensor:
    """[N, D] features of images [N, 3, H, W] in [0, 1]: pooled RGB, or a timm model's pooled output (DINOv3)."""
    if cfg.features == "pixels":
        return F.adaptive_avg_pool2d(images.float(), cfg.pixel_size).flatten(1).cpu()
    key = f"{cfg.model}:{cfg.weights}"
    if key not in _MODELS:  # loaded once per process; untested here (needs the weights)
        import timm

        overlay = {"file": cfg.weights} if cfg.weights else None
        model = timm.create_model(cfg.model, pretrained=True, pretrained_cfg_overlay=overlay).eval()
        data_cfg = timm.data.resolve_model_data_config(model)
        _MODELS[key] = (model.to(images.device), data_cfg)
    model, data_cfg = _MODELS[key]
    size = data_cfg["input_size"][1:]
    x = F.interpolate(images.float(), size=size, mode="bicubic", align_corners=False)
    mean = torch.tensor(data_cfg["mean"], device=x.device).view(1, 3, 1, 1)
    std = torch.tensor(data_cfg["std"], device=x.device).view(1, 3, 1, 1)
    return model((x - mean) / std).float().cpu()


# --- the reference schedule ----------------------------------------------------------------------


@dataclass
class ReferenceSchedule:
    """When the reference adapter is reset to the policy (state: the flag, the last reset, the threshold)."""

    cfg: GardoConfig
    threshold: float = 0.0
    flagged: bool = False
    last: int = 0

    def __post_init__(self) -> None:
        self.threshold = self.threshold or self.cfg.kl_threshold

    def due(self, iteration: int) -> bool:
        """Whether to reset before training iteration `iteration` (0-based); adapts the threshold when it does."""
        gap = iteration - self.last
        if not ((iteration != 0 and self.flagged) or gap > self.cfg.reset_every):
            return False
        self.flagged = False
        a = self.cfg.kl_threshold_adapt
        if a is not None:
            if gap > a.slow_after:
                self.threshold = max(self.threshold - a.down, a.floor)
            if gap < a.fast_before:
                self.threshold = min(self.threshold + a.up, a.ceiling)
        self.last = iteration
        return True

    def observe(self, step_kl: list[float]) -> None:
        """The mean KL term of each optimizer step of the iteration."""
        if any(k > self.threshold for k in step_kl):
            self.flagged = True

    def state_dict(self) -> dict[str, Any]:
        return {"threshold": self.threshold, "flagged": self.flagged, "last": self.last}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.threshold, self.flagged, self.last = float(state["threshold"]), bool(state["flagged"]), int(state["last"])
