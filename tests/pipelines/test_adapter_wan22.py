"""Wan 2.2 adapters: TI2V-5B (per-token timesteps, the patchified Wan 2.2 VAE) and T2V-A14B (two experts split at
boundary_ratio, per-expert guidance) reproduce WanPipeline's own loop; on-policy ratio 1 for every flow kernel with
rows of both experts in one re-scored batch; only the trained expert gets LoRA, gradients and trained steps; its
LoRA loads in diffusers' Wan loader (load_into_transformer_2 for the low-noise expert); the published specs' sizes."""

import pytest
import torch

from pipelines.adapters import Wan22Adapter, WanAdapter, build_adapter
from pipelines.adapters.wan22 import WAN22_SPECS
from pipelines.plans import build_plan
from pipelines.sampler import Sampler, SamplerConfig

PROMPT = "a red cat"


@pytest.fixture(scope="module")
def a14b() -> Wan22Adapter:
    return build_adapter("wan2.2", tiny=True, scheduler="euler", boundary_ratio=0.7, guidance_scale_2=2.0)


def _pipeline_latents(a, x0, steps, size, **call):
    seen = {}

    def keep(pipe, i, t, kw):
        seen["latents"] = kw["latents"]
        return {}

    a.pipe.set_progress_bar_config(disable=True)
    frames = a.pipe(
        prompt=PROMPT, num_inference_steps=steps, height=size, width=size, num_frames=5, latents=x0.clone(),
        max_sequence_length=a.max_sequence_length, output_type="pt", callback_on_step_end=keep, **call,
    ).frames  # fmt: skip
    return seen["latents"], frames


def _euler(a, x0, steps, size, w):
    grid = Sampler(SamplerConfig(num_steps=steps, height=size, width=size)).schedule(a)
    torch.testing.assert_close(grid.sigmas, a.pipe.scheduler.sigmas.float())
    e, x = a.encode_prompts([PROMPT]), x0.clone()
    with torch.no_grad():
        for i in range(steps):
            x = x + (grid.sigmas[i + 1] - grid.sigmas[i]) * a.model_output(x, grid.sigmas[i], e, w, "full")
    return x, grid


def test_ti2v_reproduces_the_pipeline():
    """expand_timesteps: per-token timesteps through the transformer, the residual patchified VAE's frames."""
    a = build_adapter("wan2.2", tiny=True, variant="ti2v", scheduler="euler")
    assert a.vae_scale_factor == 8 and a.latent_shape(32, 32) == (8, 3, 4, 4) and not a.two_experts
    x0 = torch.randn(1, *a.latent_shape(32, 32))
    latents, frames = _pipeline_latents(a, x0, 2, 32, guidance_scale=4.0)
    x, _ = _euler(a, x0, 2, 32, 4.0)
    torch.testing.assert_close(x, latents, atol=2e-5, rtol=1e-5)
    with torch.no_grad():
        video = a.decode(x)
    assert video.shape == frames.shape == (1, 5, 3, 32, 32)
    torch.testing.assert_close(video, frames, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="two-expert pipelines"):
        Wan22Adapter(a.pipe, train_experts=["low"])
    # on-policy ratio 1 through the per-token timesteps
    sampler = Sampler(SamplerConfig(num_steps=2, height=32, width=32, sde_kernel={"name": "flow_sde", "a": 0.7},
                                    guidance_scale=4.0, keep_means=True))  # fmt: skip
    tree = sampler.run(a, [PROMPT], build_plan("full_sde", 2, train_fraction=1.0), 2, torch.Generator().manual_seed(0))
    edges = tree.trained_edges()
    out = sampler.rescore(a, tree, edges, [PROMPT])
    assert edges.numel() == 4 and torch.allclose(out.logp, tree.edge_logp[edges], atol=1e-5, rtol=0)


