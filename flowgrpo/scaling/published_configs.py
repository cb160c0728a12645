"""Transformer configs of published image models, written out (the hub is not reachable from tests) for the
meta-device builds of flowgrpo.scaling.memory."""

from __future__ import annotations

from typing import Any

# FLUX.2-klein-4B's transformer/config.json; the 9B differs in depth, width and text width (Qwen3-8B: 3 x 4096).
# Written from public copies of the file (the hub was not reachable here); the built parameter count (3.88 B /
# 9.08 B) is checked against the published sizes.
FLUX2_KLEIN_CONFIG: dict[str, Any] = dict(
    patch_size=1,
    in_channels=128,
    num_layers=5,
    num_single_layers=20,
    attention_head_dim=128,
    num_attention_heads=24,
    joint_attention_dim=7680,
    timestep_guidance_channels=256,
    mlp_ratio=3.0,
    axes_dims_rope=(32, 32, 32, 32),
    rope_theta=2000,
    eps=1e-6,
    guidance_embeds=False,
)


# FLUX.1-dev's transformer/config.json (FLUX.1-Kontext-dev's is the same model shape)
FLUX1_DEV_CONFIG: dict[str, Any] = dict(
    patch_size=1,
    in_channels=64,
    num_layers=19,
    num_single_layers=38,
    attention_head_dim=128,
    num_attention_heads=24,
    joint_attention_dim=4096,
    pooled_projection_dim=768,
    guidance_embeds=True,
    axes_dims_rope=(16, 56, 56),
)
# Qwen-Image's transformer/config.json (Qwen-Image-Edit and -Edit-2509 have the same shape)
QWEN_IMAGE_CONFIG: dict[str, Any] = dict(
    patch_size=2,
    in_channels=64,
    out_channels=16,
    num_layers=60,
    attention_head_dim=128,
    num_attention_heads=24,
    joint_attention_dim=3584,
    guidance_embeds=False,
    axes_dims_rope=(16, 56, 56),
)
