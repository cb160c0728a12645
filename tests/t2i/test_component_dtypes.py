"""`model.component_dtypes`: frozen components in their own dtype (the published SD3.5-M runs: fp16 text encoders
and an fp32 VAE beside an fp32 or fp16 transformer), applied after the build; encode, denoise and decode run on any
mix; a wrong name is one line listing the valid ones."""

from __future__ import annotations

import pytest
import torch

from flowgrpo.config import ConfigError
from flowgrpo.t2i.config import ImageModelConfig
from flowgrpo.t2i.model import build_policy


def _policy(**kw):
    return build_policy(ImageModelConfig(family="sd3", tiny=True, lora={"rank": 2}, **kw))


def test_components_take_their_dtype_and_a_step_runs_end_to_end():
    text16 = {"text_encoder": "float16", "text_encoder_2": "float16", "text_encoder_3": "float16"}
    adapter, params = _policy(component_dtypes={**text16, "vae": "float32"})  # Flow-GRPO: fp32 transformer
    pipe = adapter.pipe
    assert [pipe.text_encoder.dtype, pipe.text_encoder_2.dtype, pipe.text_encoder_3.dtype] == [torch.float16] * 3
    assert pipe.vae.dtype == torch.float32 and adapter.dtype == torch.float32
    assert all(p.dtype == torch.float32 and p.requires_grad for p in params)  # LoRA stays fp32, trainable
    embeds = adapter.encode_prompts(["a cat"])
    assert embeds.cond.dtype == torch.float32  # fp16 encoder output handed to the fp32 denoiser in its dtype
    latents = torch.randn(1, *adapter.latent_shape(64, 64))
    out = adapter.model_output(latents, 0.5, embeds, 4.5)
    out.float().pow(2).mean().backward()
    assert all(p.grad is not None for p in params)
    images = adapter.decode(latents)
    assert images.dtype == torch.float32 and bool(torch.isfinite(images).all())


def test_a_half_precision_transformer_keeps_an_fp32_vae():
    adapter, _ = _policy(dtype="bfloat16", component_dtypes={"vae": "float32"})  # TP-GRPO / Adv-GRPO's split
    assert adapter.dtype == torch.bfloat16 and adapter.pipe.text_encoder.dtype == torch.bfloat16
    assert adapter.vae.dtype == torch.float32
    latents = torch.randn(2, *adapter.latent_shape(64, 64), dtype=torch.bfloat16)
    fp32_decode = adapter.decode(latents)  # the bf16 latents are cast to the VAE's fp32
    assert fp32_decode.dtype == torch.float32 and fp32_decode.shape == (2, 3, 64, 64)
    # the default leaves every frozen part in model.dtype, as before the setting existed
    plain, _ = _policy(dtype="bfloat16")
    assert plain.vae.dtype == torch.bfloat16


def test_unknown_or_denoiser_names_are_refused_in_one_line():
    with pytest.raises(ConfigError, match=r"'vea' is not a loaded component.*valid: \[.*'text_encoder'.*'vae'\]"):
        _policy(component_dtypes={"vea": "float32"})
    with pytest.raises(ConfigError, match="'transformer' is the denoiser"):
        _policy(component_dtypes={"transformer": "float16"})
    with pytest.raises(ValueError, match="component_dtypes"):
        ImageModelConfig(tiny=True, component_dtypes={"vae": "float64"})


def test_the_discriminator_head_trains_in_its_own_dtype():
    """Adv-GRPO casts the head to bf16 before `Adam(head.parameters())`: bf16 weights and bf16 Adam moments."""
    from flowgrpo.t2i.adversarial import Discriminator
    from flowgrpo.t2i.config import AdversarialConfig
    from reward_models import build_scorer

    def make(head_dtype):
        scorer = build_scorer("dino_discriminator", tiny=True, device="cpu", num_patches=4, head_dtype=head_dtype)
        cfg = AdversarialConfig(enabled=True, reward="dino_discriminator", reference_generator="bright")
        return Discriminator(scorer, cfg, (16, 16), 0)

    fakes = torch.full((4, 3, 16, 16), 0.2)
    half, full = make("bfloat16"), make("float32")
    assert {p.dtype for p in half.params} == {torch.bfloat16} and {p.dtype for p in full.params} == {torch.float32}
    scores = half.scorer(fakes)["dino_discriminator"]
    assert scores.dtype == torch.float32 and scores.shape == (4,)
    before = [p.detach().clone() for p in half.params]
    half.update(fakes, None, 4)
    moments = [s["exp_avg"].dtype for s in half.optimizer.state.values()]
    assert moments and set(moments) == {torch.bfloat16}  # as published: no fp32 master copy
    assert any(not torch.equal(a, p.detach()) for a, p in zip(before, half.params))
    # the same seeded head, rounded: scores agree to bf16 precision
    torch.testing.assert_close(scores, make("float32").scorer(fakes)["dino_discriminator"], atol=0.05, rtol=0.05)
    with pytest.raises(ValueError, match="head_dtype"):
        build_scorer("dino_discriminator", tiny=True, device="cpu", head_dtype="float64")