def test_a14b_reproduces_the_pipeline_with_both_experts(a14b):
    """Steps above the boundary through `transformer` at guidance_scale, below through `transformer_2` at
    guidance_scale_2, as WanPipeline routes them."""
    x0 = torch.randn(1, *a14b.latent_shape(16, 16))
    latents, frames = _pipeline_latents(a14b, x0, 4, 16, guidance_scale=4.0, guidance_scale_2=2.0)
    x, grid = _euler(a14b, x0, 4, 16, 4.0)
    assert a14b.step_experts(grid) == ["high", "high", "low", "low"]
    torch.testing.assert_close(x, latents, atol=2e-5, rtol=1e-5)
    with torch.no_grad():
        torch.testing.assert_close(a14b.decode(x), frames, atol=1e-5, rtol=1e-5)
        # a batch with rows of both experts = each row alone
        e2, s = a14b.encode_prompts([PROMPT, "a blue dog"]), torch.tensor([0.9, 0.2])
        xs = torch.randn(2, *a14b.latent_shape(16, 16))
        both = a14b.model_output(xs, s, e2, 4.0)
        for i in range(2):
            one = a14b.model_output(xs[i : i + 1], s[i], e2.index([i]), 4.0)
            torch.testing.assert_close(both[i : i + 1], one, atol=1e-5, rtol=1e-5)


def test_refusals_and_published_specs():
    from diffusers import WanTransformer3DModel

    a = build_adapter("wan2.2", tiny=True)
    with pytest.raises(ValueError, match="use family 'wan2.2'"):
        WanAdapter(a.pipe)
    with pytest.raises(ValueError, match="names an expert twice"):
        Wan22Adapter(a.pipe, train_experts=["low", "low"])
    with pytest.raises(ValueError, match="train_experts must be a list of \\['high', 'low'\\], got \\['mid'\\]"):
        Wan22Adapter(a.pipe, train_experts=["mid"])
    sizes = {}
    for name, spec in WAN22_SPECS.items():
        with torch.device("meta"):
            sizes[name] = sum(p.numel() for p in WanTransformer3DModel(**spec).parameters())
    assert 4.9e9 < sizes["wan2.2-ti2v-5b"] < 5.1e9 and 14.0e9 < sizes["wan2.2-t2v-a14b"] < 14.5e9


CASES = [("flow_sde", {"a": 0.7}), ("dance_sde", {"eta": 0.3}), ("cps", {"a": 0.7})]


@pytest.mark.parametrize("kernel,settings", CASES, ids=[c[0] for c in CASES])
def test_rescore_gives_ratio_one_across_experts(a14b, kernel, settings):
    sampler = Sampler(SamplerConfig(num_steps=4, height=16, width=16, sde_kernel={"name": kernel, **settings},
                                    cfg_mode="full", guidance_scale=4.0, keep_means=True))  # fmt: skip
    tree = sampler.run(
        a14b, [PROMPT], build_plan("full_sde", 4, train_fraction=1.0), 2, torch.Generator().manual_seed(0)
    )
    edges = tree.trained_edges()
    assert set(tree.edge_step[edges].tolist()) == {0, 1, 2, 3}  # one re-scored batch, both experts' steps
    out = sampler.rescore(a14b, tree, edges, [PROMPT])
    assert torch.allclose(out.logp, tree.edge_logp[edges], atol=1e-5, rtol=0)
    assert torch.allclose(out.mean, tree.edge_mean[edges], atol=1e-5, rtol=0)


