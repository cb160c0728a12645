"""Frozen feature extractors behind the CLIP-family and DINOv2 scorers.

A backbone owns a transformers model, its preprocessing, one device and one dtype: inputs are moved
there, features come back in the model's dtype, and gradients reach the pixels only when the input
tensor asks for them. transformers is imported here, on use.
"""

from __future__ import annotations

from pathlib import Path

import torch

from .images import ImageBatch
from .placement import ModelPlacement
from .preprocess import DINOV2_SPEC, PreprocessSpec, preprocess_batch, spec_from_processor

PREPROCESS_MODES = ("tensor", "pil")


def clip_image_processor_class():
    """The PIL-backed CLIP processor: the published reference, and free of torchvision.
    transformers 5.x calls it CLIPImageProcessorPil; in 4.x CLIPImageProcessor is PIL-based."""
    try:
        from transformers import CLIPImageProcessorPil

        return CLIPImageProcessorPil
    except ImportError:
        from transformers import CLIPImageProcessor

        return CLIPImageProcessor


def pooled(output) -> torch.Tensor:
    """get_image/text_features return a tensor in transformers 4.x and an output object whose
    pooler_output is the projected embedding in 5.x."""
    return output if isinstance(output, torch.Tensor) else output.pooler_output


class _Backbone(ModelPlacement):
    def __init__(self, model, spec: PreprocessSpec, device, dtype):
        self.model = model.eval().requires_grad_(False)  # frozen: gradients go to pixels only
        self.spec = spec
        self.to(device, dtype)

    def tensor_pixels(self, images: ImageBatch) -> torch.Tensor:
        # Resize on the model's device (fast on GPU), in float32, then cast to the model dtype.
        if images.uniform:
            images = ImageBatch(images.tensor().to(self.device, torch.float32))
        return preprocess_batch(images, self.spec).to(device=self.device, dtype=self.dtype)

    @staticmethod
    def grad_enabled(images: ImageBatch) -> bool:
        return images.requires_grad and torch.is_grad_enabled()


class ClipBackbone(_Backbone):
    """transformers CLIPModel + tokenizer + image processor."""

    def __init__(self, model, tokenizer, processor, *, device="auto", dtype="float32", preprocess="tensor"):
        if preprocess not in PREPROCESS_MODES:
            raise ValueError(f"preprocess must be one of {PREPROCESS_MODES}, got {preprocess!r}")
        self.tokenizer, self.processor, self.preprocess = tokenizer, processor, preprocess
        # Keep logit_scale in float32: bf16 would round exp(4.6052)=100 to about 98.9.
        self._logit_scale = model.logit_scale.detach().float().exp().clone()
        super().__init__(model, spec_from_processor(processor), device, dtype)
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
        from .tiny import tiny_clip_model, tiny_clip_processor, tiny_clip_tokenizer

        return cls(tiny_clip_model(seed), tiny_clip_tokenizer(), tiny_clip_processor(), **kwargs)

    def save_pretrained(self, path: str | Path) -> None:
        self.model.save_pretrained(path)
        self.tokenizer.save_pretrained(path)
        self.processor.save_pretrained(path)

    @property
    def embed_dim(self) -> int:
        return self.model.config.projection_dim

    def pixel_values(self, images: ImageBatch) -> torch.Tensor:
        if self.preprocess == "tensor":
            return self.tensor_pixels(images)
        if images.requires_grad:
            raise ValueError("preprocess='pil' goes through uint8 and is not differentiable; use 'tensor'")
        pixels = self.processor(images=images.pil(), return_tensors="pt")["pixel_values"]
        return pixels.to(device=self.device, dtype=self.dtype)

    def image_embeds(self, images: ImageBatch) -> torch.Tensor:
        """Projected image embeddings [B, D] (not normalised)."""
        with torch.set_grad_enabled(self.grad_enabled(images)):
            return pooled(self.model.get_image_features(pixel_values=self.pixel_values(images)))

    @torch.no_grad()
    def text_embeds(self, prompts: list[str]) -> torch.Tensor:
        """Projected text embeddings [B, D]; each distinct prompt is encoded once (GRPO groups
        repeat prompts)."""
        unique = list(dict.fromkeys(prompts))
        tokens = self.tokenizer(
            unique, padding=True, truncation=True, max_length=self.max_length, return_tensors="pt"
        ).to(self.device)
        feats = pooled(
            self.model.get_text_features(input_ids=tokens["input_ids"], attention_mask=tokens["attention_mask"])
        )
        index = torch.tensor([unique.index(p) for p in prompts], device=feats.device)
        return feats[index]

    def logit_scale(self) -> torch.Tensor:
        """exp(logit_scale) in float32 (about 100 for trained CLIPs)."""
        return self._logit_scale.to(self.device)


class Dinov2Backbone(_Backbone):
    """transformers Dinov2Model; the feature is pooler_output (the layer-normed CLS token)."""

    def __init__(self, model, *, image_size: int | None = None, device="auto", dtype="float32"):
        size = int(image_size or model.config.image_size)
        spec = PreprocessSpec(DINOV2_SPEC.mean, DINOV2_SPEC.std, size=(size, size))
        super().__init__(model, spec, device, dtype)

    @classmethod
    def from_pretrained(
        cls, model: str, *, local_files_only: bool = False, revision: str | None = None, **kwargs
    ) -> "Dinov2Backbone":
        from transformers import Dinov2Model

        return cls(Dinov2Model.from_pretrained(model, local_files_only=local_files_only, revision=revision), **kwargs)

    @classmethod
    def tiny(cls, seed: int = 0, **kwargs) -> "Dinov2Backbone":
        from .tiny import tiny_dinov2_model

        return cls(tiny_dinov2_model(seed), **kwargs)

    def save_pretrained(self, path: str | Path) -> None:
        self.model.save_pretrained(path)

    def image_embeds(self, images: ImageBatch) -> torch.Tensor:
        with torch.set_grad_enabled(self.grad_enabled(images)):
            return self.model(pixel_values=self.tensor_pixels(images)).pooler_output


def load_clip(
    model: str,
    *,
    processor: str | None = None,
    tiny: bool = False,
    seed: int = 0,
    local_files_only: bool = False,
    **kwargs,
) -> ClipBackbone:
    """The scorer factories' one way to get a CLIP: real weights, or a tiny random one."""
    if tiny:
        return ClipBackbone.tiny(seed, **kwargs)
    return ClipBackbone.from_pretrained(model, processor=processor, local_files_only=local_files_only, **kwargs)
