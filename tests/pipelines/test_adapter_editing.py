"""Image-editing adapters (FLUX.1 Kontext, Qwen-Image-Edit, Qwen-Image-Edit-Plus) against diffusers' own pipelines:
the same denoising loop gives the same latents, re-scoring a rollout gives ratio 1 for every kernel, the source
images are encoded once per prompt, only the generated tokens are the action, LoRA files load into the pipeline,
and save_pretrained / from_pretrained round trips."""

import pytest
import torch

from pipelines.adapters import build_adapter
from pipelines.adapters.editing import EditEmbeds, EditPrompt
from pipelines.adapters.flux import pack, unpack
from pipelines.plans import build_plan
from pipelines.sampler import Sampler, SamplerConfig

FAMILIES = ["flux_kontext", "qwenimage_edit", "qwenimage_edit_plus"]
STEPS = 2


def image(seed: int, size: int = 32) -> torch.Tensor:
    return torch.randint(0, 256, (3, size, size), generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)


@pytest.fixture(scope="module")
def adapters():
    return {f: build_adapter(f, tiny=True) for f in FAMILIES}


def prompts_for(family: str) -> list[EditPrompt]:
    second = [image(2), image(3)] if family == "qwenimage_edit_plus" else [image(2)]  # Plus: 1 and 2 references
    return [EditPrompt("make it red", [image(1)]), EditPrompt("add a hat", second)]


# --- the diffusers pipelines' own loop ----------------------------------------------------------------------------


def _qwen_sizes(monkeypatch):
    """The Qwen edit pipelines resize their input to ~1024 x 1024 px; at 32 x 32 here (the tiny model's size)."""
    import diffusers.pipelines.qwenimage.pipeline_qwenimage_edit as edit
    import diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus as plus

    orig = edit.calculate_dimensions
    monkeypatch.setattr(edit, "calculate_dimensions", lambda area, ratio: orig(32 * 32, ratio))
    monkeypatch.setattr(plus, "VAE_IMAGE_SIZE", 32 * 32)


# (family, pipeline call kwargs, our guidance, our cfg_mode, negative prompt)
LOOPS = [
    ("flux_kontext", {"guidance_scale": 3.0}, 3.0, "none", ""),  # distilled guidance embedding
    (
        "flux_kontext",
        {"guidance_scale": 3.5, "true_cfg_scale": 2.0, "negative_prompt": "blurry"},
        2.0,
        "full",
        "blurry",
    ),
    ("qwenimage_edit", {"true_cfg_scale": 4.0, "negative_prompt": "blurry"}, 4.0, "full", "blurry"),
    ("qwenimage_edit_plus", {"true_cfg_scale": 4.0, "negative_prompt": " "}, 4.0, "full", " "),
]


