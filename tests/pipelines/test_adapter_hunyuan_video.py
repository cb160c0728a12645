"""HunyuanVideo adapter: HunyuanVideoPipeline's own loop reproduced on 5-D video latents (template + crop, embedded
guidance, true CFG, the shifted grid, decode to frames), CFG modes, on-policy ratio 1 for every flow kernel, LoRA in
diffusers' loader, a full fine-tune saved as a model folder, from_pretrained, tiled decode, the published spec."""

import pytest
import torch

from pipelines.adapters import HunyuanVideoAdapter, PromptEmbeds, build_adapter
from pipelines.adapters.hunyuan_video import HUNYUAN_VIDEO_SPECS, TINY_PROMPT_TEMPLATE
from pipelines.plans import build_plan
from pipelines.sampler import Sampler, SamplerConfig

PROMPT = "a red cat"


@pytest.fixture(scope="module")
def base() -> HunyuanVideoAdapter:
    return build_adapter("hunyuan_video", tiny=True)


def test_geometry_prompt_crop_and_refusals(base):
    assert base.num_frames == 5 and base.latent_shape(32, 32) == (4, 2, 8, 8)  # (5 - 1) // 4 + 1 latent frames
    assert base.latent_shape(32, 48, num_frames=9) == (4, 3, 8, 12) and base.image_seq_len(32, 32) == 2 * 4 * 4
    with pytest.raises(ValueError, match="num_frames must be 1 \\+ a multiple of 4"):
        base.latent_shape(32, 32, num_frames=6)
    with pytest.raises(ValueError, match="multiples of 8"):
        base.latent_shape(36, 32)
    with pytest.raises(ValueError, match="latents must be 5-D"):
        base.model_output(torch.randn(1, 4, 8, 8), 0.5, base.encode_prompts([PROMPT]), 1.0, "none")
    with pytest.raises(ValueError, match="prompt_template needs"):
        HunyuanVideoAdapter(base.pipe, prompt_template={"template": "no slot"})
    # the crop removes exactly the system turn: the kept tokens are the prompt's bytes + <|eot_id|>
    prefix = TINY_PROMPT_TEMPLATE["template"].split("{}")[0]
    assert len(base.pipe.tokenizer(prefix).input_ids) == TINY_PROMPT_TEMPLATE["crop_start"]
    e = base.encode_prompts([PROMPT, "a much longer prompt"])
    assert e.mask.sum(1).tolist() == [len(PROMPT) + 1, 16]  # the second is cut at max_sequence_length
    assert e.pooled.shape == (2, 32) and e.uncond.shape[1] == 1  # "" -> <|eot_id|> only
    # bounded decode memory: slices and spatial tiles on by default (temporal tiles are diffusers' default)
    assert base.vae.use_slicing and base.vae.use_tiling and base.vae.use_framewise_decoding
    # the pipeline's grid: uniform sigmas through the scheduler's static shift (7.0), then 0
    grid = Sampler(SamplerConfig(num_steps=4, height=32, width=32)).schedule(base)
    s = torch.linspace(1.0, 0.25, 4)
    torch.testing.assert_close(grid.sigmas[:-1], 7 * s / (1 + 6 * s))
    assert float(grid.sigmas[-1]) == 0.0
    shifted = Sampler(SamplerConfig(num_steps=4, height=32, width=32, shift=5.0)).schedule(base)
    assert bool((shifted.sigmas[1:-1] < grid.sigmas[1:-1]).all())  # DanceGRPO's shift 5: less noisy sooner


def test_spec_is_the_published_size():
    from diffusers import HunyuanVideoTransformer3DModel

    with torch.device("meta"):
        n = sum(
            p.numel() for p in HunyuanVideoTransformer3DModel(**HUNYUAN_VIDEO_SPECS["hunyuanvideo-13b"]).parameters()
        )
    assert 12.5e9 < n < 13.5e9  # "13B"


