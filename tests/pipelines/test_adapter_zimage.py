"""Z-Image adapter: ZImagePipeline's own loop reproduced (grid, time and sign, its CFG form and norm cap, decode),
captions of their own lengths, the contract (CFG modes, LoRA, blocks), on-policy ratio 1 for every flow kernel,
from_pretrained, and the tiny Z-Image-Turbo recipe end to end (ratio 1 in the trainer's first pass, the LoRA
artifact in diffusers' loader; learning in the heavy tier)."""

import sys
from pathlib import Path

import pytest
import torch

from pipelines.adapters import PromptEmbeds, ZImageAdapter, build_adapter
from pipelines.plans import build_plan
from pipelines.sampler import Sampler, SamplerConfig

PROMPT = "a red cat"
RECIPE = Path(__file__).resolve().parents[2] / "configs" / "t2i" / "tiny" / "zimage_turbo.yaml"
STEPS = 3


@pytest.fixture(scope="module")
def turbo() -> ZImageAdapter:
    return build_adapter("zimage", tiny=True)


def pipeline_run(a: ZImageAdapter, x0: torch.Tensor, output_type: str = "latent", **call) -> torch.Tensor:
    a.pipe.set_progress_bar_config(disable=True)
    return a.pipe(
        prompt=PROMPT, num_inference_steps=STEPS, height=32, width=32, output_type=output_type, latents=x0.clone(),
        max_sequence_length=a.max_sequence_length, **call,
    ).images  # fmt: skip


@pytest.mark.parametrize("dynamic,call,w,mode", [
    (False, {"guidance_scale": 0.0}, 0.0, "none"),  # Turbo: no CFG
    # cond + w (cond - uncond), the norm cap (its plain form: test_cfg_modes_and_detached_uncond_gradient)
    (False, {"guidance_scale": 3.0, "negative_prompt": "blurry", "cfg_normalization": 1.0}, 3.0, "full"),
    (True, {"guidance_scale": 0.0}, 0.0, "none"),  # a scheduler with dynamic shifting
])  # fmt: skip
def test_model_output_grid_and_decode_reproduce_the_pipeline(turbo, dynamic, call, w, mode):
    a = build_adapter("zimage", tiny=True, dynamic_shift=True) if dynamic else turbo
    a.cfg_normalization = call.get("cfg_normalization", 0.0)
    try:
        x0 = torch.randn(1, *a.latent_shape(32, 32))
        ref = pipeline_run(a, x0, **call)
        grid = Sampler(SamplerConfig(num_steps=STEPS, height=32, width=32)).schedule(a)
        torch.testing.assert_close(grid.sigmas, a.pipe.scheduler.sigmas.float())  # the pipeline's grid
        e, x = a.encode_prompts([PROMPT], negative_prompt=call.get("negative_prompt", "")), x0.clone()
        with torch.no_grad():
            for i in range(STEPS):
                x = x + (grid.sigmas[i + 1] - grid.sigmas[i]) * a.model_output(x, grid.sigmas[i], e, w, mode)
            torch.testing.assert_close(x, ref, atol=2e-5, rtol=1e-5)
            torch.testing.assert_close(a.decode(x), pipeline_run(a, x0, "pt", **call), atol=1e-5, rtol=1e-5)
    finally:
        a.cfg_normalization = 0.0


def test_geometry_blocks_and_resolution(turbo):
    a = turbo
    assert a.latent_shape(32, 32) == (4, 16, 16) and a.image_seq_len(32, 32) == 64
    with pytest.raises(ValueError, match="multiples of 4"):
        a.latent_shape(34, 32)
    cfg, vae = dict(a.denoiser.config), dict(a.vae.config)
    assert ZImageAdapter.resolution_problem(256, 256, cfg, vae) is None  # 64 RoPE rows x 4 px
    assert "larger than" in ZImageAdapter.resolution_problem(260, 256, cfg, vae)
    from pipelines.speed import denoiser_blocks

    assert len(denoiser_blocks(a)) == 1 + 1 + 2  # noise refiner, context refiner, main layers
    with pytest.raises(ValueError, match="cfg_normalization"):
        ZImageAdapter(a.pipe, cfg_normalization=-1.0)