@pytest.mark.parametrize("family,call,w,mode,negative", LOOPS, ids=[f"{f}-{m}" for f, _, _, m, _ in LOOPS])
def test_model_output_reproduces_the_diffusers_edit_pipeline(adapters, monkeypatch, family, call, w, mode, negative):
    from pipelines.adapters.editing import to_pil

    a = adapters[family]
    _qwen_sizes(monkeypatch)
    sources = [image(5), image(6)] if family == "qwenimage_edit_plus" else [image(5)]
    x0 = torch.randn(1, *a.latent_shape(32, 32), generator=torch.Generator().manual_seed(0))
    kw = dict(prompt="make it red", num_inference_steps=STEPS, height=32, width=32, output_type="latent", **call)
    if family == "flux_kontext":
        kw.update(max_sequence_length=16, max_area=32 * 32, _auto_resize=False)
    pils = [to_pil(s) for s in sources]
    a.pipe.set_progress_bar_config(disable=True)
    ref = unpack(a.pipe(image=pils if len(pils) > 1 else pils[0], latents=pack(x0), **kw).images, 32 // 2, 32 // 2)
    with torch.no_grad():
        e = a.encode_prompts([EditPrompt("make it red", sources)], negative_prompt=negative)
        s, x = a.pipe.scheduler.sigmas, x0.clone()
        for i in range(STEPS):
            x = x + (s[i + 1] - s[i]) * a.model_output(x, s[i], e, w, mode)
    torch.testing.assert_close(x, ref, atol=2e-5, rtol=1e-5)


# --- RL contract --------------------------------------------------------------------------------------------------

KERNELS = [("flow_sde", {"a": 0.9}), ("dance_sde", {"eta": 0.3}), ("cps", {"a": 0.7})]


@pytest.mark.parametrize("kernel", KERNELS, ids=[k[0] for k in KERNELS])
@pytest.mark.parametrize("family", FAMILIES)
def test_rescore_of_an_edit_rollout_gives_ratio_one(adapters, family, kernel):
    a = adapters[family]
    ps = prompts_for(family)
    sampler = Sampler(
        SamplerConfig(
            num_steps=3, sde_kernel={"name": kernel[0], **kernel[1]}, guidance_scale=3.0, keep_means=True,
            cfg_mode="none" if family == "flux_kontext" else "full",
        )
    )  # fmt: skip
    plan = build_plan("tree", 3, split_steps=(0, 1))
    tree = sampler.run(a, ps, plan, 4, torch.Generator().manual_seed(0))
    edges = tree.trained_edges()
    assert edges.numel() > 0
    out = sampler.rescore(a, tree, edges, ps)
    assert torch.allclose(out.logp, tree.edge_logp[edges], atol=1e-5, rtol=0), (
        (out.logp - tree.edge_logp[edges]).abs().max()
    )
    assert torch.allclose(out.mean, tree.edge_mean[edges], atol=1e-5)


@pytest.mark.parametrize("family", FAMILIES)
def test_sources_are_encoded_once_per_prompt_not_per_step_or_group_member(adapters, family, monkeypatch):
    a = build_adapter(family, tiny=True)
    calls = {"vae": 0, "text": 0}
    vae_encode, text_forward = a.vae.encode, a.pipe.text_encoder.forward

    def count(name, fn):
        def wrapped(*args, **kw):
            calls[name] += 1
            return fn(*args, **kw)

        return wrapped

    monkeypatch.setattr(a.vae, "encode", count("vae", vae_encode))
    monkeypatch.setattr(a.pipe.text_encoder, "forward", count("text", text_forward))
    ps = prompts_for(family)
    sampler = Sampler(SamplerConfig(num_steps=3, guidance_scale=2.0, keep_means=True))
    tree = sampler.run(a, ps, build_plan("full_sde", 3), 4, torch.Generator().manual_seed(0))
    sampler.rescore(a, tree, tree.trained_edges(), ps)
    n_images = sum(len(p.images) for p in ps)
    assert calls["vae"] == n_images  # one VAE encode per source image, for 3 steps x 4 images x re-scoring
    # texts: each instruction (+ the negative: once, or once per source where the text encoder sees the images)
    assert calls["text"] == (2 * len(ps) if a.text_sees_images else len(ps) + 1)


@pytest.mark.parametrize("family", FAMILIES)
def test_only_the_generated_tokens_are_the_action_and_the_source_matters(adapters, family):
    a = adapters[family]
    params = a.add_lora(rank=4, adapter_name="grad") if "grad" not in getattr(a.denoiser, "peft_config", {}) else None
    try:
        ps = prompts_for(family)[:1]
        e = a.encode_prompts(ps)
        assert isinstance(e, EditEmbeds) and not e.reference.requires_grad and e.reference_shapes.tolist() == [[[8, 8]]]
        x = torch.randn(1, *a.latent_shape(32, 32))
        v = a.model_output(x, 0.7, e, 2.0, "full")
        assert v.shape == x.shape  # the reference tokens' output is dropped
        v.square().mean().backward()
        assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in params)
        with torch.no_grad():
            other_image = a.model_output(x, 0.7, a.encode_prompts([EditPrompt("make it red", [image(9)])]), 2.0)
            other_text = a.model_output(x, 0.7, a.encode_prompts([EditPrompt("make it blue", [image(1)])]), 2.0)
        assert (other_image - v).abs().max() > 1e-4 and (other_text - v).abs().max() > 1e-4
        if a.text_sees_images:  # the VL encoder's rows depend on the image
            rows = a.encode_prompts([EditPrompt("make it red", [image(1)]), EditPrompt("make it red", [image(9)])])
            assert not torch.equal(rows.cond[0], rows.cond[1]) and not torch.equal(rows.uncond[0], rows.uncond[1])
    finally:
        a.denoiser.delete_adapters("grad")


