"""GPU speed switches change nothing they should not: on the tiny real-architecture adapters, regional
compile, the attention backend, gradient checkpointing, split CFG and chunked decode give the same
outputs (and LoRA gradients) to float tolerance; autocast and inference-mode rollouts keep ratio 1."""

import pytest
import torch

from pipelines.adapters import build_adapter
from pipelines.plans import build_plan
from pipelines.sampler import Sampler, SamplerConfig
from pipelines.speed import CompileConfig, SpeedConfig, apply_speed, denoiser_blocks

PROMPTS = ["a cat", "a red dog"]


def _adapter(family: str, seed: int = 0, **speed):
    adapter = build_adapter(family, tiny=True, seed=seed)
    with torch.random.fork_rng(devices=[]):  # the same LoRA weights in every adapter built here
        torch.manual_seed(seed)
        params = adapter.add_lora(rank=4)
        with torch.no_grad():  # non-zero LoRA B so the LoRA branch is part of every output
            for p in params:
                p.add_(0.05 * torch.randn_like(p))
    done = apply_speed(adapter, SpeedConfig(**speed))
    return adapter, params, done


def _output_and_grads(adapter, params, cfg_mode="detach_uncond", batch=2):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(batch, *adapter.latent_shape(32, 32), generator=gen)
    embeds = adapter.encode_prompts(PROMPTS[:batch])
    for p in params:
        p.grad = None
    out = adapter.model_output(x, torch.tensor([0.7, 0.4][:batch]), embeds, 4.5, cfg_mode)
    (out * torch.randn(out.shape, generator=gen)).sum().backward()
    return out.detach(), [torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in params]


def _assert_same(a, b, atol=1e-5):
    (out_a, grads_a), (out_b, grads_b) = a, b
    torch.testing.assert_close(out_a, out_b, atol=atol, rtol=1e-4)
    for ga, gb in zip(grads_a, grads_b):
        torch.testing.assert_close(ga, gb, atol=atol, rtol=1e-3)


@pytest.mark.parametrize("family", ["sd3", "flux", "sd15", "qwenimage"])
def test_regional_compile_gives_the_same_outputs_and_grads(family):
    plain_adapter, plain_params, _ = _adapter(family)
    plain = _output_and_grads(plain_adapter, plain_params)
    adapter, params, done = _adapter(family, compile={"enabled": True, "backend": "aot_eager"})
    assert done["compiled_blocks"] == len(denoiser_blocks(adapter)) >= 2
    assert all(b._compiled_call_impl is not None for b in denoiser_blocks(adapter))  # each block, not the model
    assert adapter.denoiser._compiled_call_impl is None
    _assert_same(plain, _output_and_grads(adapter, params))
    # compiled in place: the same parameter names (a checkpoint of either loads into the other)
    assert {n for n, _ in adapter.denoiser.named_parameters()} == {
        n for n, _ in plain_adapter.denoiser.named_parameters()
    }


def _training_forward(adapter):
    x = torch.randn(2, *adapter.latent_shape(32, 32), generator=torch.Generator().manual_seed(1))
    return lambda: adapter.model_output(
        x, torch.tensor([0.7, 0.4]), adapter.encode_prompts(PROMPTS), 4.5, "detach_uncond"
    )


@pytest.mark.parametrize("family", ["sd3", "flux", "sd15", "qwenimage"])
def test_gradient_checkpointing_gives_the_same_grads_and_recomputes(family, saved_for_backward):
    plain_adapter, plain_params, _ = _adapter(family)
    plain = _output_and_grads(plain_adapter, plain_params)
    adapter, params, done = _adapter(family, gradient_checkpointing=True)
    assert done["gradient_checkpointing"] and adapter.denoiser.is_gradient_checkpointing
    _assert_same(plain, _output_and_grads(adapter, params))
    # the denoiser runs in eval mode, as in training: the flag alone is not enough, the activations must go
    assert not adapter.denoiser.training
    # measured: 4.7x (sd15) to 16x fewer bytes
    recomputed, _ = saved_for_backward(_training_forward(adapter))
    kept, _ = saved_for_backward(_training_forward(plain_adapter))
    assert recomputed < kept / 3


@pytest.mark.parametrize("family", ["sd3", "qwenimage"])
def test_split_cfg_equals_the_batched_forward(family):
    for mode in ("full", "detach_uncond"):
        plain = _output_and_grads(*_adapter(family)[:2], cfg_mode=mode)
        adapter, params, _ = _adapter(family, cfg_forward="split")
        _assert_same(plain, _output_and_grads(adapter, params, cfg_mode=mode))


def test_attention_backend_native_math_matches_sdpa_and_bad_names_fail():
    plain = _output_and_grads(*_adapter("flux")[:2])
    adapter, params, done = _adapter("flux", attention_backend="_native_math")
    assert done["attention"] == "dispatcher"
    try:
        _assert_same(plain, _output_and_grads(adapter, params))
    finally:
        adapter.denoiser.reset_attention_backend()  # diffusers keeps the backend process-wide
    with pytest.raises(ValueError, match="dispatcher"):  # SD3's processors call SDPA directly
        _adapter("sd3", attention_backend="_native_math")
    with pytest.raises(ValueError, match="not a diffusers attention backend"):
        SpeedConfig(attention_backend="fastest")


