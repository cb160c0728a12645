"""dino_discriminator: Adv-GRPO's DINO-as-D reward, a frozen DINOv2 with a trainable MLP head.

Features: the DINOv2 output tokens after its final layer norm (images resized to 518x518, ImageNet
statistics: the Dinov2Backbone of encoders.py). The head h is D -> head_hidden -> GELU -> 1 in
`head_dtype` (float32 by default; Adv-GRPO casts it to bf16 and trains it so, with a plain Adam whose moments
are then bf16 too), applied to the CLS token and to `num_patches` patch tokens drawn at random per image, with
replacement, from a torch.Generator the scorer owns (its state is part of `state_tensors`).

    reward  r = cls_weight * h(n(cls)) + patch_weight * mean_k h(n(patch_k)),  n(x) = x / (||x|| + 1e-6)
    D loss  L = 0.5 * [mean relu(1 - h(cls_real)) + mean relu(1 + h(cls_fake))]
              + patch_weight * 0.5 * [mean relu(1 - h(patch_real)) + mean relu(1 + h(patch_fake))]

(the means run over images, and over images x drawn patches for the patch term). As published
(showlab/Adv-GRPO `adv_grpo/rewards.py:dino_patch_cotrain_score` vs `train_dino`), the reward
L2-normalises the tokens along the feature dim before the head while the D loss feeds the raw tokens;
`normalize_tokens: false` scores raw tokens too. Scoring never
builds a graph; `hinge_loss` gives a loss whose gradient reaches the head only (the backbone is
frozen), for the trainer's discriminator step (flowgrpo.t2i.adversarial.Discriminator).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from .base import Pretrained, Scorer
from .encoders import Dinov2Backbone
from .images import ImageBatch
from .registry import register
from .similarity import DINOV2_BASE


HEAD_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class DiscriminatorHead(nn.Module):
    """h: D -> hidden -> GELU -> 1, on one token ([..., D] -> [...])."""

    def __init__(self, input_dim: int, hidden: int = 512):
        super().__init__()
        self.input_dim, self.hidden = int(input_dim), int(hidden)
        self.layers = nn.Sequential(nn.Linear(self.input_dim, self.hidden), nn.GELU(), nn.Linear(self.hidden, 1))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.layers(tokens).squeeze(-1)


@dataclass(frozen=True)
class HingeLoss:
    """What a trainable scorer's `hinge_loss` gives the discriminator step."""

    loss: torch.Tensor  # scalar; its gradient reaches the trainable parameters only
    metrics: dict[str, float]  # d_loss, cls_loss, patch_loss, real_score, fake_score, accuracy


def hinge_terms(real: torch.Tensor, fake: torch.Tensor) -> torch.Tensor:
    """0.5 * [mean relu(1 - real) + mean relu(1 + fake)] over all entries."""
    return 0.5 * (F.relu(1.0 - real).mean() + F.relu(1.0 + fake).mean())


