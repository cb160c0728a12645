"""Wan 2.1 T2V adapter: WanPipeline's own loop reproduced on 5-D video latents (grid, CFG, decode to frames), the
published scheduler's grid, CFG modes, from_pretrained, and the published specs' sizes. On-policy ratio 1, the
detached-uncond gradient, LoRA in diffusers' loader and a full fine-tune's folder: test_adapter_contract.py (every
video family)."""

import pytest
import torch

from pipelines.adapters import PromptEmbeds, WanAdapter, build_adapter
from pipelines.adapters.wan import WAN_SPECS
from pipelines.sampler import Sampler, SamplerConfig

PROMPT = "a red cat"
STEPS = 2


@pytest.fixture(scope="module")
def base() -> WanAdapter:
    return build_adapter("wan", tiny=True)  # the published scheduler: UniPC with flow sigmas


def test_geometry_frames_and_refusals(base):
    assert base.num_frames == 5 and base.latent_shape(32, 32) == (4, 3, 8, 8)  # (5 - 1) // 2 + 1 latent frames
    assert base.latent_shape(32, 48, num_frames=9) == (4, 5, 8, 12) and base.image_seq_len(32, 32) == 3 * 4 * 4
    with pytest.raises(ValueError, match="num_frames must be 1 \\+ a multiple of 2"):
        base.latent_shape(32, 32, num_frames=4)
    with pytest.raises(ValueError, match="multiples of 8"):
        base.latent_shape(36, 32)
    with pytest.raises(ValueError, match="latents must be 5-D"):
        base.model_output(torch.randn(1, 4, 8, 8), 0.5, base.encode_prompts([PROMPT]), 1.0, "none")
    base.pipe.register_to_config(expand_timesteps=True)
    try:
        with pytest.raises(ValueError, match="TI2V"):
            WanAdapter(base.pipe)
    finally:
        base.pipe.register_to_config(expand_timesteps=False)
    assert base.vae.use_slicing and not base.vae.use_tiling
    # the published scheduler's grid: what WanPipeline's UniPC walks, and the integer timesteps it feeds the model
    grid = Sampler(SamplerConfig(num_steps=4, height=32, width=32)).schedule(base)
    base.pipe.scheduler.set_timesteps(4)
    torch.testing.assert_close(grid.sigmas, base.pipe.scheduler.sigmas.float())
    torch.testing.assert_close(grid.model_sigmas * 1000, base.pipe.scheduler.timesteps.float())
    shifted = Sampler(SamplerConfig(num_steps=4, height=32, width=32, shift=5.0)).schedule(base)
    assert bool((shifted.sigmas[1:-1] > grid.sigmas[1:-1]).all())  # a larger flow_shift stays noisier longer


def test_specs_are_the_published_sizes():
    from diffusers import WanTransformer3DModel

    sizes = {}
    for name, spec in WAN_SPECS.items():
        with torch.device("meta"):
            sizes[name] = sum(p.numel() for p in WanTransformer3DModel(**spec).parameters())
    assert 1.3e9 < sizes["wan2.1-t2v-1.3b"] < 1.5e9 and 14.0e9 < sizes["wan2.1-t2v-14b"] < 14.5e9


def test_model_output_and_decode_reproduce_the_pipeline():
    """WanPipeline with a FlowMatchEuler scheduler, from our noise: its last latent and its frames."""
    a = build_adapter("wan", tiny=True, scheduler="euler")
    x0 = torch.randn(1, *a.latent_shape(16, 16))
    seen = {}

    def keep(pipe, i, t, kw):
        seen["latents"] = kw["latents"]
        return {}

    a.pipe.set_progress_bar_config(disable=True)
    frames = a.pipe(
        prompt=PROMPT, num_inference_steps=STEPS, height=16, width=16, num_frames=5, guidance_scale=4.0,
        latents=x0.clone(), max_sequence_length=a.max_sequence_length, output_type="pt", callback_on_step_end=keep,
    ).frames  # fmt: skip
    grid = Sampler(SamplerConfig(num_steps=STEPS, height=16, width=16)).schedule(a)
    torch.testing.assert_close(grid.sigmas, a.pipe.scheduler.sigmas.float())
    e, x = a.encode_prompts([PROMPT]), x0.clone()
    with torch.no_grad():
        for i in range(STEPS):
            x = x + (grid.sigmas[i + 1] - grid.sigmas[i]) * a.model_output(x, grid.sigmas[i], e, 4.0, "full")
        torch.testing.assert_close(x, seen["latents"], atol=2e-5, rtol=1e-5)
        video = a.decode(x)
    assert video.shape == frames.shape == (1, 5, 3, 16, 16)
    torch.testing.assert_close(video, frames, atol=1e-5, rtol=1e-5)
    assert video.std() > 0.01  # frames are not blank


def test_cfg_modes(base):
    a = build_adapter("wan", tiny=True)
    params = a.add_lora(rank=4)
    names = [n for n, p in a.denoiser.named_parameters() if p.requires_grad]
    assert any(".attn1.to_q." in n for n in names) and any(".attn2.to_out.0." in n for n in names)
    with torch.no_grad():
        for p in params:  # B = 0 at init: make the LoRA count
            p.add_(0.05 * torch.randn_like(p))
    x, s = torch.randn(2, *a.latent_shape(32, 32)), torch.tensor([0.3, 0.8])
    e = a.encode_prompts([PROMPT, "a blue dog"])
    with torch.no_grad():
        full, det = a.model_output(x, s, e, 3.0, "full"), a.model_output(x, s, e, 3.0, "detach_uncond")
        cond = a.model_output(x, s, e, 0.0, "none")
        uncond = a.model_output(x, s, PromptEmbeds(cond=e.uncond), 0.0, "none")
        with a.reference():
            ref = a.model_output(x, s, e, 3.0, "full")
    assert full.shape == x.shape and torch.equal(full, det) and not torch.allclose(full, cond, atol=1e-4)
    assert not torch.allclose(full, ref, atol=1e-4)  # the reference is the base model
    torch.testing.assert_close(full, uncond + 3.0 * (cond - uncond), atol=5e-5, rtol=1e-5)


def test_from_pretrained(tmp_path):
    a = build_adapter("wan", tiny=True)
    a.pipe.save_pretrained(tmp_path / "pipe")
    b = build_adapter("wan", pretrained=tmp_path / "pipe", max_sequence_length=16, num_frames=9)
    assert type(b) is WanAdapter and b.scheduler_config == a.scheduler_config and b.latent_shape(32, 32)[1] == 5
    ea, eb = a.encode_prompts([PROMPT]), b.encode_prompts([PROMPT])
    torch.testing.assert_close(ea.cond, eb.cond)
    x = torch.randn(1, *a.latent_shape(32, 32))
    with torch.no_grad():
        torch.testing.assert_close(a.model_output(x, 0.5, ea, 0.0, "none"), b.model_output(x, 0.5, eb, 0.0, "none"))
