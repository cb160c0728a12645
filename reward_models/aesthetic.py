"""LAION aesthetic predictor v2 (improved-aesthetic-predictor, sac+logos+ava1-l14-linearMSE).

score = MLP(e / |e|), e = the projected CLIP-L/14 image embedding (768-d). The MLP is the published
one: 768 -> 1024 -> 128 -> 64 -> 16 -> 1 with dropout 0.2, 0.2, 0.1 and no activations (927,969
parameters; state-dict keys layers.{0,2,4,6,7}.{weight,bias}). Output on the 1-10 AVA scale.
The head runs in float32 whatever the backbone dtype, as the references do.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from .encoders import BackboneSettings, ClipBackbone, EmbeddingScorer
from .registry import register, with_settings

AESTHETIC_HIDDEN = (1024, 128, 64, 16)
AESTHETIC_DROPOUT = (0.2, 0.2, 0.1)
CLIP_L14_EMBED_DIM = 768


class AestheticHead(nn.Module):
    """The published MLP; module indices match the released state dict."""

    def __init__(self, input_dim: int = CLIP_L14_EMBED_DIM):
        super().__init__()
        h1, h2, h3, h4 = AESTHETIC_HIDDEN
        d1, d2, d3 = AESTHETIC_DROPOUT
        self.input_dim = input_dim
        self.layers = nn.Sequential(
            nn.Linear(input_dim, h1),
            nn.Dropout(d1),
            nn.Linear(h1, h2),
            nn.Dropout(d2),
            nn.Linear(h2, h3),
            nn.Dropout(d3),
            nn.Linear(h3, h4),
            nn.Linear(h4, 1),
        )

    def forward(self, embeds: torch.Tensor) -> torch.Tensor:
        return self.layers(embeds)

    @classmethod
    def from_file(cls, path: str | Path) -> "AestheticHead":
        """Load a safetensors state dict (strict: a missing or extra key is an error)."""
        from safetensors.torch import load_file

        state = load_file(str(path))
        if "layers.0.weight" not in state:
            raise ValueError(f"{path}: not an aesthetic head (keys: {sorted(state)[:8]})")
        head = cls(input_dim=state["layers.0.weight"].shape[1])
        head.load_state_dict(state, strict=True)
        return head.eval()

    def save(self, path: str | Path) -> None:
        from safetensors.torch import save_file

        save_file({k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}, str(path))


def convert_aesthetic_pth(src: str | Path, dst: str | Path) -> None:
    """One-off conversion of the released .pth head to safetensors. weights_only=True refuses
    anything but tensors, so no code from the file runs."""
    state = torch.load(str(src), map_location="cpu", weights_only=True)
    head = AestheticHead(input_dim=state["layers.0.weight"].shape[1])
    head.load_state_dict(state, strict=True)
    head.save(dst)


class AestheticScorer(EmbeddingScorer):
    """LAION aesthetic predictor: MLP on the L2-normalised CLIP image embedding."""

    name = "aesthetic"

    def __init__(self, backbone: ClipBackbone, head: AestheticHead, *, batch_size: int = 32, key: str | None = None):
        if head.input_dim != backbone.embed_dim:
            raise ValueError(
                f"aesthetic head expects {head.input_dim}-d embeddings, the CLIP projects to {backbone.embed_dim}"
            )
        super().__init__(backbone, batch_size=batch_size, key=key)
        self.head = head.eval().requires_grad_(False).to(device=backbone.device, dtype=torch.float32)

    def to(self, device=None, dtype=None):
        self.backbone.to(device, dtype)
        self.head.to(device=self.backbone.device)  # stays float32
        return self

    def score_batch(self, images, prompts, metadata):
        embeds = self.backbone.image_features(images)
        with torch.set_grad_enabled(embeds.requires_grad):
            return {self.key: self.head(embeds).squeeze(-1)}


@register("aesthetic")
@with_settings(BackboneSettings)
def build_aesthetic(
    *, head: str | None = None, batch_size: int = 32, key: str | None = None, **backbone
) -> AestheticScorer:
    """LAION aesthetic predictor v2 on CLIP-L/14; `head` is a safetensors file."""
    settings = BackboneSettings(**backbone)
    if head is None and not settings.tiny:  # checked before any download
        raise ValueError(
            "aesthetic needs head=<path to the head as .safetensors>; convert the released "
            "sac+logos+ava1-l14-linearMSE.pth with reward_models.aesthetic.convert_aesthetic_pth"
        )
    mlp = AestheticHead.from_file(head) if head is not None else None
    clip = settings.load_clip()
    if mlp is None:  # tiny: a random head sized to the tiny CLIP
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            mlp = AestheticHead(input_dim=clip.embed_dim)
    return AestheticScorer(clip, mlp, batch_size=batch_size, key=key)
