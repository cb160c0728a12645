"""The adapter contract on every tiny family: prompts, CFG modes, decode, LoRA, reference, dtype, errors."""

import pytest
import torch
from adapter_variants import VARIANTS

from pipelines.adapters import ADAPTERS, Adapter, FluxAdapter, PromptEmbeds, build_adapter
from pipelines.adapters.embeds import real_tokens, stack_rows
from pipelines.plans import build_plan
from pipelines.sampler import Sampler, SamplerConfig

FAMILIES = ["sd3", "flux-dev", "sd15", "qwenimage"]  # one per family for the slower LoRA / grad / dtype tests
PROMPTS = ["a red cat", "a blue dog"]
W = 3.0


def build(variant: str, **kw) -> Adapter:
    name, opts = VARIANTS[variant]
    return build_adapter(name, tiny=True, **opts, **kw)


def inputs(a: Adapter, b: int = 2):
    x = torch.randn(b, *a.latent_shape(32, 32))
    s = torch.tensor([0.3, 0.8][:b]) if a.prediction == "velocity" else torch.tensor([300, 800][:b])
    return x, s


def uncond_as_cond(e: PromptEmbeds) -> PromptEmbeds:
    return PromptEmbeds(
        cond=e.uncond, pooled=e.uncond_pooled, mask=e.uncond_mask, cond2=e.uncond2, mask2=e.uncond_mask2
    )


def none_guidance(a: Adapter) -> float:
    # FLUX dev's CFG modes feed `embedded_guidance` to its guidance embedding; "none" feeds guidance_scale.
    return a.embedded_guidance if isinstance(a, FluxAdapter) else W


@pytest.fixture(scope="module", params=list(VARIANTS))
def variant(request) -> str:
    return request.param