def test_chunked_decode_equals_one_batch():
    adapter, _, _ = _adapter("sd3")
    z = torch.randn(5, *adapter.latent_shape(32, 32))
    whole = adapter.decode(z)
    adapter.decode_batch_size = 2
    rows = []
    decode = adapter.vae.decode
    adapter.vae.decode = lambda latents, **kw: rows.append(latents.shape[0]) or decode(latents, **kw)
    torch.testing.assert_close(adapter.decode(z), whole, atol=1e-5, rtol=0)
    assert rows == [2, 2, 1]  # the VAE saw chunks, not the whole batch


@pytest.mark.parametrize("speed", [{}, {"autocast": "bfloat16"}], ids=["fp32", "autocast-bf16"])
def test_inference_mode_rollout_rescored_with_grad_gives_ratio_one(speed):
    adapter, params, _ = _adapter("sd3", **speed)
    plan = build_plan("full_sde", 3)
    runs, modes = {}, []
    hook = adapter.denoiser.register_forward_hook(lambda *_: modes.append(torch.is_inference_mode_enabled()))
    for mode in (False, True):
        sampler = Sampler(SamplerConfig(num_steps=3, inference_mode=mode))
        runs[mode] = sampler, sampler.run(adapter, PROMPTS, plan, 2, torch.Generator().manual_seed(0))
    hook.remove()
    assert modes == [False] * 3 + [True] * 3  # the switch is what puts the denoiser calls in inference mode
    sampler, tree = runs[True]
    assert not tree.states.is_inference() and not tree.schedule.sigmas.is_inference()
    torch.testing.assert_close(tree.states, runs[False][1].states, atol=0, rtol=0)  # same rollout either way
    edges = tree.trained_edges()
    out = sampler.rescore(adapter, tree, edges, PROMPTS)
    out.logp.sum().backward()  # autograd through the stored states works
    assert all(p.grad is not None for p in params)
    assert float((out.logp.detach() - tree.edge_logp[edges]).exp().sub(1).abs().max()) < 1e-4


def test_autocast_runs_bf16_matmuls_on_fp32_weights():
    adapter, params, _ = _adapter("sd3", autocast="bfloat16")
    assert adapter.dtype == torch.float32 and all(p.dtype == torch.float32 for p in params)
    seen = []
    hook = adapter.denoiser.transformer_blocks[0].attn.to_q.base_layer.register_forward_hook(
        lambda m, i, o: seen.append(o.dtype)
    )
    out, grads = _output_and_grads(adapter, params)
    hook.remove()
    assert seen == [torch.bfloat16] and out.dtype == torch.float32
    assert all(g.dtype == torch.float32 and torch.isfinite(g).all() for g in grads)


def test_config_is_validated():
    with pytest.raises(ValueError, match="compile.mode"):
        CompileConfig(mode="fastest")
    with pytest.raises(ValueError, match="compile.backend"):
        CompileConfig(enabled=True, backend="nope")
    with pytest.raises(ValueError):
        SpeedConfig(decode_batch_size=0)
    with pytest.raises(ValueError):
        SpeedConfig(autocast="float64")
    with pytest.raises(ValueError, match="unknown key"):
        SpeedConfig(compile_blocks=True)


def test_t2i_model_config_applies_the_switches():
    from flowgrpo.t2i.config import ImageModelConfig
    from flowgrpo.t2i.model import build_policy

    cfg = ImageModelConfig(
        tiny=True, device="cpu", speed={"gradient_checkpointing": True, "decode_batch_size": 3, "cfg_forward": "split"}
    )
    adapter, params = build_policy(cfg)
    assert adapter.denoiser.is_gradient_checkpointing and adapter.decode_batch_size == 3
    assert adapter.cfg_forward == "split" and params


def test_cudnn_attention_and_tf32_are_process_switches_off_by_default():
    """cuDNN SDPA off (it failed in a FLUX-size checkpointed backward on an H100) and fp32 kept exact (no TF32
    matmuls or convolutions) unless the config asks; apply_speed reports what it set."""
    before = (
        torch.backends.cuda.cudnn_sdp_enabled(),
        torch.backends.cuda.matmul.allow_tf32,
        torch.backends.cudnn.allow_tf32,
    )
    try:
        torch.backends.cuda.enable_cudnn_sdp(True)
        torch.backends.cudnn.allow_tf32 = True  # torch's own default
        done = _adapter("sd3")[2]
        assert done["cudnn_attention"] is False and done["tf32"] is False
        assert not torch.backends.cuda.cudnn_sdp_enabled()
        assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32
        done = _adapter("sd3", cudnn_attention=True, tf32=True)[2]
        assert done["cudnn_attention"] is True and done["tf32"] is True
        assert torch.backends.cuda.cudnn_sdp_enabled()
        assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
    finally:
        torch.backends.cuda.enable_cudnn_sdp(before[0])
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before[1], before[2]