@pytest.mark.parametrize("true_cfg", [True, False], ids=["true_cfg", "embedded_guidance"])
def test_model_output_and_decode_reproduce_the_pipeline(base, true_cfg):
    """HunyuanVideoPipeline from our noise: its last latent and its frames. True CFG (negative prompt "",
    true_cfg_scale 4, embedded guidance 6) is cfg_mode "full"; guidance-distilled sampling (embedded 4.5) is "none"."""
    a, steps = base, 2
    x0 = torch.randn(1, *a.latent_shape(32, 32), generator=torch.Generator().manual_seed(1))
    seen = {}

    def keep(pipe, i, t, kw):
        seen["latents"] = kw["latents"]
        return {}

    cfg = dict(negative_prompt="", true_cfg_scale=4.0, guidance_scale=6.0) if true_cfg else dict(guidance_scale=4.5)
    a.pipe.set_progress_bar_config(disable=True)
    frames = a.pipe(
        prompt=PROMPT, num_inference_steps=steps, height=32, width=32, num_frames=5, latents=x0.clone(),
        max_sequence_length=a.max_sequence_length, prompt_template=TINY_PROMPT_TEMPLATE, output_type="pt",
        callback_on_step_end=keep, **cfg,
    ).frames  # fmt: skip
    grid = Sampler(SamplerConfig(num_steps=steps, height=32, width=32)).schedule(a)
    torch.testing.assert_close(grid.sigmas, a.pipe.scheduler.sigmas.float())
    e, x = a.encode_prompts([PROMPT]), x0.clone()
    with torch.no_grad():
        for i in range(steps):
            v = a.model_output(x, grid.sigmas[i], e, 4.0, "full") if true_cfg else a.model_output(
                x, grid.sigmas[i], e, 4.5, "none")  # fmt: skip
            x = x + (grid.sigmas[i + 1] - grid.sigmas[i]) * v
        torch.testing.assert_close(x, seen["latents"], atol=2e-5, rtol=1e-5)
        video = a.decode(x)
    assert video.shape == frames.shape == (1, 5, 3, 32, 32)
    torch.testing.assert_close(video, frames, atol=1e-5, rtol=1e-5)
    assert video.std() > 0.01  # frames are not blank


def test_cfg_modes_guidance_and_detached_uncond_gradient():
    a = build_adapter("hunyuan_video", tiny=True)
    params = a.add_lora(rank=4)
    names = [n for n, p in a.denoiser.named_parameters() if p.requires_grad]
    for block in ("transformer_blocks.0.attn.to_q", "single_transformer_blocks.0.attn.to_v", "refiner_blocks.0.attn"):
        assert any(block in n for n in names)
    with torch.no_grad():
        for p in params:  # B = 0 at init: make the LoRA count
            p.add_(0.05 * torch.randn_like(p))
    x, s = torch.randn(2, *a.latent_shape(32, 32)), torch.tensor([0.3, 0.8])
    e = a.encode_prompts([PROMPT, "a blue dog"])  # two lengths: rows padded with mask 0
    with torch.no_grad():
        full, det = a.model_output(x, s, e, 3.0, "full"), a.model_output(x, s, e, 3.0, "detach_uncond")
        cond = a.model_output(x, s, e, 6.0, "none")  # embedded 6.0 = what the CFG modes embed
        uncond = a.model_output(x, s, PromptEmbeds(cond=e.uncond, pooled=e.uncond_pooled, mask=e.uncond_mask), 6.0,
                                "none")  # fmt: skip
        other = a.model_output(x, s, e, 2.0, "none")
        alone = a.model_output(x[:1], s[:1], e.index(0), 6.0, "none")  # no batch padding
        with a.reference():
            ref = a.model_output(x, s, e, 3.0, "full")
    assert full.shape == x.shape and torch.equal(full, det) and not torch.allclose(cond, other, atol=1e-4)
    assert not torch.allclose(full, ref, atol=1e-4)  # the reference is the base model
    torch.testing.assert_close(full, uncond + 3.0 * (cond - uncond), atol=5e-5, rtol=1e-5)
    torch.testing.assert_close(alone, cond[:1], atol=2e-5, rtol=1e-5)  # padding is masked out
    r = torch.randn_like(x)
    g_det = torch.autograd.grad((a.model_output(x, s, e, 3.0, "detach_uncond") * r).sum(), params, allow_unused=True)
    g_cond = torch.autograd.grad((3.0 * a.model_output(x, s, e, 6.0, "none") * r).sum(), params, allow_unused=True)
    used = [i for i, g in enumerate(g_cond) if g is not None]
    assert len(used) > len(params) // 2
    for i in used:
        torch.testing.assert_close(g_det[i], g_cond[i], atol=1e-5, rtol=1e-4)


CASES = [("flow_sde", {"a": 0.7}, "full_sde", 2), ("dance_sde", {"eta": 0.3}, "full_sde", 2),
         ("cps", {"a": 0.7}, "full_sde", 2), ("flow_sde", {"a": 0.7}, "tree", 4)]  # fmt: skip


