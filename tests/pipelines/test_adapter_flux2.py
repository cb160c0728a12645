"""FLUX.2 [klein] adapter: Flux2KleinPipeline's own loop reproduced (grid, CFG, decode), the contract (CFG modes,
LoRA, blocks), on-policy ratio 1 for every flow kernel, from_pretrained, and the tiny recipe end to end (ratio 1 in
the trainer's first pass, the LoRA artifact in diffusers' loader, a full fine-tune; learning in the heavy tier)."""

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from pipelines.adapters import Flux2Adapter, PromptEmbeds, build_adapter
from pipelines.adapters.flux2 import empirical_mu
from pipelines.plans import build_plan
from pipelines.sampler import Sampler, SamplerConfig

PROMPT = "a red cat"
RECIPE = Path(__file__).resolve().parents[2] / "configs" / "t2i" / "tiny" / "flux2_klein.yaml"
STEPS = 3


@pytest.fixture(scope="module")
def base() -> Flux2Adapter:
    return build_adapter("flux2", tiny=True)  # klein base-like: true CFG


def pipeline_latents(a: Flux2Adapter, x0: torch.Tensor, output_type: str = "latent", **call) -> torch.Tensor:
    """Flux2KleinPipeline.__call__ from our noise (its latents are the 2x2-patchified ones): the final latent
    mapped back to our normalised, un-patchified layout, or images."""
    a.pipe.set_progress_bar_config(disable=True)
    out = a.pipe(
        prompt=PROMPT, num_inference_steps=STEPS, height=32, width=32, output_type=output_type,
        latents=F.pixel_unshuffle(x0, 2), max_sequence_length=a.max_sequence_length,
        text_encoder_out_layers=a.text_encoder_out_layers, **call,
    ).images  # fmt: skip
    if output_type != "latent":
        return out
    bn, eps = a.vae.bn, a.vae.config.batch_norm_eps
    patches = (F.pixel_unshuffle(out, 2) - bn.running_mean.view(1, -1, 1, 1)) / torch.sqrt(
        bn.running_var.view(1, -1, 1, 1) + eps
    )
    return F.pixel_shuffle(patches, 2)