def test_prompts_without_images_or_with_too_many_are_refused(adapters):
    with pytest.raises(ValueError, match="flux_kontext edits images: prompt 'a cat' names no input image"):
        adapters["flux_kontext"].encode_prompts(["a cat"])
    with pytest.raises(ValueError, match="qwenimage_edit takes 1 input image"):
        adapters["qwenimage_edit"].encode_prompts([EditPrompt("x", [image(1), image(2)])])
    with pytest.raises(TypeError, match="uint8"):
        EditPrompt("x", [torch.zeros(3, 8, 8)])
    a, b, c = EditPrompt("x", [image(1)]), EditPrompt("x", [image(1)]), EditPrompt("x", [image(2)])
    assert a == b and hash(a) == hash(b) and a != c and len({a, b, c}) == 2 and str(c) == "x"
    assert a == "x" and hash(a) == hash("x") and a != "y"  # a plain str of its text compares as the text


# --- LoRA, full fine-tune, from_pretrained ----------------------------------------------------------------------------


def _perturbed_lora(a, seed: int = 0):
    params = a.add_lora(rank=4, adapter_name="default")
    with torch.no_grad():
        g = torch.Generator().manual_seed(seed)
        for p in params:
            p.add_(0.3 * torch.randn(p.shape, generator=g))


@pytest.mark.parametrize("family", ["flux_kontext", "qwenimage_edit_plus"])
def test_lora_saved_for_the_pipelines_load_lora_weights_and_from_pretrained(family, tmp_path):
    a = build_adapter(family, tiny=True)
    a.pipe.save_pretrained(tmp_path / "base")
    _perturbed_lora(a)
    a.save_lora(tmp_path / "lora")
    b = build_adapter(family, pretrained=tmp_path / "base", max_sequence_length=a.max_sequence_length)
    assert type(b) is type(a)
    ps = prompts_for(family)
    x, s = torch.randn(2, *a.latent_shape(32, 32)), torch.tensor([0.3, 0.8])
    with torch.no_grad():
        with a.reference():
            base_a = a.model_output(x, s, a.encode_prompts(ps), 2.0)
        torch.testing.assert_close(b.model_output(x, s, b.encode_prompts(ps), 2.0), base_a, atol=1e-5, rtol=1e-5)
        b.pipe.load_lora_weights(tmp_path / "lora")  # diffusers' own loader
        want = a.model_output(x, s, a.encode_prompts(ps), 2.0)
        assert (want - base_a).abs().max() > 1e-3
        torch.testing.assert_close(b.model_output(x, s, b.encode_prompts(ps), 2.0), want, atol=1e-5, rtol=1e-5)


def test_full_finetune_saved_denoiser_loads_into_the_pipeline(tmp_path):
    from diffusers import QwenImageTransformer2DModel

    a = build_adapter("qwenimage_edit", tiny=True)
    with torch.no_grad():
        for p in a.denoiser.parameters():
            p.add_(0.01)
    a.save_denoiser(tmp_path / "transformer")
    loaded = QwenImageTransformer2DModel.from_pretrained(tmp_path / "transformer")
    ps = prompts_for("qwenimage_edit")[:1]
    x = torch.randn(1, *a.latent_shape(32, 32))
    with torch.no_grad():
        want = a.model_output(x, 0.5, a.encode_prompts(ps), 2.0)
        a.pipe.transformer = loaded
        torch.testing.assert_close(a.model_output(x, 0.5, a.encode_prompts(ps), 2.0), want)
