"""Wan 2.2 TI2V-5B image-to-video (family wan2.2_i2v): the generated frames and the decoded clip equal
WanImageToVideoPipeline's own loop (expand_timesteps, the first latent frame the encoded image); the action is the
generated frames alone and the model sees the clean image frame at every step of a rollout and of its re-score
(ratio 1 with flow_sde and dance_sde); LoRA loads in diffusers' Wan loader; the clip starts with the image's
reconstruction; rows without an image and the pipelines it does not run are one-line errors."""

import pytest
import torch

from flowgrpo.config import ConfigError
from flowgrpo.t2i.edit_data import check_family
from pipelines.adapters import Wan22I2VAdapter, build_adapter
from pipelines.adapters.editing import EditPrompt, to_pil
from pipelines.plans import build_plan
from pipelines.sampler import Sampler, SamplerConfig

SIZE, FRAMES = 32, 5  # tiny TI2V VAE: 8x spatial, 2x temporal -> 3 latent frames: the image's + 2 generated


@pytest.fixture(scope="module")
def a() -> Wan22I2VAdapter:
    return build_adapter("wan2.2_i2v", tiny=True, scheduler="euler")


def _image(seed: int) -> torch.Tensor:
    return (torch.rand(3, SIZE, SIZE, generator=torch.Generator().manual_seed(seed)) * 255).to(torch.uint8)


PROMPT = EditPrompt("a red cat walks", [_image(1)])


def test_reproduces_the_pipeline_and_starts_with_the_image(a):
    assert a.latent_shape(SIZE, SIZE) == (8, 2, 4, 4) and a.num_frames == FRAMES  # the generated frames only
    full = torch.randn(1, 8, 3, 4, 4, generator=torch.Generator().manual_seed(0))  # the pipeline's noise, all frames
    seen = {}

    def keep(pipe, i, t, kw):
        seen["latents"] = kw["latents"]
        return {}

    a.pipe.set_progress_bar_config(disable=True)
    frames = a.pipe(
        image=to_pil(PROMPT.images[0]), prompt=str(PROMPT), num_inference_steps=2, height=SIZE, width=SIZE,
        num_frames=FRAMES, latents=full.clone(), guidance_scale=4.0, max_sequence_length=a.max_sequence_length,
        output_type="pt", callback_on_step_end=keep,
    ).frames  # fmt: skip
    grid = Sampler(SamplerConfig(num_steps=2, height=SIZE, width=SIZE)).schedule(a)
    torch.testing.assert_close(grid.sigmas, a.pipe.scheduler.sigmas.float())
    e, x = a.encode_prompts([PROMPT]), full[:, :, 1:].clone()
    with torch.no_grad():
        for i in range(2):
            x = x + (grid.sigmas[i + 1] - grid.sigmas[i]) * a.model_output(x, grid.sigmas[i], e, 4.0, "full")
        torch.testing.assert_close(x, seen["latents"][:, :, 1:], atol=2e-5, rtol=1e-5)
        video = a.decode(x, [PROMPT])
        assert video.shape == frames.shape == (1, FRAMES, 3, SIZE, SIZE)
        torch.testing.assert_close(video, frames, atol=1e-5, rtol=1e-5)
        # the clip's first frame is the image's VAE reconstruction (the Wan VAE is causal in time)
        z = a.vae.encode(PROMPT.images[0].float()[None, :, None] / 127.5 - 1).latent_dist.mode()
        recon = (a.vae.decode(z, return_dict=False)[0][:, :, 0] / 2 + 0.5).clamp(0, 1)
        torch.testing.assert_close(video[:, 0], recon, atol=1e-5, rtol=1e-5)
        a._references.clear()  # an image evicted since its rollout: encoded again for the decode
        torch.testing.assert_close(a.decode(x, [PROMPT]), video)
    with pytest.raises(ValueError, match="decode\\(latents, prompts\\) with one prompt per row \\(1\\), got none"):
        a.decode(x)


