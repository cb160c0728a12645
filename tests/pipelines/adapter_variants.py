"""The tiny adapter variants every adapter test runs over: name -> (family, tiny() options)."""

VARIANTS = {
    "sd3": ("sd3", {}),
    "sd3.5": ("sd3", {"qk_norm": True}),
    "flux-dev": ("flux", {"guidance_embeds": True}),
    "flux-schnell": ("flux", {"guidance_embeds": False}),
    "sd15": ("sd15", {}),
    "qwenimage": ("qwenimage", {}),
}