def test_captions_keep_their_own_lengths(turbo):
    """A batch pads captions to its longest; the padding must never reach the model (it would move the image's
    RoPE positions): each row's output is the one it gets alone."""
    a = turbo
    prompts = ["a cat", "a very much longer prompt about a red cat on a mat"]
    e = a.encode_prompts(prompts, negative_prompt="blurry")
    assert e.mask is not None and e.mask.sum(1).tolist()[0] < e.mask.sum(1).tolist()[1]
    x, s = torch.randn(2, 4, 16, 16), torch.tensor([0.4, 0.7])
    with torch.no_grad():
        both = a.model_output(x, s, e, 2.0, "full")
        for i in range(2):
            alone = a.model_output(x[i : i + 1], s[i : i + 1], a.encode_prompts([prompts[i]], "blurry"), 2.0, "full")
            torch.testing.assert_close(both[i : i + 1], alone, atol=1e-5, rtol=1e-5)


def test_cfg_modes_and_detached_uncond_gradient():
    a = build_adapter("zimage", tiny=True)
    params = a.add_lora(rank=4)
    x, s, w = torch.randn(2, 4, 16, 16), torch.tensor([0.3, 0.8]), 2.0
    e = a.encode_prompts([PROMPT, "a blue dog"], negative_prompt="blurry")
    with torch.no_grad():
        full, det = a.model_output(x, s, e, w, "full"), a.model_output(x, s, e, w, "detach_uncond")
        cond = a.model_output(x, s, e, 0.0, "none")
        uncond = a.model_output(x, s, PromptEmbeds(cond=e.uncond, mask=e.uncond_mask), 0.0, "none")
        a.cfg_normalization = 1.0  # the guided output's norm capped at cond's
        capped = a.model_output(x, s, e, w, "full")
        a.cfg_normalization = 0.0
    assert torch.equal(full, det) and not torch.allclose(full, cond, atol=1e-3)
    torch.testing.assert_close(full, cond + w * (cond - uncond), atol=5e-5, rtol=1e-5)  # ZImagePipeline's form
    torch.testing.assert_close(capped.flatten(1).norm(dim=1), cond.flatten(1).norm(dim=1), rtol=1e-4, atol=1e-4)
    r = torch.randn_like(x)
    g_det = torch.autograd.grad((a.model_output(x, s, e, w, "detach_uncond") * r).sum(), params, allow_unused=True)
    g_cond = torch.autograd.grad(((1 + w) * a.model_output(x, s, e, 0.0, "none") * r).sum(), params, allow_unused=True)
    used = [i for i, g in enumerate(g_cond) if g is not None]
    assert len(used) > len(params) // 2
    for i in used:
        torch.testing.assert_close(g_det[i], g_cond[i], atol=1e-5, rtol=1e-4)


# every flow kernel: on the full-SDE plan (Turbo: no CFG), and a tree under CFG
# (flow_sde on the full-SDE plan without CFG: the recipe test's first training pass)
CASES = [("dance_sde", {"eta": 0.3}, "full_sde", 2, "none"), ("cps", {"a": 0.7}, "full_sde", 2, "none"),
         ("flow_sde", {"a": 0.7}, "tree", 4, "full")]  # fmt: skip


@pytest.mark.parametrize("kernel,settings,plan_name,group,cfg_mode", CASES, ids=[f"{c[0]}-{c[2]}" for c in CASES])
def test_rescore_gives_ratio_one(turbo, kernel, settings, plan_name, group, cfg_mode):
    sampler = Sampler(SamplerConfig(num_steps=4, sde_kernel={"name": kernel, **settings}, cfg_mode=cfg_mode,
                                    guidance_scale=2.0, keep_means=True))  # fmt: skip
    plan = build_plan(plan_name, 4, **({"split_steps": (0, 2)} if plan_name == "tree" else {}))
    tree = sampler.run(turbo, [PROMPT, "a blue dog"], plan, group, torch.Generator().manual_seed(0))
    edges = tree.trained_edges()
    out = sampler.rescore(turbo, tree, edges, [PROMPT, "a blue dog"])
    assert edges.numel() > 0 and torch.allclose(out.logp, tree.edge_logp[edges], atol=1e-5, rtol=0)