@pytest.mark.parametrize("distilled,call,w,mode", [
    (False, {"guidance_scale": 4.0}, 4.0, "full"),  # klein base: true CFG with the empty negative prompt
    (True, {"guidance_scale": 4.0}, 0.0, "none"),  # distilled: the pipeline ignores guidance
])  # fmt: skip
def test_model_output_grid_and_decode_reproduce_the_pipeline(base, distilled, call, w, mode):
    a = build_adapter("flux2", tiny=True, is_distilled=True) if distilled else base
    assert a.is_distilled == distilled
    x0 = torch.randn(1, *a.latent_shape(32, 32))
    ref = pipeline_latents(a, x0, **call)
    grid = Sampler(SamplerConfig(num_steps=STEPS, height=32, width=32)).schedule(a)
    torch.testing.assert_close(grid.sigmas, a.pipe.scheduler.sigmas.float())  # the sampler walks the pipeline's grid
    e, x = a.encode_prompts([PROMPT]), x0.clone()
    with torch.no_grad():
        for i in range(STEPS):
            x = x + (grid.sigmas[i + 1] - grid.sigmas[i]) * a.model_output(x, grid.sigmas[i], e, w, mode)
        torch.testing.assert_close(x, ref, atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(a.decode(x), pipeline_latents(a, x0, "pt", **call), atol=1e-5, rtol=1e-5)


def test_geometry_blocks_and_mu():
    a = build_adapter("flux2", tiny=True)
    assert a.latent_shape(32, 32) == (4, 16, 16) and a.image_seq_len(32, 32) == 64
    with pytest.raises(ValueError, match="multiples of 4"):
        a.latent_shape(34, 32)
    from pipelines.speed import denoiser_blocks

    assert len(denoiser_blocks(a)) == 2  # one double- and one single-stream block
    # mu grows with the tokens and falls with more steps; above 4300 tokens only the tokens count
    assert empirical_mu(4096, 4) > empirical_mu(4096, 50) and empirical_mu(1024, 4) < empirical_mu(4096, 4)
    assert empirical_mu(8192, 4) == empirical_mu(8192, 50)
    with pytest.raises(ValueError, match="sampler.shift"):
        a.flow_grid(4, 32, 32, 3.0)
    with pytest.raises(ValueError, match="text_encoder_out_layers"):
        Flux2Adapter(a.pipe, text_encoder_out_layers=(1, 9))


def test_cfg_modes_and_detached_uncond_gradient():
    a = build_adapter("flux2", tiny=True)
    params = a.add_lora(rank=4)
    assert any("to_qkv_mlp_proj" in n for n, p in a.denoiser.named_parameters() if p.requires_grad)
    x, s = torch.randn(2, 4, 16, 16), torch.tensor([0.3, 0.8])
    e = a.encode_prompts([PROMPT, "a blue dog"])
    with torch.no_grad():
        full, det = a.model_output(x, s, e, 3.0, "full"), a.model_output(x, s, e, 3.0, "detach_uncond")
        cond = a.model_output(x, s, e, 0.0, "none")
        uncond = a.model_output(x, s, PromptEmbeds(cond=e.uncond), 0.0, "none")
    assert torch.equal(full, det) and not torch.allclose(full, cond, atol=1e-3)
    torch.testing.assert_close(full, uncond + 3.0 * (cond - uncond), atol=5e-5, rtol=1e-5)
    r = torch.randn_like(x)
    g_det = torch.autograd.grad((a.model_output(x, s, e, 3.0, "detach_uncond") * r).sum(), params, allow_unused=True)
    g_cond = torch.autograd.grad((3.0 * a.model_output(x, s, e, 0.0, "none") * r).sum(), params, allow_unused=True)
    used = [i for i, g in enumerate(g_cond) if g is not None]
    assert len(used) > len(params) // 2
    for i in used:
        torch.testing.assert_close(g_det[i], g_cond[i], atol=1e-5, rtol=1e-4)


# every flow kernel on the full-SDE plan, and a tree (branched rollouts re-scored edge by edge)
# (flow_sde on the full-SDE plan: the recipe test's first training pass)
CASES = [("dance_sde", {"eta": 0.3}, "full_sde", 2), ("cps", {"a": 0.7}, "full_sde", 2),
         ("flow_sde", {"a": 0.7}, "tree", 4)]  # fmt: skip


@pytest.mark.parametrize("kernel,settings,plan_name,group", CASES, ids=[f"{c[0]}-{c[2]}" for c in CASES])
def test_rescore_gives_ratio_one(base, kernel, settings, plan_name, group):
    sampler = Sampler(SamplerConfig(num_steps=4, sde_kernel={"name": kernel, **settings}, cfg_mode="full",
                                    guidance_scale=4.0, keep_means=True))  # fmt: skip
    plan = build_plan(plan_name, 4, **({"split_steps": (0, 2)} if plan_name == "tree" else {}))
    tree = sampler.run(base, [PROMPT], plan, group, torch.Generator().manual_seed(0))
    edges = tree.trained_edges()
    out = sampler.rescore(base, tree, edges, [PROMPT])
    assert edges.numel() > 0 and torch.allclose(out.logp, tree.edge_logp[edges], atol=1e-5, rtol=0)


def test_from_pretrained_of_a_saved_pipeline(tmp_path):
    a = build_adapter("flux2", tiny=True, is_distilled=True)
    a.pipe.save_pretrained(tmp_path)
    kw = {"max_sequence_length": a.max_sequence_length, "text_encoder_out_layers": a.text_encoder_out_layers}
    b = build_adapter("flux2", pretrained=tmp_path, **kw)
    assert type(b) is Flux2Adapter and b.is_distilled and b.scheduler_config == a.scheduler_config
    ea, eb = a.encode_prompts([PROMPT]), b.encode_prompts([PROMPT])
    torch.testing.assert_close(ea.cond, eb.cond, rtol=1e-5, atol=1e-6)
    x = torch.randn(1, 4, 16, 16)
    with torch.no_grad():
        torch.testing.assert_close(a.model_output(x, 0.5, ea, 0.0, "none"), b.model_output(x, 0.5, eb, 0.0, "none"))
        assert torch.equal(a.decode(x), b.decode(x))  # the VAE's patch statistics came along
    with pytest.raises(ValueError, match="text_encoder_out_layers"):  # the released (9, 18, 27) need 27 layers
        build_adapter("flux2", pretrained=tmp_path)


def _train(tmp_path, *overrides):
    from flowgrpo.t2i import load_t2i_config, train_t2i

    cfg = load_t2i_config(RECIPE, [f"output_dir={tmp_path}", "iterations=2", "group_size=4", "progress=false",
                                   "artifacts.tensorboard=false", "artifacts.plot=false", *overrides])  # fmt: skip
    return train_t2i(cfg)


def test_recipe_runs_with_ratio_one_and_its_lora_loads_in_diffusers(tmp_path):
    records = _train(tmp_path)
    assert len(records) == 2 and all(r["check/first_pass_ratio_dev"] < 1e-5 for r in records)
    assert records[0]["check/rows"] > 0 and records[-1]["optimizer_steps"] > 0
    tuned = build_adapter("flux2", tiny=True, is_distilled=True)  # the recipe's base weights (init_seed 0)
    x, e = torch.randn(1, 4, 16, 16), tuned.encode_prompts([PROMPT])
    with torch.no_grad():
        before = tuned.model_output(x, 0.6, e, 0.0, "none")
        tuned.pipe.load_lora_weights(tmp_path / "lora")  # diffusers' own loader
        after = tuned.model_output(x, 0.6, e, 0.0, "none")
        ours = build_adapter("flux2", tiny=True, is_distilled=True)
        ours.load_lora(tmp_path / "lora")
        torch.testing.assert_close(ours.model_output(x, 0.6, e, 0.0, "none"), after, atol=1e-6, rtol=1e-5)
    assert not torch.allclose(before, after, atol=1e-5)


def test_full_finetune_trains_every_weight_and_saves_a_diffusers_model(tmp_path):
    """model.finetune=full (flowgrpo.t2i.model.build_policy): every denoiser weight trainable; the trainer's
    export is `save_denoiser`, a folder Flux2Transformer2DModel.from_pretrained reads."""
    from diffusers import Flux2Transformer2DModel

    a = build_adapter("flux2", tiny=True, is_distilled=True)
    params = list(a.denoiser.parameters())
    for p in params:
        p.requires_grad_(True)
    x, e = torch.randn(1, 4, 16, 16), a.encode_prompts([PROMPT])
    (a.model_output(x, 0.6, e, 0.0, "none") * torch.randn_like(x)).sum().backward()
    assert sum(p.grad is not None and bool(p.grad.abs().sum() > 0) for p in params) > 0.9 * len(params)
    with torch.no_grad():
        for p in params:
            p.add_(0.01 * p.grad)
        tuned = a.model_output(x, 0.6, e, 0.0, "none")
    a.save_denoiser(tmp_path / "transformer")
    b = build_adapter("flux2", tiny=True, is_distilled=True)
    b.pipe.transformer = Flux2Transformer2DModel.from_pretrained(tmp_path / "transformer")
    with torch.no_grad():
        assert torch.equal(b.model_output(x, 0.6, e, 0.0, "none"), tuned)


@pytest.mark.heavy
def test_recipe_learns(tmp_path):
    sys.path.append(str(Path(__file__).resolve().parents[1]))  # appended: tests/reward_models must not shadow
    from t2i.learning_runs import learning_margin

    m = learning_margin("flux2_klein", tmp_path, iterations=16)
    assert m["first_learn"] == pytest.approx(m["first_still"], abs=1e-7), m
    assert m["gain"] > 5.0 * m["noise"] and m["gain"] > 0, m


def test_memory_table_rows_use_the_adapters_lora_targets():
    from flowgrpo.scaling import memory as mem
    from pipelines.adapters import ZImageAdapter

    specs = {s.name: s for s in mem.SPECS}
    assert specs["FLUX.2-klein-4B"].lora_targets == specs["FLUX.2-klein-9B"].lora_targets == Flux2Adapter.lora_targets
    assert specs["Z-Image-Turbo"].lora_targets == ZImageAdapter.lora_targets
    assert Flux2Adapter.patch_of(specs["FLUX.2-klein-4B"].config) == 2
    assert ZImageAdapter.patch_of(specs["Z-Image-Turbo"].config) == 2


# FLUX.2 [klein]'s released scheduler_config.json (4B / 9B, distilled and base): FlowMatchEulerDiscreteScheduler with
# dynamic shifting, exponential time shift; base_shift / max_shift are unused (the pipeline passes its own mu)
KLEIN_SCHEDULER = {
    "base_image_seq_len": 256, "base_shift": 0.5, "max_image_seq_len": 4096, "max_shift": 1.15,
    "num_train_timesteps": 1000, "shift": 3.0, "time_shift_type": "exponential", "use_dynamic_shifting": True,
}  # fmt: skip


@pytest.mark.parametrize("steps,px", [(4, 384), (4, 1024), (10, 1024), (50, 512), (28, 2048)])
def test_grid_of_the_released_scheduler_equals_the_pipeline_s_set_timesteps(steps, px):
    """The adapter's grid against Flux2KleinPipeline's own steps: compute_empirical_mu(tokens, steps), then
    retrieve_timesteps(scheduler, sigmas=linspace(1, 1/n, n), mu=mu), with the released scheduler config (the
    Flow-Factory klein recipe samples 4 steps at 384 px and evaluates 10 at 1024 px)."""
    import numpy as np
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.pipelines.flux2 import pipeline_flux2_klein as klein

    a = build_adapter("flux2", tiny=True, is_distilled=True)
    a.pipe.scheduler = FlowMatchEulerDiscreteScheduler.from_config(KLEIN_SCHEDULER)
    tokens = (px // 16) ** 2  # the real VAE's 8x and the 2x2 patches; the tiny VAE's geometry differs
    a.image_seq_len = lambda h, w: tokens  # type: ignore[method-assign]
    ours = a.flow_grid(steps, px, px, None)
    ref = FlowMatchEulerDiscreteScheduler.from_config(KLEIN_SCHEDULER)
    mu = klein.compute_empirical_mu(image_seq_len=tokens, num_steps=steps)
    klein.retrieve_timesteps(ref, steps, "cpu", sigmas=np.linspace(1.0, 1 / steps, steps), mu=mu)
    torch.testing.assert_close(ours.sigmas, ref.sigmas.float(), rtol=0, atol=1e-6)
    torch.testing.assert_close(ours.timesteps, ref.timesteps.float(), rtol=1e-6, atol=1e-4)
    assert empirical_mu(tokens, steps) == pytest.approx(mu, rel=1e-12)


@pytest.mark.parametrize("distilled,n_refs,w,mode", [(False, 1, 4.0, "full"), (True, 2, 0.0, "none")])
def test_edit_adapter_reproduces_the_pipeline_with_reference_images(distilled, n_refs, w, mode):
    """Flux2KleinPipeline(image=[...]): reference tokens after the generated ones at t = 10, 20, ...; the same
    references in both CFG branches (base klein, one image) and several references (distilled klein, two)."""
    from pipelines.adapters.editing import EditPrompt, to_pil
    from pipelines.adapters.flux2 import Flux2KleinEditAdapter

    a = Flux2KleinEditAdapter.tiny(is_distilled=distilled)
    g = torch.Generator().manual_seed(1)
    sources = [torch.randint(0, 256, (3, 64, 64), dtype=torch.uint8, generator=g) for _ in range(n_refs)]  # >= 64 px
    x0 = torch.randn(1, *a.latent_shape(32, 32), generator=g)
    ref = pipeline_latents(a, x0, guidance_scale=4.0, image=[to_pil(s) for s in sources])
    grid = Sampler(SamplerConfig(num_steps=STEPS, height=32, width=32)).schedule(a)
    torch.testing.assert_close(grid.sigmas, a.pipe.scheduler.sigmas.float())
    e, x = a.encode_prompts([EditPrompt(PROMPT, sources)]), x0.clone()
    assert e.reference.shape[1] == n_refs * 16 * 16  # 64 px -> 32 x 32 latents -> 16 x 16 tokens per image
    with torch.no_grad():
        for i in range(STEPS):
            x = x + (grid.sigmas[i + 1] - grid.sigmas[i]) * a.model_output(x, grid.sigmas[i], e, w, mode)
    torch.testing.assert_close(x, ref, atol=2e-5, rtol=1e-5)
    ids = a._reference_ids(((16, 16),) * n_refs, "cpu")
    assert sorted(set(ids[:, 0].tolist())) == [10 * (i + 1) for i in range(n_refs)] and ids[:, 3].eq(0).all()
    with pytest.raises(ValueError, match="names no input image"):
        a.encode_prompts([PROMPT])