@pytest.mark.parametrize("kernel,settings", [("flow_sde", {"a": 0.7}), ("dance_sde", {"eta": 0.3})])
def test_first_frame_clean_and_ratio_one(a, kernel, settings, monkeypatch):
    """Every transformer call of the rollout and of the re-score (with grad, LoRA on) sees the image's frame at
    timestep 0; the stored states are the generated frames; the first training pass gives ratio 1; each image goes
    through the VAE once."""
    prompts = [PROMPT, EditPrompt("a blue car", [_image(2)])]
    a._references.clear(), a._stacked.clear()  # nothing encoded yet (the other kernel's case ran before)
    encodes, encode = [], a.vae.encode
    monkeypatch.setattr(a.vae, "encode", lambda x: encodes.append(x.shape) or encode(x))
    first = a.first_frames(prompts)  # not cached: decode's read-only path
    seen = []

    def watch(module, args, kw):
        x, t = kw["hidden_states"], kw["timestep"]
        seen.append((x[:, :, 0].float(), t[:, :4], t[:, 4:]))  # 4 tokens per latent frame (4x4 cells, 2x2 patches)

    params = a.add_lora(rank=4, adapter_name="ratio")
    handle = a.denoiser.register_forward_pre_hook(watch, with_kwargs=True)
    try:
        sampler = Sampler(SamplerConfig(num_steps=2, height=SIZE, width=SIZE, cfg_mode="full", guidance_scale=3.0,
                                        sde_kernel={"name": kernel, **settings}, keep_means=True))  # fmt: skip
        tree = sampler.run(
            a, prompts, build_plan("full_sde", 2, train_fraction=1.0), 2, torch.Generator().manual_seed(0)
        )
        edges = tree.trained_edges()
        out = sampler.rescore(a, tree, edges, prompts)
    finally:
        handle.remove()
        a.denoiser.delete_adapters("ratio")
    assert tree.states.shape[1:] == (8, 2, 4, 4) and edges.numel() == 8 and out.logp.requires_grad
    assert len(encodes) == 2 + 2  # first_frames' two, then once per image for the rollout and its re-score
    torch.testing.assert_close(out.logp, tree.edge_logp[edges], atol=1e-6, rtol=0)  # exp(new - old) = 1
    torch.testing.assert_close(out.mean, tree.edge_mean[edges], atol=1e-6, rtol=0)
    out.logp.sum().backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in params)
    assert len(seen) == 3  # two rollout steps, one re-score batch (CFG batched: [uncond; cond])
    for x0, t_first, t_rest in seen:
        assert bool((t_first == 0).all()) and bool((t_rest > 0).all())
        assert all(any(torch.allclose(x0[r], first[k, :, 0]) for k in range(2)) for r in range(x0.shape[0]))


def test_lora_loads_in_the_diffusers_pipeline(a, tmp_path):
    params = a.add_lora(rank=4, alpha=8, adapter_name="default")
    try:
        with torch.no_grad():
            for p in params:
                p.add_(0.05 * torch.randn_like(p))
        x, e = torch.randn(1, *a.latent_shape(SIZE, SIZE)), a.encode_prompts([PROMPT])
        with torch.no_grad():
            mine = a.model_output(x, 0.6, e, 0.0, "none")
        a.save_lora(tmp_path / "lora")
    finally:
        a.denoiser.delete_adapters("default")
    fresh = build_adapter("wan2.2_i2v", tiny=True, scheduler="euler")
    with torch.no_grad():
        before = fresh.model_output(x, 0.6, fresh.encode_prompts([PROMPT]), 0.0, "none")
        fresh.pipe.load_lora_weights(tmp_path / "lora")  # WanImageToVideoPipeline's own loader
        after = fresh.model_output(x, 0.6, fresh.encode_prompts([PROMPT]), 0.0, "none")
    assert type(fresh.pipe).__name__ == "WanImageToVideoPipeline" and not torch.allclose(before, after, atol=1e-4)
    torch.testing.assert_close(after, mine, atol=1e-5, rtol=1e-5)


def test_rows_without_an_image_and_other_pipelines_are_refused(a):
    with pytest.raises(ConfigError, match="every prompt row needs 'images'.*the first: row 2, 'a dog'") as err:
        check_family([PROMPT, "a dog"], "wan2.2_i2v")
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="wan2.2_i2v edits images: prompt 'a dog' names no input image"):
        a.encode_prompts(["a dog"])
    with pytest.raises(ValueError, match="at least 3, got 1"):
        Wan22I2VAdapter(a.pipe, num_frames=1)
    t2v = build_adapter("wan2.2", tiny=True)  # A14B: two experts
    with pytest.raises(ValueError, match="two-expert pipeline .* is not supported"):
        Wan22I2VAdapter(t2v.pipe)


def test_loads_the_published_ti2v_folder(tmp_path):
    """Wan2.2-TI2V-5B-Diffusers is saved as a WanPipeline: it loads as WanImageToVideoPipeline, same weights."""
    t2v = build_adapter("wan2.2", tiny=True, variant="ti2v")
    t2v.pipe.save_pretrained(tmp_path / "ti2v")
    i2v = Wan22I2VAdapter.from_pretrained(tmp_path / "ti2v", num_frames=FRAMES)
    assert type(i2v.pipe).__name__ == "WanImageToVideoPipeline" and i2v.latent_shape(SIZE, SIZE) == (8, 2, 4, 4)
    same = zip(t2v.denoiser.state_dict().values(), i2v.denoiser.state_dict().values())
    assert all(torch.equal(x, y) for x, y in same)
