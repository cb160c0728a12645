"""Adapters against the real diffusers pipelines: the same denoising loop gives the same latents,
save_pretrained / from_pretrained round trips, and LoRA files that `load_lora_weights` reads."""

import pytest
import torch
from adapter_variants import VARIANTS

from pipelines.adapters import Adapter, build_adapter
from pipelines.adapters.flux import pack, unpack

STEPS = 3


def build(variant: str, **kw) -> Adapter:
    name, opts = VARIANTS[variant]
    return build_adapter(name, tiny=True, **opts, **kw)


def run_pipeline(a: Adapter, x0: torch.Tensor, output_type: str = "latent", **call) -> torch.Tensor:
    """The family's own pipeline __call__ from the same initial noise: latents [B, C, h, w] or images."""
    a.pipe.set_progress_bar_config(disable=True)
    kw = dict(prompt="a red cat", num_inference_steps=STEPS, height=32, width=32, output_type=output_type, **call)
    if a.family in ("sd3", "flux"):
        kw["max_sequence_length"] = 16
    packed = a.family in ("flux", "qwenimage")
    out = a.pipe(latents=pack(x0) if packed else x0.clone(), **kw).images
    return unpack(out, *x0.shape[2:]) if packed and output_type == "latent" else out


@torch.no_grad()
def our_latents(a: Adapter, x0: torch.Tensor, w: float, mode: str, negative: str = "", sched=None) -> torch.Tensor:
    """Our model_output driving the grid the pipeline just used (Euler for flow, DDIM eta=0)."""
    e = a.encode_prompts(["a red cat"], negative_prompt=negative)
    sched, x = sched or a.pipe.scheduler, x0.clone()
    if a.prediction == "velocity":
        s = sched.sigmas
        for i in range(STEPS):
            x = x + (s[i + 1] - s[i]) * a.model_output(x, s[i], e, w, mode)
        return x
    for t in sched.timesteps:
        x = sched.step(a.model_output(x, t, e, w, mode), t, x).prev_sample
    return x


# (variant, pipeline call kwargs, our guidance, our cfg_mode)
LOOPS = [
    ("sd3", {"guidance_scale": 4.5, "negative_prompt": ""}, 4.5, "full"),
    ("sd3.5", {"guidance_scale": 1.0}, 1.0, "none"),  # the pipeline skips CFG at scale 1
    ("flux-dev", {"guidance_scale": 3.0}, 3.0, "none"),  # distilled guidance embedding
    ("flux-dev", {"guidance_scale": 3.5, "true_cfg_scale": 2.0, "negative_prompt": ""}, 2.0, "full"),
    ("flux-schnell", {"guidance_scale": 0.0}, 0.0, "none"),
    ("sd15", {"guidance_scale": 7.5, "negative_prompt": "", "eta": 0.0}, 7.5, "full"),
    ("qwenimage", {"true_cfg_scale": 4.0, "negative_prompt": "blurry"}, 4.0, "full"),  # norm-rescaled CFG
    ("qwenimage", {"true_cfg_scale": 1.0}, 1.0, "none"),
]