def test_low_expert_training_lora_plan_and_diffusers_loader(tmp_path):
    from diffusers import WanPipeline

    a = build_adapter("wan2.2", tiny=True, scheduler="euler", boundary_ratio=0.7, train_experts=["low"])
    params = a.add_lora(rank=4, alpha=8)
    assert a.denoiser is a.pipe.transformer_2 and not getattr(a.pipe.transformer, "peft_config", None)
    assert not any(p.requires_grad for p in a.pipe.transformer.parameters())
    assert {id(p) for p in params} == {id(p) for p in a.pipe.transformer_2.parameters() if p.requires_grad}
    with torch.no_grad():
        for p in params:
            p.add_(0.05 * torch.randn_like(p))
    x, e = torch.randn(1, *a.latent_shape(16, 16)), a.encode_prompts([PROMPT])
    assert not a.model_output(x, 0.9, e, 4.0, "detach_uncond").requires_grad  # a high-noise step: frozen expert
    assert a.model_output(x, 0.3, e, 4.0, "detach_uncond").requires_grad
    # only the low expert's steps stay trained; a plan with none of them left is refused
    grid = Sampler(SamplerConfig(num_steps=4, height=16, width=16)).schedule(a)
    assert a.restrict_plan(build_plan("full_sde", 4, train_fraction=1.0), grid).trained_steps == [2, 3]
    with pytest.raises(ValueError, match="run steps \\[2, 3\\]"):
        a.restrict_plan(build_plan("full_sde", 4, train_fraction=0.5), grid)
    # the saved file loads into transformer_2 with diffusers' own loader, and back into an adapter
    a.save_lora(tmp_path / "lora")
    fresh = build_adapter("wan2.2", tiny=True, scheduler="euler", boundary_ratio=0.7)
    with torch.no_grad():
        mine, before = a.model_output(x, 0.3, e, 0.0, "none"), fresh.model_output(x, 0.3, e, 0.0, "none")
        assert isinstance(fresh.pipe, WanPipeline)
        fresh.pipe.load_lora_weights(tmp_path / "lora", load_into_transformer_2=True)
        assert not getattr(fresh.pipe.transformer, "peft_config", None)
        after = fresh.model_output(x, 0.3, e, 0.0, "none")
        assert not torch.allclose(before, after, atol=1e-4)
        torch.testing.assert_close(after, mine, atol=1e-5, rtol=1e-5)
        again = build_adapter("wan2.2", tiny=True, scheduler="euler", boundary_ratio=0.7, train_experts=["low"])
        assert len(again.load_lora(tmp_path / "lora")) == len(params)
        torch.testing.assert_close(again.model_output(x, 0.3, e, 0.0, "none"), mine, atol=1e-5, rtol=1e-5)


def test_both_experts_train_and_save_one_lora_each(tmp_path):
    a = build_adapter("wan2.2", tiny=True, scheduler="euler", boundary_ratio=0.7, train_experts=["low", "high"])
    assert a.train_experts == ("high", "low") and a.denoiser is a.pipe.experts
    params = a.add_lora(rank=4)
    assert all(getattr(m, "peft_config", None) for m in (a.pipe.transformer, a.pipe.transformer_2))
    assert {id(p) for p in params} == {id(p) for p in a.denoiser.parameters() if p.requires_grad}
    with torch.no_grad():
        for p in params:
            p.add_(0.05 * torch.randn_like(p))
    x, e = torch.randn(1, *a.latent_shape(16, 16)), a.encode_prompts([PROMPT])
    for sigma, expert in ((0.9, a.pipe.transformer), (0.3, a.pipe.transformer_2)):  # each step's gradient: its expert
        grads = torch.autograd.grad(a.model_output(x, sigma, e, 4.0, "detach_uncond").sum(), params, allow_unused=True)
        mine = {id(p) for p in expert.parameters()}
        assert all((g is not None) == (id(p) in mine) for p, g in zip(params, grads))
    grid = Sampler(SamplerConfig(num_steps=4, height=16, width=16)).schedule(a)
    assert a.restrict_plan(build_plan("full_sde", 4, train_fraction=1.0), grid).trained_steps == [0, 1, 2, 3]
    with torch.no_grad():
        mine = [a.model_output(x, s, e, 0.0, "none") for s in (0.9, 0.3)]
        with a.reference():  # LoRA off in both experts
            ref = [a.model_output(x, s, e, 0.0, "none") for s in (0.9, 0.3)]
        assert not any(torch.allclose(m, r, atol=1e-4) for m, r in zip(mine, ref))
        a.save_lora(tmp_path / "lora")
        fresh = build_adapter("wan2.2", tiny=True, scheduler="euler", boundary_ratio=0.7)
        fresh.pipe.load_lora_weights(tmp_path / "lora")
        fresh.pipe.load_lora_weights(tmp_path / "lora" / "transformer_2", load_into_transformer_2=True)
        for s, m in zip((0.9, 0.3), mine):
            torch.testing.assert_close(fresh.model_output(x, s, e, 0.0, "none"), m, atol=1e-5, rtol=1e-5)
        again = build_adapter("wan2.2", tiny=True, scheduler="euler", boundary_ratio=0.7, train_experts=["high", "low"])
        assert len(again.load_lora(tmp_path / "lora")) == len(params)
        torch.testing.assert_close(again.model_output(x, 0.3, e, 0.0, "none"), mine[1], atol=1e-5, rtol=1e-5)
