"""HunyuanVideo 1.5 adapter: HunyuanVideo15Pipeline's own loop reproduced (chat template + crop, byT5 glyph stream,
the guider's CFG, zero condition channels and vision tokens, the shifted grid, decode to frames), CFG modes,
from_pretrained, the published specs. On-policy ratio 1, the detached-uncond gradient, the LoRA file (diffusers' model
loader) and a full fine-tune's folder: test_adapter_contract.py (every video family)."""

import pytest
import torch

from pipelines.adapters import HunyuanVideo15Adapter, build_adapter
from pipelines.adapters.hunyuan_video15 import HUNYUAN_VIDEO15_SPECS, TINY_CROP_START, TINY_SYSTEM_MESSAGE
from pipelines.sampler import Sampler, SamplerConfig

PROMPT = 'a sign that says "hi"'  # quoted text: the byT5 glyph stream is used


@pytest.fixture(scope="module")
def base() -> HunyuanVideo15Adapter:
    return build_adapter("hunyuan_video15", tiny=True)


def test_geometry_prompts_and_refusals(base):
    from diffusers import ClassifierFreeGuidance

    assert base.num_frames == 5 and base.latent_shape(32, 32) == (4, 2, 8, 8)
    with pytest.raises(ValueError, match="multiples of 4"):
        base.latent_shape(34, 32)
    assert base.pipe.tokenizer_max_length == base.max_sequence_length == 32
    conv = [[{"role": "system", "content": TINY_SYSTEM_MESSAGE}, {"role": "user", "content": "X"}]]
    ids = base.pipe.tokenizer.apply_chat_template(conv, add_generation_prompt=True, tokenize=True, return_dict=True)
    assert base.pipe.tokenizer.decode(ids["input_ids"][0][TINY_CROP_START]) == "X"  # the crop keeps the user turn on
    e = base.encode_prompts([PROMPT, "a cat"])
    # byT5 rows are the second token stream: real glyph tokens only (of the tiny 8, x 16), padded per batch
    n = int(e.mask2[0].sum())
    assert e.pooled is None and 0 < n <= 8 and e.cond2.shape == (2, n, 16) and e.mask2[1].sum() == 0
    assert e.uncond2.shape[1] == e.uncond_mask2.sum() == 0  # the empty negative prompt has no quoted text
    assert base.vae.use_slicing and base.vae.use_tiling
    with pytest.raises(ValueError, match="do not apply"):
        HunyuanVideo15Adapter(base.pipe, embedded_guidance=6.0)
    guider = base.pipe.guider
    base.pipe.guider = ClassifierFreeGuidance(guidance_scale=6.0, guidance_rescale=0.7)
    try:
        with pytest.raises(ValueError, match="only plain CFG"):
            HunyuanVideo15Adapter(base.pipe)
    finally:
        base.pipe.guider = guider


def test_specs_are_the_published_sizes():
    from diffusers import HunyuanVideo15Transformer3DModel

    with torch.device("meta"):
        n = sum(p.numel() for p in HunyuanVideo15Transformer3DModel(**HUNYUAN_VIDEO15_SPECS["hunyuanvideo1.5-480p-t2v"])
                .parameters())  # fmt: skip
    assert 8.0e9 < n < 8.6e9  # "8.3B"


@pytest.mark.parametrize("guidance", [6.0, 1.0], ids=["cfg", "cfg_distilled"])
def test_model_output_and_decode_reproduce_the_pipeline(base, guidance):
    """HunyuanVideo15Pipeline from our noise (its guider at `guidance`; 1.0 turns CFG off, as the distilled
    checkpoints ship): its last latent and its frames."""
    from diffusers import ClassifierFreeGuidance

    a, steps = base, 2
    x0 = torch.randn(1, *a.latent_shape(32, 32), generator=torch.Generator().manual_seed(1))
    guider, a.pipe.guider = a.pipe.guider, ClassifierFreeGuidance(guidance_scale=guidance)
    a.pipe.set_progress_bar_config(disable=True)
    try:
        call = dict(prompt=PROMPT, num_inference_steps=steps, height=32, width=32, num_frames=5)
        last = a.pipe(**call, latents=x0.clone(), output_type="latent").frames
        frames = a.pipe(**call, latents=x0.clone(), output_type="pt").frames
    finally:
        a.pipe.guider = guider
    grid = Sampler(SamplerConfig(num_steps=steps, height=32, width=32)).schedule(a)
    torch.testing.assert_close(grid.sigmas, a.pipe.scheduler.sigmas.float())
    e, x = a.encode_prompts([PROMPT]), x0.clone()
    with torch.no_grad():
        for i in range(steps):
            v = a.model_output(x, grid.sigmas[i], e, guidance, "full" if guidance > 1 else "none")
            x = x + (grid.sigmas[i + 1] - grid.sigmas[i]) * v
        torch.testing.assert_close(x, last, atol=2e-5, rtol=1e-5)
        video = a.decode(x)
    assert video.shape == frames.shape == (1, 5, 3, 32, 32)
    torch.testing.assert_close(video, frames, atol=1e-5, rtol=1e-5)
    assert video.std() > 0.01


def test_lora_and_cfg_modes():
    a = build_adapter("hunyuan_video15", tiny=True)
    params = a.add_lora(rank=4, alpha=8)
    names = [n for n, p in a.denoiser.named_parameters() if p.requires_grad]
    assert any("transformer_blocks.0.attn.to_q" in n for n in names) and any("refiner_blocks.0" in n for n in names)
    with torch.no_grad():
        for p in params:
            p.add_(0.05 * torch.randn_like(p))
    x, s = torch.randn(2, *a.latent_shape(32, 32)), torch.tensor([0.3, 0.8])
    e = a.encode_prompts([PROMPT, "a cat"])
    with torch.no_grad():
        full, det = a.model_output(x, s, e, 3.0, "full"), a.model_output(x, s, e, 3.0, "detach_uncond")
        cond = a.model_output(x, s, e, 0.0, "none")
        alone = a.model_output(x[1:], s[1:], e.index(1), 0.0, "none")  # no batch padding
        with a.reference():
            ref = a.model_output(x, s, e, 3.0, "full")
    assert torch.equal(full, det) and not torch.allclose(full, ref, atol=1e-4)
    torch.testing.assert_close(alone, cond[1:], atol=2e-5, rtol=1e-5)  # padding is masked out


def test_from_pretrained(tmp_path):
    a = build_adapter("hunyuan_video15", tiny=True)
    a.pipe.save_pretrained(tmp_path / "pipe")
    b = build_adapter("hunyuan_video15", pretrained=tmp_path / "pipe", num_frames=9)
    assert type(b) is HunyuanVideo15Adapter and b.scheduler_config == a.scheduler_config
    assert b.latent_shape(32, 32)[1] == 3 and b.max_sequence_length == b.pipe.tokenizer_max_length == 1000
    # the tiny pipeline's text settings (system message, byT5 length) are instance attributes, not saved: the same
    # embeddings go to both denoisers
    e = a.encode_prompts([PROMPT])
    x = torch.randn(1, *a.latent_shape(32, 32))
    with torch.no_grad():
        torch.testing.assert_close(a.model_output(x, 0.5, e, 0.0, "none"), b.model_output(x, 0.5, e, 0.0, "none"))
