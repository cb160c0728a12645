"""Frozen feature extractors behind the CLIP-family and DINOv2 scorers, and the base those scorers share.

A Backbone owns a frozen model, its preprocessing, one device and one dtype: inputs are moved
there, embeddings come back in the model's dtype, and gradients reach the pixels only when the input
tensor asks for them; image_features / text_features are the L2-normalised float32 embeddings every
scorer compares. BackboneSettings is how a config names a CLIP-family backbone (weights, processor,
tiny, device, dtype, preprocessing); EmbeddingScorer is a scorer on one backbone. transformers is
imported here, on use.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from .base import Pretrained, Scorer
from .images import ImageBatch
from .placement import ModelPlacement
from .preprocess import DINOV2_SPEC, PreprocessSpec, clip_image_processor_class, preprocess_batch, spec_from_processor
from .tiny import tiny_clip_model, tiny_clip_processor, tiny_clip_tokenizer, tiny_dinov2_model

PREPROCESS_MODES = ("tensor", "pil")
CLIP_L14 = "openai/clip-vit-large-patch14"


def pooled(output) -> torch.Tensor:
    """get_image/text_features return a tensor in transformers 4.x and an output object whose
    pooler_output is the projected embedding in 5.x."""
    return output if isinstance(output, torch.Tensor) else output.pooler_output


class Backbone(ModelPlacement):
    """A frozen image (and text) encoder. Subclasses implement encode_image, pil_pixels and encode_text
    where they have them, and set `spec` (a PreprocessSpec) or override tensor_pixels."""

    spec: PreprocessSpec

    def __init__(self, model, *, device="auto", dtype="float32", preprocess: str = "tensor"):
        if preprocess not in PREPROCESS_MODES:
            raise ValueError(f"preprocess must be one of {PREPROCESS_MODES}, got {preprocess!r}")
        self.model = model.eval().requires_grad_(False)  # frozen: gradients go to pixels only
        self.preprocess = preprocess
        self.to(device, dtype)

    def tensor_pixels(self, images: ImageBatch) -> torch.Tensor:
        """The differentiable preprocessing of float pixels."""
        # Resize on the model's device (fast on GPU), in float32, then cast to the model dtype.
        if images.uniform:
            images = ImageBatch(images.tensor().to(self.device, torch.float32))
        return preprocess_batch(images, self.spec).to(device=self.device, dtype=self.dtype)

    def pil_pixels(self, images: list) -> torch.Tensor:
        """The reference preprocessing of PIL images (uint8)."""
        raise NotImplementedError

    def encode_image(self, pixels: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def encode_text(self, prompts: list[str]) -> torch.Tensor:
        raise NotImplementedError

    def pixel_values(self, images: ImageBatch) -> torch.Tensor:
        if self.preprocess == "tensor":
            pixels = self.tensor_pixels(images)
        elif images.requires_grad:
            raise ValueError("preprocess='pil' goes through uint8 and is not differentiable; use 'tensor'")
        else:
            pixels = self.pil_pixels(images.pil())
        return pixels.to(device=self.device, dtype=self.dtype)

    @staticmethod
    def grad_enabled(images: ImageBatch) -> bool:
        return images.requires_grad and torch.is_grad_enabled()

    def image_embeds(self, images: ImageBatch) -> torch.Tensor:
        """Image embeddings [B, D] in the model dtype (not normalised)."""
        with torch.set_grad_enabled(self.grad_enabled(images)):
            return self.encode_image(self.pixel_values(images))

    @torch.no_grad()
    def text_embeds(self, prompts: list[str]) -> torch.Tensor:
        """Text embeddings [B, D] (not normalised); each distinct prompt is encoded once (GRPO groups
        repeat prompts)."""
        unique = list(dict.fromkeys(prompts))
        feats = self.encode_text(unique)
        index = torch.tensor([unique.index(p) for p in prompts], device=feats.device)
        return feats[index]

    def image_features(self, images: ImageBatch) -> torch.Tensor:
        """L2-normalised image embeddings [B, D] in float32 (bf16 embeddings are upcast first)."""
        return F.normalize(self.image_embeds(images).float(), dim=-1)

    def text_features(self, prompts: list[str]) -> torch.Tensor:
        """L2-normalised text embeddings [B, D] in float32."""
        return F.normalize(self.text_embeds(prompts).float(), dim=-1)


class ClipBackbone(Backbone):
    """transformers CLIPModel + tokenizer + image processor."""

    def __init__(self, model, tokenizer, processor, *, device="auto", dtype="float32", preprocess="tensor"):
        self.tokenizer, self.processor = tokenizer, processor
        # Keep logit_scale in float32: bf16 would round exp(4.6052)=100 to about 98.9.
        self._logit_scale = model.logit_scale.detach().float().exp().clone()
        super().__init__(model, device=device, dtype=dtype, preprocess=preprocess)
        self.spec = spec_from_processor(processor)
        # Never pad past the position table, whatever the tokenizer config says.
        self.max_length = min(int(tokenizer.model_max_length), model.config.text_config.max_position_embeddings)

    @classmethod
    def from_pretrained(
        cls,
        model: str,
        *,
        processor: str | None = None,
        local_files_only: bool = False,
        revision: str | None = None,
        **kwargs,
    ) -> "ClipBackbone":
        """model: a local directory or a hub id of a CLIPModel checkpoint; processor: where the
        tokenizer and preprocessor config live (PickScore takes them from the laion CLIP-H repo)."""
        from transformers import AutoTokenizer, CLIPModel

        source = processor or model
        opts = dict(local_files_only=local_files_only, revision=revision)
        clip = CLIPModel.from_pretrained(model, **opts)  # float32 first, cast in __init__: exact logit_scale
        tokenizer = AutoTokenizer.from_pretrained(source, **opts)
        image_processor = clip_image_processor_class().from_pretrained(source, **opts)
        return cls(clip, tokenizer, image_processor, **kwargs)

    @classmethod
    def tiny(cls, seed: int = 0, **kwargs) -> "ClipBackbone":
        """Random tiny CLIP (32 px, 16-d projection) with an in-memory tokenizer."""
        return cls(tiny_clip_model(seed), tiny_clip_tokenizer(), tiny_clip_processor(), **kwargs)

    def save_pretrained(self, path: str | Path) -> None:
        self.model.save_pretrained(path)
        self.tokenizer.save_pretrained(path)
        self.processor.save_pretrained(path)

    @property
    def embed_dim(self) -> int:
        return self.model.config.projection_dim

    def pil_pixels(self, images: list) -> torch.Tensor:
        return self.processor(images=images, return_tensors="pt")["pixel_values"]

    def encode_image(self, pixels: torch.Tensor) -> torch.Tensor:
        """Projected image embeddings."""
        return pooled(self.model.get_image_features(pixel_values=pixels))

    def encode_text(self, prompts: list[str]) -> torch.Tensor:
        """Projected text embeddings."""
        tokens = self.tokenizer(
            prompts, padding=True, truncation=True, max_length=self.max_length, return_tensors="pt"
        ).to(self.device)
        return pooled(
            self.model.get_text_features(input_ids=tokens["input_ids"], attention_mask=tokens["attention_mask"])
        )

    def logit_scale(self) -> torch.Tensor:
        """exp(logit_scale) in float32 (about 100 for trained CLIPs)."""
        return self._logit_scale.to(self.device)


class Dinov2Backbone(Backbone):
    """transformers Dinov2Model; the feature is pooler_output (the layer-normed CLS token)."""

    def __init__(self, model, *, image_size: int | None = None, device="auto", dtype="float32"):
        size = int(image_size or model.config.image_size)
        self.spec = PreprocessSpec(DINOV2_SPEC.mean, DINOV2_SPEC.std, size=(size, size))
        super().__init__(model, device=device, dtype=dtype)

    @classmethod
    def from_pretrained(
        cls, model: str, *, local_files_only: bool = False, revision: str | None = None, **kwargs
    ) -> "Dinov2Backbone":
        from transformers import Dinov2Model

        return cls(Dinov2Model.from_pretrained(model, local_files_only=local_files_only, revision=revision), **kwargs)

    @classmethod
    def tiny(cls, seed: int = 0, **kwargs) -> "Dinov2Backbone":
        return cls(tiny_dinov2_model(seed), **kwargs)

    def save_pretrained(self, path: str | Path) -> None:
        self.model.save_pretrained(path)

    def encode_image(self, pixels: torch.Tensor) -> torch.Tensor:
        return self.model(pixel_values=pixels).pooler_output


@dataclass(frozen=True)
class BackboneSettings:
    """How a CLIP-family scorer's config entry names its backbone (the same keys in every such scorer)."""

    model: str | None = CLIP_L14  # a local directory or a hub id
    processor: str | None = None  # where the tokenizer and image processor live, when not with the model
    tiny: bool = False  # a tiny random model built from configs instead (tests, demos; no download)
    device: str = "auto"
    dtype: str = "float32"
    preprocess: str = "tensor"  # one of PREPROCESS_MODES
    local_files_only: bool = False

    def load_clip(self) -> ClipBackbone:
        """The scorer factories' one way to get a CLIP: real weights, or a tiny random one."""
        kwargs = dict(device=self.device, dtype=self.dtype, preprocess=self.preprocess)
        if self.tiny:
            return ClipBackbone.tiny(0, **kwargs)
        return ClipBackbone.from_pretrained(
            self.model, processor=self.processor, local_files_only=self.local_files_only, **kwargs
        )


class EmbeddingScorer(Pretrained, Scorer):
    """A scorer on the normalised embeddings of one frozen Backbone, which `to` moves."""

    differentiable = True

    def __init__(self, backbone: Backbone, *, batch_size: int = 32, key: str | None = None):
        super().__init__(batch_size=batch_size, key=key)
        self.backbone = backbone

    def to(self, device=None, dtype=None):
        self.backbone.to(device, dtype)
        return self

    def text_image_cosine(self, images: ImageBatch, prompts: list[str]) -> torch.Tensor:
        """cos(image_i, text_i) [B] in float32."""
        return (self.backbone.image_features(images) * self.backbone.text_features(prompts)).sum(-1)