def test_from_pretrained_of_a_saved_pipeline(turbo, tmp_path):
    a = turbo
    a.pipe.save_pretrained(tmp_path)
    b = build_adapter("zimage", pretrained=tmp_path, max_sequence_length=a.max_sequence_length, cfg_normalization=0.5)
    assert type(b) is ZImageAdapter and b.cfg_normalization == 0.5 and b.scheduler_config == a.scheduler_config
    ea, eb = a.encode_prompts([PROMPT]), b.encode_prompts([PROMPT])
    torch.testing.assert_close(ea.cond, eb.cond, rtol=1e-5, atol=1e-6)
    assert torch.equal(ea.mask, eb.mask)
    x = torch.randn(1, 4, 16, 16)
    with torch.no_grad():
        torch.testing.assert_close(a.model_output(x, 0.5, ea, 0.0, "none"), b.model_output(x, 0.5, eb, 0.0, "none"))
        assert torch.equal(a.decode(x), b.decode(x))


def test_recipe_runs_with_ratio_one_and_its_lora_loads_in_diffusers(tmp_path):
    from flowgrpo.t2i import load_t2i_config, train_t2i

    cfg = load_t2i_config(RECIPE, [f"output_dir={tmp_path}", "iterations=2", "group_size=4", "progress=false",
                                   "artifacts.tensorboard=false", "artifacts.plot=false"])  # fmt: skip
    records = train_t2i(cfg)
    assert len(records) == 2 and all(r["check/first_pass_ratio_dev"] < 1e-5 for r in records)
    assert records[0]["check/rows"] > 0 and records[-1]["optimizer_steps"] > 0
    tuned = build_adapter("zimage", tiny=True)  # the recipe's base weights (init_seed 0)
    x, e = torch.randn(1, 4, 16, 16), tuned.encode_prompts([PROMPT])
    with torch.no_grad():
        before = tuned.model_output(x, 0.6, e, 0.0, "none")
        tuned.pipe.load_lora_weights(tmp_path / "lora")  # diffusers' own loader
        after = tuned.model_output(x, 0.6, e, 0.0, "none")
        ours = build_adapter("zimage", tiny=True)
        ours.load_lora(tmp_path / "lora")
        torch.testing.assert_close(ours.model_output(x, 0.6, e, 0.0, "none"), after, atol=1e-6, rtol=1e-5)
    assert not torch.allclose(before, after, atol=1e-5)


@pytest.mark.heavy
def test_recipe_learns(tmp_path):
    sys.path.append(str(Path(__file__).resolve().parents[1]))  # appended: tests/reward_models must not shadow
    from t2i.learning_runs import learning_margin

    m = learning_margin("zimage_turbo", tmp_path, iterations=16)
    assert m["first_learn"] == pytest.approx(m["first_still"], abs=1e-7), m
    assert m["gain"] > 5.0 * m["noise"] and m["gain"] > 0, m


# Tongyi-MAI/Z-Image-Turbo scheduler_config.json: static shift 3, no dynamic shifting (the pipeline's mu is unused)
TURBO_SCHEDULER = {"num_train_timesteps": 1000, "shift": 3.0, "use_dynamic_shifting": False}


@pytest.mark.parametrize("steps,px", [(6, 512), (8, 1024), (9, 1024), (10, 512)])
def test_turbo_grid_of_the_released_scheduler_equals_the_pipeline_s_set_timesteps(steps, px):
    """The adapter's grid against ZImagePipeline's own steps (calculate_shift's mu, get_default_z_image_sigmas,
    retrieve_timesteps) under Turbo's released scheduler config: the uniform grid under shift 3 (Flow-Factory's
    Turbo recipe: 6 steps at 512 px, evaluated with 10; the model card's 9 steps = 8 forwards plus the last)."""
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.pipelines.z_image import pipeline_z_image as zp

    a = build_adapter("zimage", tiny=True)
    a.pipe.scheduler = FlowMatchEulerDiscreteScheduler.from_config(TURBO_SCHEDULER)
    ours = a.flow_grid(steps, px, px, None)
    ref = FlowMatchEulerDiscreteScheduler.from_config(TURBO_SCHEDULER)
    mu = zp.calculate_shift((px // 16) ** 2)  # passed by the pipeline, ignored without dynamic shifting
    zp.retrieve_timesteps(ref, steps, "cpu", sigmas=zp.get_default_z_image_sigmas(steps), mu=mu)
    torch.testing.assert_close(ours.sigmas, ref.sigmas.float(), rtol=0, atol=1e-6)
    s = torch.linspace(1.0, 1.0 / steps, steps)
    torch.testing.assert_close(ours.sigmas[:-1], 3 * s / (1 + 2 * s), rtol=0, atol=1e-6)  # shift 3 by hand
    assert ours.sigmas[-1] == 0
