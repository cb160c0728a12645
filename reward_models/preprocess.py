"""Image preprocessing for CLIP-family and DINOv2 scorers.

Two paths, both from one PreprocessSpec:
- tensor (default): resize + centre crop + normalise on the float tensor, on the model's device,
  differentiable, so a reward can back-propagate to the pixels;
- pil (reference): the uint8 round trip through the published PIL processor, as every reference
  implementation does; use it for numbers that must match papers.
torch's bicubic with antialias=True uses PIL's kernel (a = -0.5), so the two agree up to uint8
rounding. transformers is imported on use (clip_image_processor_class).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

# OpenAI CLIP statistics (CLIP-L/14, CLIP-H/14 laion, PickScore, HPSv2, aesthetic predictor).
OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
# ImageNet statistics (DINOv2).
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
CLIP_IMAGE_SIZE = 224  # shortest edge resize and square centre crop
DINOV2_IMAGE_SIZE = 518  # Adv-GRPO: bicubic resize to 518x518, no crop


@dataclass(frozen=True)
class PreprocessSpec:
    """resize (shortest edge to `shortest_edge`, or to exactly `size`), centre crop, normalise."""

    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    shortest_edge: int | None = None
    size: tuple[int, int] | None = None  # (height, width), aspect ratio not kept
    crop: tuple[int, int] | None = None  # (height, width)

    def __post_init__(self):
        if (self.shortest_edge is None) == (self.size is None):
            raise ValueError("give exactly one of shortest_edge and size")


CLIP_SPEC = PreprocessSpec(
    OPENAI_CLIP_MEAN, OPENAI_CLIP_STD, shortest_edge=CLIP_IMAGE_SIZE, crop=(CLIP_IMAGE_SIZE, CLIP_IMAGE_SIZE)
)
DINOV2_SPEC = PreprocessSpec(IMAGENET_MEAN, IMAGENET_STD, size=(DINOV2_IMAGE_SIZE, DINOV2_IMAGE_SIZE))


def spec_from_processor(processor) -> PreprocessSpec:
    """Read a transformers CLIP-style image processor's settings (so a checkpoint's own
    preprocessor_config.json is honoured)."""
    size, crop = processor.size, processor.crop_size if getattr(processor, "do_center_crop", True) else None
    get = lambda d, k: d.get(k) if isinstance(d, dict) else getattr(d, k, None)
    shortest = get(size, "shortest_edge")
    hw = None if shortest else (get(size, "height"), get(size, "width"))
    crop_hw = (get(crop, "height"), get(crop, "width")) if crop is not None else None
    resample = int(getattr(processor, "resample", 3))
    if resample != 3:  # only bicubic is implemented on tensors
        raise ValueError(f"processor resample {resample} is not bicubic (3); use preprocess='pil'")
    return PreprocessSpec(
        tuple(processor.image_mean), tuple(processor.image_std), shortest_edge=shortest, size=hw, crop=crop_hw
    )


def clip_image_processor_class():
    """The PIL-backed CLIP processor: the published reference, and free of torchvision.
    transformers 5.x calls it CLIPImageProcessorPil; in 4.x CLIPImageProcessor is PIL-based."""
    try:
        from transformers import CLIPImageProcessorPil

        return CLIPImageProcessorPil
    except ImportError:
        from transformers import CLIPImageProcessor

        return CLIPImageProcessor


def resized_size(height: int, width: int, spec: PreprocessSpec) -> tuple[int, int]:
    """Output size of the resize step; shortest edge as transformers does it (long side floored)."""
    if spec.size is not None:
        return spec.size
    s = spec.shortest_edge
    if height <= width:
        return s, int(s * width / height)
    return int(s * height / width), s


def center_crop(x: torch.Tensor, crop: tuple[int, int]) -> torch.Tensor:
    """Crop [...,H,W] to (h,w) around the centre; offsets floored like transformers."""
    h, w = x.shape[-2:]
    ch, cw = crop
    if ch > h or cw > w:
        raise ValueError(f"crop {crop} larger than the resized image {(h, w)}")
    top, left = (h - ch) // 2, (w - cw) // 2
    return x[..., top : top + ch, left : left + cw]


def preprocess_tensor(x: torch.Tensor, spec: PreprocessSpec) -> torch.Tensor:
    """Float [B,3,H,W] in [0,1] -> normalised model input; differentiable."""
    x = x.clamp(0, 1)
    out_hw = resized_size(x.shape[-2], x.shape[-1], spec)
    if tuple(x.shape[-2:]) != tuple(out_hw):
        # Bicubic overshoots; clamp as the uint8 round trip of the reference path does.
        x = F.interpolate(x, size=out_hw, mode="bicubic", align_corners=False, antialias=True).clamp(0, 1)
    if spec.crop is not None:
        x = center_crop(x, spec.crop)
    mean = torch.tensor(spec.mean, dtype=x.dtype, device=x.device)[:, None, None]
    std = torch.tensor(spec.std, dtype=x.dtype, device=x.device)[:, None, None]
    return (x - mean) / std


def preprocess_batch(images, spec: PreprocessSpec) -> torch.Tensor:
    """An ImageBatch -> [B,3,h,w]; images of different sizes are resized one by one."""
    if images.uniform:
        return preprocess_tensor(images.tensor(), spec)
    return torch.cat([preprocess_tensor(t[None], spec) for t in images.tensors()])