class DinoDiscriminator(Pretrained, Scorer):
    """Frozen DINOv2 CLS + random patch tokens -> trainable MLP head; a trainable pointwise reward."""

    name = "dino_discriminator"
    differentiable = False  # scores are computed without grad; training goes through hinge_loss

    def __init__(
        self,
        backbone: Dinov2Backbone,
        head: DiscriminatorHead,
        *,
        num_patches: int = 64,
        cls_weight: float = 0.7,
        patch_weight: float = 0.3,
        seed: int = 0,
        batch_size: int = 32,
        normalize_tokens: bool = True,
        head_dtype: torch.dtype = torch.float32,
        key: str | None = None,
    ):
        super().__init__(batch_size=batch_size, key=key)
        if int(num_patches) < 1:
            raise ValueError(f"num_patches must be >= 1, got {num_patches}")
        hidden = backbone.model.config.hidden_size
        if head.input_dim != hidden:
            raise ValueError(f"discriminator head expects {head.input_dim}-d tokens, the DINOv2 gives {hidden}")
        self.backbone = backbone
        self.head_dtype = head_dtype
        self.head = head.to(device=backbone.device, dtype=head_dtype).requires_grad_(True)
        self.num_patches = int(num_patches)
        self.cls_weight, self.patch_weight = float(cls_weight), float(patch_weight)
        self.normalize_tokens = bool(normalize_tokens)
        self.patch_generator = torch.Generator().manual_seed(int(seed))
        self._lock = threading.Lock()  # reward worker threads may score concurrently

    # --- weights and state ---------------------------------------------------------------------

    def to(self, device=None, dtype=None):
        self.backbone.to(device, dtype)
        self.head.to(device=self.backbone.device)  # keeps head_dtype
        return self

    def trainable_parameters(self) -> list[nn.Parameter]:
        return list(self.head.parameters())

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """Head weights ('head.<name>') and the patch generator state ('patch_generator')."""
        out = {f"head.{k}": v.detach().cpu().clone().contiguous() for k, v in self.head.state_dict().items()}
        out["patch_generator"] = self.patch_generator.get_state().clone()
        return out

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        head = {k[len("head.") :]: v for k, v in tensors.items() if k.startswith("head.")}
        self.head.load_state_dict(head, strict=True)
        if "patch_generator" not in tensors:
            raise KeyError("dino_discriminator state has no 'patch_generator'")
        self.patch_generator.set_state(tensors["patch_generator"].cpu().to(torch.uint8))

    def save_head(self, path: str | Path) -> None:
        """The head as a safetensors file (what the `head` setting loads)."""
        from safetensors.torch import save_file

        save_file({k: v.detach().contiguous().cpu() for k, v in self.head.state_dict().items()}, str(path))

    # --- features ------------------------------------------------------------------------------

    def draw_patches(self, batch: int, num_tokens: int) -> torch.Tensor:
        """Patch indices [batch, num_patches] in [0, num_tokens), drawn per image with replacement."""
        with self._lock:
            return torch.randint(0, num_tokens, (batch, self.num_patches), generator=self.patch_generator)

    @torch.no_grad()
    def features(self, images) -> tuple[torch.Tensor, torch.Tensor]:
        """(CLS [B, D], drawn patch tokens [B, num_patches, D]), float32, layer-normed, no grad.
        Runs the backbone in chunks of batch_size and keeps only the drawn tokens."""
        batch = ImageBatch.of(images)
        cls_parts, patch_parts = [], []
        for start in range(0, len(batch), self.batch_size):
            part = batch[start : start + self.batch_size]
            # The backbone's own preprocessing (resize to its size, ImageNet statistics).
            tokens = self.backbone.model(pixel_values=self.backbone.tensor_pixels(part)).last_hidden_state
            tokens = tokens.float()
            patches = tokens[:, 1:]
            idx = self.draw_patches(len(part), patches.shape[1]).to(patches.device)
            cls_parts.append(tokens[:, 0])
            patch_parts.append(torch.gather(patches, 1, idx[..., None].expand(-1, -1, patches.shape[-1])))
        return torch.cat(cls_parts), torch.cat(patch_parts)

    def logits(self, cls: torch.Tensor, patches: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Head outputs, float32: (h(cls) [B], h(patches) [B, K]); the tokens enter the head in its dtype."""
        dt = self.head_dtype
        return self.head(cls.to(dt)).float(), self.head(patches.to(dt)).float()

    def combine(self, h_cls: torch.Tensor, h_patch: torch.Tensor) -> torch.Tensor:
        """r = cls_weight * h(cls) + patch_weight * mean_k h(patch_k)."""
        return self.cls_weight * h_cls + self.patch_weight * h_patch.mean(-1)

    # --- scoring and training ------------------------------------------------------------------

    @torch.no_grad()
    def score_batch(self, images, prompts, metadata):
        cls, patches = self.features(images)
        if self.normalize_tokens:  # the published reward only; hinge_loss keeps the raw tokens
            cls, patches = _unit(cls), _unit(patches)
        h_cls, h_patch = self.logits(cls, patches)
        return {self.key: self.combine(h_cls, h_patch), f"{self.key}/cls": h_cls, f"{self.key}/patch": h_patch.mean(-1)}

    def hinge_loss(self, real_images, fake_images) -> HingeLoss:
        """Hinge loss with real_images as positives and fake_images as negatives; the gradient
        reaches the head only. Images with non-finite pixels are left out. Metrics (floats): d_loss,
        cls_loss, patch_loss, real_score / fake_score (mean cls/patch mix of these raw-token logits),
        accuracy (CLS sign). Reals and
        fakes of one size go through the backbone together (reals first, one patch draw)."""
        real, fake = _finite(real_images, "real"), _finite(fake_images, "fake")
        with torch.enable_grad():
            if real.uniform and fake.uniform and real.tensor().shape[1:] == fake.tensor().shape[1:]:
                # one backbone pass (and one patch draw) for both, reals first
                both = ImageBatch(torch.cat([real.tensor().detach(), fake.tensor().detach().to(real.device)]))
                h, hp = self.logits(*self.features(both))
                n = len(real)
                h_real, hp_real, h_fake, hp_fake = h[:n], hp[:n], h[n:], hp[n:]
            else:
                h_real, hp_real = self.logits(*self.features(real))
                h_fake, hp_fake = self.logits(*self.features(fake))
            cls_loss = hinge_terms(h_real, h_fake)
            patch_loss = hinge_terms(hp_real, hp_fake)
            loss = cls_loss + self.patch_weight * patch_loss
        with torch.no_grad():
            accuracy = 0.5 * (float((h_real > 0).float().mean()) + float((h_fake < 0).float().mean()))
            metrics = {
                "d_loss": float(loss),
                "cls_loss": float(cls_loss),
                "patch_loss": float(patch_loss),
                "real_score": float(self.combine(h_real, hp_real).mean()),
                "fake_score": float(self.combine(h_fake, hp_fake).mean()),
                "accuracy": accuracy,
            }
        return HingeLoss(loss, metrics)


def _unit(x: torch.Tensor) -> torch.Tensor:
    """x / (||x|| + 1e-6) along the feature dim, Adv-GRPO's reward-side normalisation."""
    return x / (x.norm(dim=-1, keepdim=True) + 1e-6)


def _finite(images, what: str) -> ImageBatch:
    batch = ImageBatch.of(images)
    ok = batch.finite()
    if bool(ok.all()):
        return batch
    if not bool(ok.any()):
        raise ValueError(f"dino_discriminator: every {what} image has non-finite pixels")
    return ImageBatch(batch.tensor()[ok.to(batch.device)])


@register("dino_discriminator")
def build_dino_discriminator(
    *,
    model: str = DINOV2_BASE,
    head: str | None = None,
    tiny: bool = False,
    image_size: int | None = None,
    device: str = "auto",
    dtype: str = "float32",
    batch_size: int = 32,
    num_patches: int = 64,
    cls_weight: float = 0.7,
    patch_weight: float = 0.3,
    head_hidden: int = 512,
    seed: int = 0,
    normalize_tokens: bool = True,
    head_dtype: str = "float32",
    local_files_only: bool = False,
    key: str | None = None,
) -> DinoDiscriminator:
    """Adv-GRPO DINO-as-D: frozen DINOv2 + trainable MLP head on CLS and random patches. `head_dtype`: the head's
    weights (and so its Adam moments); "bfloat16" as published (`head.to(torch.bfloat16)` before its Adam)."""
    if head_dtype not in HEAD_DTYPES:
        raise ValueError(f"head_dtype must be one of {sorted(HEAD_DTYPES)}, got '{head_dtype}'")
    kw = dict(image_size=image_size, device=device, dtype=dtype)
    backbone = (
        Dinov2Backbone.tiny(0, **kw)
        if tiny
        else Dinov2Backbone.from_pretrained(model, local_files_only=local_files_only, **kw)
    )
    hidden = backbone.model.config.hidden_size
    with torch.random.fork_rng(devices=[]):  # seeded head, the caller's RNG untouched
        torch.manual_seed(seed)
        mlp = DiscriminatorHead(hidden, head_hidden)
    if head is not None:
        from safetensors.torch import load_file

        state = load_file(str(head))
        if "layers.0.weight" not in state:
            raise ValueError(f"{head}: not a discriminator head (keys: {sorted(state)[:8]})")
        mlp = DiscriminatorHead(state["layers.0.weight"].shape[1], state["layers.0.weight"].shape[0])
        mlp.load_state_dict(state, strict=True)
    return DinoDiscriminator(
        backbone,
        mlp,
        num_patches=num_patches,
        cls_weight=cls_weight,
        patch_weight=patch_weight,
        seed=seed,
        batch_size=batch_size,
        normalize_tokens=normalize_tokens,
        head_dtype=HEAD_DTYPES[head_dtype],
        key=key,
    )
