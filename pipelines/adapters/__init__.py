"""Model adapters, one per family, by name. Importing this package does not import diffusers.

adapter = build_adapter("sd3", tiny=True)                         # tests, demos
adapter = build_adapter("flux", pretrained="/models/FLUX.1-dev", dtype=torch.bfloat16, device="cuda")
"""

from __future__ import annotations

import os
from typing import Any

from .base import CFG_MODES, LORA_INITS, Adapter
from .embeds import PromptEmbeds
from .flux import FluxAdapter
from .flux2 import Flux2Adapter, Flux2KleinEditAdapter
from .hunyuan_video import HunyuanVideoAdapter
from .hunyuan_video15 import HunyuanVideo15Adapter
from .kontext import FluxKontextAdapter
from .qwenimage import QwenImageAdapter
from .qwenimage_edit import QwenImageEditAdapter, QwenImageEditPlusAdapter
from .sd3 import SD3Adapter
from .sd15 import SD15Adapter
from .wan import WanAdapter
from .wan22 import Wan22Adapter
from .wan22_i2v import Wan22I2VAdapter
from .zimage import ZImageAdapter

ADAPTERS: dict[str, type[Adapter]] = {
    cls.family: cls for cls in (SD3Adapter, FluxAdapter, SD15Adapter, QwenImageAdapter, Flux2Adapter, ZImageAdapter)
}
# image editing: prompts carry their source image(s) (editing.EditPrompt)
ADAPTERS.update(
    {
        cls.family: cls
        for cls in (FluxKontextAdapter, QwenImageEditAdapter, QwenImageEditPlusAdapter, Flux2KleinEditAdapter)
    }
)
ADAPTERS[WanAdapter.family] = WanAdapter  # video: latents [B, C, F, h, w]
ADAPTERS.update({cls.family: cls for cls in (HunyuanVideoAdapter, HunyuanVideo15Adapter)})  # video, as Wan
ADAPTERS[Wan22Adapter.family] = Wan22Adapter  # Wan 2.2: TI2V-5B, T2V-A14B (two experts)
ADAPTERS[Wan22I2VAdapter.family] = Wan22I2VAdapter  # TI2V-5B image-to-video: prompts carry the first frame


def build_adapter(name: str, pretrained: str | os.PathLike | None = None, tiny: bool = False, **kw: Any) -> Adapter:
    """`pretrained` (a local pipeline folder or hub id) or `tiny=True` (random weights); kw go to
    `from_pretrained` / `tiny` (dtype, device, seed, family options such as qk_norm / guidance_embeds)."""
    if name not in ADAPTERS:
        raise ValueError(f"unknown model family '{name}'; valid: {sorted(ADAPTERS)}")
    if (pretrained is None) == (not tiny):
        raise ValueError("pass exactly one of pretrained=<path or hub id> or tiny=True")
    cls = ADAPTERS[name]
    return cls.tiny(**kw) if tiny else cls.from_pretrained(pretrained, **kw)


__all__ = [
    "ADAPTERS", "CFG_MODES", "LORA_INITS", "Adapter", "Flux2Adapter", "Flux2KleinEditAdapter", "FluxAdapter", "FluxKontextAdapter",
    "HunyuanVideo15Adapter", "HunyuanVideoAdapter",
    "PromptEmbeds", "QwenImageAdapter", "QwenImageEditAdapter", "QwenImageEditPlusAdapter", "SD15Adapter",
    "SD3Adapter", "Wan22Adapter", "Wan22I2VAdapter", "WanAdapter", "ZImageAdapter", "build_adapter",
]  # fmt: skip