@pytest.fixture(params=FAMILIES)
def family(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def adapter(variant) -> Adapter:
    """Shared by the read-only tests; tests that add LoRA build their own."""
    return build(variant)


def test_tiny_build(adapter):
    assert adapter.family in ADAPTERS and type(adapter) is ADAPTERS[adapter.family]
    assert adapter.prediction in ("velocity", "epsilon")
    assert isinstance(adapter.denoiser, torch.nn.Module) and isinstance(adapter.scheduler_config, dict)
    assert adapter.latent_shape(32, 32)[1:] == (16, 16)
    # denoiser image tokens (the FLUX / Qwen-Image shift depends on it): 2x2 patches except the UNet
    assert adapter.image_seq_len(32, 32) == (256 if adapter.family == "sd15" else 64)
    assert not any(p.requires_grad for m in adapter.pipe.components.values() if isinstance(m, torch.nn.Module)
                   for p in m.parameters())  # fmt: skip
    with pytest.raises(ValueError, match="multiples of"):
        adapter.latent_shape(33, 32)


def test_tiny_is_seeded():
    a, b, c = build("sd3"), build("sd3"), build("sd3", seed=1)
    wa, wb, wc = (next(x.denoiser.parameters()) for x in (a, b, c))
    assert torch.equal(wa, wb) and not torch.equal(wa, wc)


def test_encode_prompts_cached(adapter):
    adapter._cache.clear()
    calls = []
    encoders = [m for k, m in adapter.pipe.components.items() if k.startswith("text_encoder") and m is not None]
    hooks = [m.register_forward_hook(lambda *_: calls.append(1)) for m in encoders]
    try:
        e1 = adapter.encode_prompts([PROMPTS[0], PROMPTS[1], PROMPTS[0]])
        first = len(calls)
        assert first == 3 * len(encoders)  # one pass per encoder per new string (2 prompts and ""), each once
        e2 = adapter.encode_prompts([PROMPTS[1], PROMPTS[0]])
        assert len(calls) == first  # cached: no second encoder call
    finally:
        for h in hooks:
            h.remove()
    assert len(e1) == 3 and e1.uncond.shape[0] == 3 and e1.uncond.shape[2] == e1.cond.shape[2]
    assert torch.equal(e1.cond[0], e1.cond[2]) and torch.equal(e2.cond[0], e1.cond[1])
    assert torch.equal(e1.uncond[0], e1.uncond[2])
    assert not torch.equal(e1.cond[0], e1.cond[1])
    with pytest.raises(TypeError):
        adapter.encode_prompts("a red cat")


def test_an_embedding_does_not_depend_on_the_prompts_encoded_with_it(adapter):
    adapter._cache.clear()
    alone = adapter.encode_prompts([PROMPTS[1]])
    adapter._cache.clear()
    together = adapter.encode_prompts([PROMPTS[0], PROMPTS[1]]).index([1])
    assert torch.equal(alone.cond, together.cond) and torch.equal(alone.uncond, together.uncond)
    if alone.pooled is not None:  # pooled outputs are the ones that changed with the batch (exact resume)
        assert torch.equal(alone.pooled, together.pooled)


def test_prompt_cache_is_bounded_and_chunked():
    a = build("sd15", prompt_cache_size=2)
    for p in ["one", "two", "three", "four"]:
        a.encode_prompts([p])
    assert len(a._cache) <= 2 and "four" in a._cache
    words = ["one", "two", "three", "four", "five"]
    whole = a.encode_prompts(words)  # a batch larger than the cache is still served whole
    b = build("sd15")
    b.encode_batch_size = 2  # new strings are encoded 2 at a time
    torch.testing.assert_close(b.encode_prompts(words).cond, whole.cond)


def test_prompt_embeds_index_and_to(adapter):
    e = adapter.encode_prompts(PROMPTS)
    one = e.index([1])
    assert len(one) == 1 and torch.equal(one.cond[0], e.cond[1]) and torch.equal(e.index(1).cond, one.cond)
    picked = e.index(torch.tensor([1, 0, 1]))
    assert len(picked) == 3 and torch.equal(picked.uncond[2], e.uncond[1])
    half = e.to(dtype=torch.bfloat16)
    assert half.cond.dtype == torch.bfloat16 and (half.pooled is None or half.pooled.dtype == torch.bfloat16)


def test_second_token_stream_is_cached_batched_padded_and_paired_as_the_first():
    """A second masked stream (HunyuanVideo 1.5's byT5 tokens) in rows of different lengths: each stream keeps its
    real tokens, is padded to its own longest (mask 0), indexed, cast and paired [uncond; cond] for CFG."""

    def row(n: int, n2: int, fill: float) -> dict:  # one encoder pass of 1 prompt, padded to 5 / 4 tokens
        mask, mask2 = torch.arange(5)[None] < n, torch.arange(4)[None] < n2
        return {"embeds": torch.full((1, 5, 3), fill), "mask": mask, "embeds2": torch.full((1, 4, 2), -fill),
                "mask2": mask2.float(), "pooled": torch.full((1, 6), fill)}  # fmt: skip

    a, b, neg = (real_tokens(row(*r), 0) for r in ((2, 3, 1.0), (4, 0, 2.0), (1, 1, 3.0)))
    assert a["embeds"].shape == (1, 2, 3) and a["embeds2"].shape == (1, 3, 2) and b["embeds2"].shape == (1, 0, 2)
    e = PromptEmbeds.from_rows(stack_rows([a, b]), stack_rows([neg, neg]))
    assert e.cond.shape == (2, 4, 3) and e.cond2.shape == (2, 3, 2) and e.uncond2.shape == (2, 1, 2)
    assert e.mask2.tolist() == [[1, 1, 1], [0, 0, 0]] and e.cond2[1].abs().sum() == 0 and e.pooled.shape == (2, 6)
    pair = e.cfg_pair()
    assert pair["embeds2"].shape == (4, 3, 2) and pair["mask2"].tolist() == [[1, 0, 0]] * 2 + [[1, 1, 1], [0, 0, 0]]
    torch.testing.assert_close(pair["embeds2"][2:], e.cond2)
    assert torch.equal(pair["embeds2"][:2, :1], e.uncond2) and pair["embeds2"][:2, 1:].abs().sum() == 0
    assert e.conditional()["embeds2"] is e.cond2 and e.unconditional()["mask2"] is e.uncond_mask2
    one = e.index([1]).to(dtype=torch.bfloat16)
    assert one.cond2.dtype == one.mask2.dtype == torch.bfloat16 and one.mask.dtype == torch.bool  # masks: floats only
    assert "embeds2" not in PromptEmbeds(cond=e.cond, uncond=e.cond).cfg_pair()  # one-stream families see no key


def test_lora_writer_names_the_diffusers_class_that_writes_the_file():
    import diffusers
    from diffusers.loaders import HunyuanVideoLoraLoaderMixin

    from pipelines.adapters import HunyuanVideo15Adapter, SD3Adapter

    assert SD3Adapter._lora_writer() is diffusers.StableDiffusion3Pipeline  # default: the pipeline class's own
    assert not hasattr(diffusers.HunyuanVideo15Pipeline, "save_lora_weights")  # diffusers 0.42 has none for 1.5
    assert HunyuanVideo15Adapter._lora_writer() is HunyuanVideoLoraLoaderMixin


@pytest.mark.parametrize("mode", ["full", "detach_uncond", "none"])
def test_model_output_shapes(adapter, mode):
    x, s = inputs(adapter)
    e = adapter.encode_prompts(PROMPTS)
    with torch.no_grad():
        out = adapter.model_output(x, s, e, W, mode)
    assert out.shape == x.shape and out.dtype == torch.float32 and torch.isfinite(out).all()
    if adapter.prediction == "velocity":  # a float sigma broadcasts over the batch
        with torch.no_grad():
            assert torch.allclose(adapter.model_output(x, 0.3, e, W, mode)[0], out[0], atol=1e-5)


def test_full_cfg_equals_two_unbatched_calls(variant, adapter):
    if adapter.family == "qwenimage":  # its default CFG also rescales norms, as its pipeline does
        adapter = build(variant, cfg_renorm=False)
    x, s = inputs(adapter)
    e = adapter.encode_prompts(PROMPTS)
    with torch.no_grad():
        full = adapter.model_output(x, s, e, W, "full")
        detached = adapter.model_output(x, s, e, W, "detach_uncond")
        cond = adapter.model_output(x, s, e, none_guidance(adapter), "none")
        uncond = adapter.model_output(x, s, uncond_as_cond(e), none_guidance(adapter), "none")
    assert torch.equal(full, detached)
    torch.testing.assert_close(full, uncond + W * (cond - uncond), atol=5e-5, rtol=1e-5)
    assert not torch.allclose(full, cond, atol=1e-3)  # guidance really changes the output


def test_flux_dev_guidance_embedding_used_only_by_dev():
    for variant, used in (("flux-dev", True), ("flux-schnell", False)):
        a = build(variant)
        x, s = inputs(a)
        e = a.encode_prompts(PROMPTS)
        with torch.no_grad():
            same = torch.equal(a.model_output(x, s, e, 1.0, "none"), a.model_output(x, s, e, 4.0, "none"))
        assert same != used


def test_detach_uncond_gradients_flow_only_through_cond(family):
    a = build(family, **({"cfg_renorm": False} if family == "qwenimage" else {}))  # the plain formula first
    params = a.add_lora(rank=4)
    x, s = inputs(a)
    e = a.encode_prompts(PROMPTS)
    r = torch.randn_like(x)

    def grads(mode, emb, w=W):
        out = a.model_output(x, s, emb, w, mode)
        return torch.autograd.grad((out * r).sum(), params, allow_unused=True)

    # d/dθ [sg(u) + w (c - sg(u))] = w dc/dθ
    g_det = grads("detach_uncond", e)
    out_c = a.model_output(x, s, e, none_guidance(a), "none")
    g_cond = torch.autograd.grad((W * out_c * r).sum(), params, allow_unused=True)
    g_full = grads("full", e)
    # (Qwen-Image: LoRA on the last block's text-stream output gets no gradient; that output is unused)
    used = [i for i, g in enumerate(g_cond) if g is not None]
    assert len(used) >= len(params) - 4 and [g is not None for g in g_det] == [g is not None for g in g_cond]
    for i in used:
        torch.testing.assert_close(g_det[i], g_cond[i], atol=1e-5, rtol=1e-4)
    assert any(g_cond[i].abs().sum() > 0 for i in used)
    assert any(not torch.allclose(g_full[i], g_det[i], atol=1e-6) for i in used)

    # with respect to the inputs: the uncond embeddings get no gradient under detach_uncond
    if family == "qwenimage":
        a.cfg_renorm = True  # also with Qwen-Image's norm rescaling (its default)
    for mode, uncond_gets_grad in (("detach_uncond", False), ("full", True)):
        emb = e.to()
        emb.cond = e.cond.clone().requires_grad_()
        emb.uncond = e.uncond.clone().requires_grad_()
        out = a.model_output(x, s, emb, W, mode)
        gc, gu = torch.autograd.grad((out * r).sum(), [emb.cond, emb.uncond], allow_unused=True)
        assert gc is not None and gc.abs().sum() > 0
        assert (gu is not None and gu.abs().sum() > 0) == uncond_gets_grad


def test_decode_range_and_shape(adapter):
    x, _ = inputs(adapter)
    with torch.no_grad():
        img = adapter.decode(x)
    assert img.shape == (2, 3, 32, 32) and img.dtype == torch.float32
    assert img.min() >= 0 and img.max() <= 1


@pytest.mark.parametrize("init", ["gaussian", "default"])
def test_add_lora_trains_only_lora_and_starts_at_base(family, init):
    a = build(family)
    x, s = inputs(a)
    e = a.encode_prompts(PROMPTS)
    with torch.no_grad():
        base = a.model_output(x, s, e, W, "full")
    params = a.add_lora(rank=4, alpha=8, init=init)
    trainable = [p for m in a.pipe.components.values() if isinstance(m, torch.nn.Module)
                 for p in m.parameters() if p.requires_grad]  # fmt: skip
    assert {id(p) for p in trainable} == {id(p) for p in params} and len(params) > 0
    names = [n for n, p in a.denoiser.named_parameters() if p.requires_grad]
    assert all(".lora_A." in n or ".lora_B." in n for n in names)
    assert all(torch.count_nonzero(p) == 0 for n, p in a.denoiser.named_parameters() if ".lora_B." in n)
    assert all(torch.count_nonzero(p) > 0 for n, p in a.denoiser.named_parameters() if ".lora_A." in n)
    with torch.no_grad():
        torch.testing.assert_close(a.model_output(x, s, e, W, "full"), base, atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="init"):
        a.add_lora(init="zeros", adapter_name="other")


def test_reference_is_the_base_model(family):
    a = build(family)
    x, s = inputs(a)
    e = a.encode_prompts(PROMPTS)
    with torch.no_grad():
        with a.reference():  # no adapter yet: a no-op
            base = a.model_output(x, s, e, W, "full")
        params = a.add_lora(rank=4)
        for p in params:
            p.add_(0.1 * torch.randn_like(p))
        tuned = a.model_output(x, s, e, W, "full")
        with a.reference():
            ref = a.model_output(x, s, e, W, "full")
        after = a.model_output(x, s, e, W, "full")
    assert not torch.allclose(tuned, base, atol=1e-4)
    torch.testing.assert_close(ref, base, atol=1e-6, rtol=0)
    torch.testing.assert_close(after, tuned, atol=0, rtol=0)
    assert all(p.requires_grad for p in params)  # peft's disable/enable toggles these; restored


def test_lora_save_load_round_trip(family, tmp_path):
    a = build(family)
    params = a.add_lora(rank=4, alpha=2, init="default")
    with torch.no_grad():
        for p in params:
            p.add_(0.1 * torch.randn_like(p))
    path = a.save_lora(tmp_path / "lora")
    assert (tmp_path / "lora" / "pytorch_lora_weights.safetensors").is_file()
    b = build(family)
    loaded = b.load_lora(path)
    assert len(loaded) == len(params) and all(p.requires_grad and p.dtype == torch.float32 for p in loaded)
    b.add_lora(rank=4, adapter_name="unused")  # loading again replaces "default", other adapters stay
    b.load_lora(tmp_path / "lora" / "pytorch_lora_weights.safetensors")  # a file path works too
    x, s = inputs(a)
    e = a.encode_prompts(PROMPTS)
    with torch.no_grad():
        torch.testing.assert_close(b.model_output(x, s, e, W, "full"), a.model_output(x, s, e, W, "full"))
    with pytest.raises(FileNotFoundError, match="nope"):
        b.load_lora(tmp_path / "nope")


def test_bf16_model_runs(family):
    a = build(family, dtype=torch.bfloat16)
    assert a.dtype == torch.bfloat16 and a.vae.dtype == torch.bfloat16
    x, s = inputs(a)
    e = a.encode_prompts(PROMPTS)
    assert e.cond.dtype == torch.bfloat16
    params = a.add_lora(rank=4)
    assert all(p.dtype == torch.float32 for p in params)  # LoRA weights stay float32 on a bf16 base
    for mode in ("full", "detach_uncond", "none"):
        out = a.model_output(x, s, e, W, mode)
        assert out.dtype == torch.float32 and torch.isfinite(out).all()
    (out * torch.randn_like(out)).sum().backward()
    grads = [p.grad for p in params if p.grad is not None]
    assert len(grads) >= len(params) - 4 and all(torch.isfinite(g).all() for g in grads)
    with torch.no_grad():
        img = a.decode(x)
        ref = build(family).model_output(x, s, e.to(dtype=torch.float32), W, "none")
    assert img.dtype == torch.float32 and 0 <= img.min() and img.max() <= 1
    assert (out.detach() - ref).abs().mean() < 0.1 * ref.abs().mean()  # bf16 close to the fp32 model


def test_bad_inputs_are_named():
    a = build("sd3")
    x, s = inputs(a)
    e = a.encode_prompts(PROMPTS)
    with pytest.raises(ValueError, match="cfg_mode"):
        a.model_output(x, s, e, W, "half")
    with pytest.raises(ValueError, match="rows"):
        a.model_output(x[:1], s[:1], e, W)
    with pytest.raises(ValueError, match="uncond"):
        a.model_output(x, s, PromptEmbeds(cond=e.cond, pooled=e.pooled), W, "full")
    with pytest.raises(ValueError, match="no LoRA adapter"):
        a.save_lora("/tmp/never-written")
    with pytest.raises(ValueError, match=r"'sdxl'; valid: \['flux', 'flux2', .*'qwenimage', .*'sd3', .*'zimage'\]"):
        build_adapter("sdxl", tiny=True)
    with pytest.raises(ValueError, match="exactly one"):
        build_adapter("sd3")
    with pytest.raises(ValueError, match="exactly one"):
        build_adapter("sd3", pretrained="x/y", tiny=True)


# ---- video families (5-D latents [B, C, F, h, w]): what they share, checked once for each ------------------------

VIDEO = ["wan", "hunyuan_video", "hunyuan_video15"]
VIDEO_PROMPT = 'a sign that says "hi"'  # quoted text: HunyuanVideo 1.5's second (byT5) token stream is used
RESCORE_CASES = [("flow_sde", {"a": 0.7}, "full_sde", 2), ("dance_sde", {"eta": 0.3}, "full_sde", 2),
                 ("cps", {"a": 0.7}, "full_sde", 2), ("flow_sde", {"a": 0.7}, "tree", 4)]  # fmt: skip


@pytest.fixture(scope="module", params=VIDEO)
def video(request) -> Adapter:
    return build_adapter(request.param, tiny=True)


@pytest.mark.parametrize(
    "kernel,settings,plan_name,group", RESCORE_CASES, ids=[f"{c[0]}-{c[2]}" for c in RESCORE_CASES]
)
def test_video_rescore_gives_ratio_one(video, kernel, settings, plan_name, group):
    config = SamplerConfig(num_steps=4, sde_kernel={"name": kernel, **settings}, cfg_mode="full", guidance_scale=4.0,
                           keep_means=True)  # fmt: skip
    plan = build_plan(plan_name, 4, **({"split_steps": (0, 2)} if plan_name == "tree" else {}))
    tree = Sampler(config).run(video, [VIDEO_PROMPT], plan, group, torch.Generator().manual_seed(0))
    assert tree.states.shape[1:] == video.latent_shape(config.height, config.width)
    edges = tree.trained_edges()
    out = Sampler(config).rescore(video, tree, edges, [VIDEO_PROMPT])  # the first training pass: detach_uncond, grad
    assert edges.numel() > 0
    assert torch.allclose(out.logp, tree.edge_logp[edges], atol=1e-5, rtol=0)
    assert torch.allclose(out.mean, tree.edge_mean[edges], atol=1e-5, rtol=0)


@pytest.mark.parametrize("video_family", VIDEO)
def test_video_lora_file_loads_in_diffusers_and_changes_its_output(video_family, tmp_path):
    a = build_adapter(video_family, tiny=True)
    params = a.add_lora(rank=4, alpha=8)
    with torch.no_grad():
        for p in params:
            p.add_(0.05 * torch.randn_like(p))
    a.save_lora(tmp_path / "lora")
    x, e = torch.randn(1, *a.latent_shape(32, 32)), a.encode_prompts([VIDEO_PROMPT])
    fresh = build_adapter(video_family, tiny=True)
    with torch.no_grad():
        mine, before = a.model_output(x, 0.6, e, 6.0, "none"), fresh.model_output(x, 0.6, e, 6.0, "none")
        if hasattr(fresh.pipe, "load_lora_weights"):
            fresh.pipe.load_lora_weights(tmp_path / "lora")  # diffusers' own loader of the family's pipeline
        else:  # HunyuanVideo15Pipeline has none (diffusers 0.42): its transformer's
            fresh.denoiser.load_lora_adapter(tmp_path / "lora", prefix="transformer", use_safetensors=True)
        after = fresh.model_output(x, 0.6, e, 6.0, "none")
    assert not torch.allclose(before, after, atol=1e-4)
    torch.testing.assert_close(after, mine, atol=1e-5, rtol=1e-5)  # alpha / rank survived in the metadata


@pytest.mark.parametrize("video_family", VIDEO)
def test_video_detached_uncond_gradient_is_the_cond_branch_s(video_family):
    """Flow-GRPO's training forward ("detach_uncond", scale w) gives the LoRA w x the cond branch's gradient."""
    a = build_adapter(video_family, tiny=True)
    params = a.add_lora(rank=4)
    with torch.no_grad():
        for p in params:  # B = 0 at init: make the LoRA count
            p.add_(0.05 * torch.randn_like(p))
    x, s = torch.randn(2, *a.latent_shape(32, 32)), torch.tensor([0.3, 0.8])
    e = a.encode_prompts([VIDEO_PROMPT, "a blue dog"])
    embedded = getattr(a, "embedded_guidance", 0.0)  # HunyuanVideo: what the CFG modes feed its guidance embedding
    r = torch.randn_like(x)
    g_det = torch.autograd.grad((a.model_output(x, s, e, 3.0, "detach_uncond") * r).sum(), params, allow_unused=True)
    g_cond = torch.autograd.grad((3.0 * a.model_output(x, s, e, embedded, "none") * r).sum(), params, allow_unused=True)
    used = [i for i, g in enumerate(g_cond) if g is not None]
    assert len(used) > len(params) // 2
    for i in used:
        torch.testing.assert_close(g_det[i], g_cond[i], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("video_family,share", [("wan", 0.8), ("hunyuan_video", 0.8), ("hunyuan_video15", 0.7)])
def test_video_full_finetune_reaches_the_weights_and_its_folder_loads_back(video_family, share, tmp_path):
    """A full fine-tune (DanceGRPO's HunyuanVideo recipe): (nearly) every denoiser weight gets a gradient through the
    5-D CFG forward; `save_denoiser` writes a folder the model class loads back."""
    a = build_adapter(video_family, tiny=True)
    x, e = torch.randn(1, *a.latent_shape(32, 32)), a.encode_prompts([VIDEO_PROMPT])
    a.denoiser.requires_grad_(True)
    a.model_output(x, 0.5, e, 4.0, "detach_uncond").square().mean().backward()
    grads = [p.grad for p in a.denoiser.parameters()]
    assert sum(g is not None and bool(g.abs().sum() > 0) for g in grads) > share * len(grads)
    with torch.no_grad():
        a.denoiser.proj_out.weight.add_(0.01)
    a.save_denoiser(tmp_path / "ft")
    loaded = type(a.denoiser).from_pretrained(tmp_path / "ft")
    assert torch.equal(loaded.proj_out.weight, a.denoiser.proj_out.weight)