@pytest.mark.parametrize("kernel,settings,plan_name,group", CASES, ids=[f"{c[0]}-{c[2]}" for c in CASES])
def test_rescore_gives_ratio_one(base, kernel, settings, plan_name, group):
    sampler = Sampler(SamplerConfig(num_steps=4, sde_kernel={"name": kernel, **settings}, cfg_mode="full",
                                    guidance_scale=4.0, keep_means=True))  # fmt: skip
    plan = build_plan(plan_name, 4, **({"split_steps": (0, 2)} if plan_name == "tree" else {}))
    tree = sampler.run(base, [PROMPT], plan, group, torch.Generator().manual_seed(0))
    assert tree.states.shape[1:] == (4, 2, 8, 8)
    edges = tree.trained_edges()
    out = sampler.rescore(base, tree, edges, [PROMPT])  # the first training pass: detach_uncond, with grad
    assert edges.numel() > 0
    assert torch.allclose(out.logp, tree.edge_logp[edges], atol=1e-5, rtol=0)
    assert torch.allclose(out.mean, tree.edge_mean[edges], atol=1e-5, rtol=0)


def test_lora_saved_loads_in_the_pipeline_and_changes_its_output(tmp_path):
    from diffusers import HunyuanVideoPipeline

    a = build_adapter("hunyuan_video", tiny=True)
    params = a.add_lora(rank=4, alpha=8)
    with torch.no_grad():
        for p in params:
            p.add_(0.05 * torch.randn_like(p))
    a.save_lora(tmp_path / "lora")
    x, e = torch.randn(1, *a.latent_shape(32, 32)), a.encode_prompts([PROMPT])
    fresh = build_adapter("hunyuan_video", tiny=True)
    with torch.no_grad():
        mine, before = a.model_output(x, 0.6, e, 6.0, "none"), fresh.model_output(x, 0.6, e, 6.0, "none")
        assert isinstance(fresh.pipe, HunyuanVideoPipeline)
        fresh.pipe.load_lora_weights(tmp_path / "lora")  # diffusers' own HunyuanVideo LoRA loader
        after = fresh.model_output(x, 0.6, e, 6.0, "none")
    assert not torch.allclose(before, after, atol=1e-4)
    torch.testing.assert_close(after, mine, atol=1e-5, rtol=1e-5)  # alpha / rank survived in the metadata


def test_from_pretrained_full_finetune_folder_and_tiled_decode(tmp_path):
    from diffusers import HunyuanVideoTransformer3DModel

    a = build_adapter("hunyuan_video", tiny=True)
    a.pipe.save_pretrained(tmp_path / "pipe")
    b = build_adapter("hunyuan_video", pretrained=tmp_path / "pipe", max_sequence_length=16, num_frames=9,
                      prompt_template=TINY_PROMPT_TEMPLATE)  # fmt: skip
    assert (
        type(b) is HunyuanVideoAdapter and b.scheduler_config == a.scheduler_config and b.latent_shape(32, 32)[1] == 3
    )
    ea, eb = a.encode_prompts([PROMPT]), b.encode_prompts([PROMPT])
    torch.testing.assert_close(ea.cond, eb.cond)
    x = torch.randn(1, *a.latent_shape(32, 32))
    with torch.no_grad():
        torch.testing.assert_close(a.model_output(x, 0.5, ea, 6.0, "none"), b.model_output(x, 0.5, eb, 6.0, "none"))
    # full fine-tune (DanceGRPO's HunyuanVideo recipe): every denoiser weight gets a gradient; the folder loads back
    b.denoiser.requires_grad_(True)
    b.model_output(x, 0.5, eb, 4.0, "detach_uncond").square().mean().backward()
    grads = [p.grad for p in b.denoiser.parameters()]
    assert sum(g is not None and bool(g.abs().sum() > 0) for g in grads) > 0.8 * len(grads)
    with torch.no_grad():
        b.denoiser.proj_out.weight.add_(0.01)
    b.save_denoiser(tmp_path / "ft")
    loaded = HunyuanVideoTransformer3DModel.from_pretrained(tmp_path / "ft")
    assert torch.equal(loaded.proj_out.weight, b.denoiser.proj_out.weight)
    # tiled decode: with 16 px tiles (stride 12) a 32 px video goes through in blended spatial tiles, same shape,
    # close to the untiled frames
    z = torch.randn(1, *a.latent_shape(32, 32))
    with torch.no_grad():
        whole = a.decode(z)
        a.vae.enable_tiling(tile_sample_min_height=16, tile_sample_min_width=16, tile_sample_stride_height=12,
                            tile_sample_stride_width=12)  # fmt: skip
        tiled = a.decode(z)
    assert tiled.shape == whole.shape and not torch.equal(tiled, whole)
    assert (tiled - whole).abs().mean() < 0.1