@pytest.mark.parametrize("variant,call,w,mode", LOOPS, ids=[f"{v}-{m}" for v, _, _, m in LOOPS])
def test_model_output_and_decode_reproduce_the_diffusers_pipeline(variant, call, w, mode):
    a = build(variant)
    x0 = torch.randn(1, *a.latent_shape(32, 32))
    ref = run_pipeline(a, x0, **call)
    ours = our_latents(a, x0, w, mode, call.get("negative_prompt", ""))
    torch.testing.assert_close(ours, ref, atol=2e-5, rtol=1e-5)
    images = run_pipeline(a, x0, output_type="pt", **call)  # the pipeline's own un-scaling and VAE decode
    with torch.no_grad():
        torch.testing.assert_close(a.decode(ours), images, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("variant", ["sd3.5", "flux-dev", "sd15", "qwenimage"])
def test_save_pretrained_from_pretrained_identical(variant, tmp_path):
    a = build(variant)
    a.pipe.save_pretrained(tmp_path)
    b = build_adapter(VARIANTS[variant][0], pretrained=tmp_path, max_sequence_length=a.max_sequence_length)
    assert type(b) is type(a) and b.prediction == a.prediction and b.scheduler_config == a.scheduler_config
    ea, eb = a.encode_prompts(["a red cat", "x"]), b.encode_prompts(["a red cat", "x"])
    assert torch.equal(ea.cond, eb.cond) and torch.equal(ea.uncond, eb.uncond)
    assert (ea.mask is None) == (eb.mask is None)
    x = torch.randn(2, *a.latent_shape(32, 32))
    s = torch.tensor([0.4, 0.9]) if a.prediction == "velocity" else torch.tensor([400, 900])
    with torch.no_grad():
        # transformers may pick another attention kernel for a loaded text encoder than for one built from
        # its config: pooled embeddings then agree to float rounding, not bit for bit
        torch.testing.assert_close(a.model_output(x, s, ea, 3.0), b.model_output(x, s, eb, 3.0), rtol=1e-5, atol=1e-6)
        assert torch.equal(a.decode(x), b.decode(x))


def test_from_pretrained_dtype(tmp_path):
    build("flux-schnell").pipe.save_pretrained(tmp_path)
    a = build_adapter("flux", pretrained=str(tmp_path), dtype=torch.bfloat16, device="cpu", max_sequence_length=16)
    assert a.dtype == torch.bfloat16 and a.pipe.text_encoder.dtype == torch.bfloat16
    e = a.encode_prompts(["a"])
    with torch.no_grad():
        assert torch.isfinite(a.model_output(torch.randn(1, 4, 16, 16), 0.5, e, 0.0, "none")).all()


def test_missing_weights_are_named(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(FileNotFoundError, match="no-such-model"):
        build_adapter("sd3", pretrained=missing)
    with pytest.raises(FileNotFoundError, match="model_index.json"):
        build_adapter("flux", pretrained=tmp_path)  # exists, but is no pipeline folder
    # a hub id cannot be fetched offline: still a clear error naming it
    with pytest.raises(FileNotFoundError, match="nobody/no-such-model"):
        build_adapter("sd15", pretrained="nobody/no-such-model")


@pytest.mark.parametrize("variant", ["sd3", "flux-dev", "sd15", "qwenimage"])
def test_lora_file_loads_in_the_diffusers_pipeline(variant, tmp_path):
    a = build(variant)
    params = a.add_lora(rank=4, alpha=8)  # alpha != rank: the scale must survive the file
    with torch.no_grad():
        for p in params:
            p.add_(0.2 * torch.randn_like(p))
    a.save_lora(tmp_path)
    pipe_adapter = build(variant)  # the same tiny base weights (same seed)
    pipe_adapter.pipe.load_lora_weights(tmp_path)  # diffusers' own loader
    e = a.encode_prompts(["a red cat"])
    x = torch.randn(1, *a.latent_shape(32, 32))
    s = torch.tensor([0.6]) if a.prediction == "velocity" else torch.tensor([600])
    with torch.no_grad():
        ours = a.model_output(x, s, e, 2.0)
        theirs = pipe_adapter.model_output(x, s, e, 2.0)
        with a.reference():
            base = a.model_output(x, s, e, 2.0)
    assert not torch.allclose(ours, base, atol=1e-4)
    torch.testing.assert_close(theirs, ours, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("variant", ["sd3", "flux-dev", "sd15", "qwenimage"])
def test_scheduler_config_gives_the_pipeline_grid(variant):
    """adapter.scheduler_config + pipelines.schedules walk the grid the family's pipeline walks."""
    from pipelines.schedules import ddim_schedule, flow_schedule

    a = build(variant)
    call = {"guidance_scale": 1.0} if a.family != "qwenimage" else {}
    run_pipeline(a, torch.randn(1, *a.latent_shape(32, 32)), **call)  # leaves its grid in pipe.scheduler
    if a.prediction == "epsilon":
        assert torch.equal(ddim_schedule(STEPS, config=a.scheduler_config).timesteps, a.pipe.scheduler.timesteps)
        return
    if a.scheduler_config.get("use_dynamic_shifting"):  # FLUX / Qwen-Image: uniform grid, shift from tokens
        ours = flow_schedule(STEPS, image_seq_len=a.image_seq_len(32, 32), spacing="uniform",
                             config=a.scheduler_config)  # fmt: skip
    else:
        ours = flow_schedule(STEPS, config=a.scheduler_config)
    torch.testing.assert_close(ours.sigmas, a.pipe.scheduler.sigmas.float())
