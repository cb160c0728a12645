"""dino_discriminator with a tiny DINOv2: shapes, the reward and hinge formulas by hand, training, state."""

import pytest
import torch
import torch.nn.functional as F

from reward_models import build_scorer
from reward_models.adversarial import DinoDiscriminator
from reward_models.images import ImageBatch

from rewards_helpers import quantised_images

K = 8  # patches per image (the tiny DINOv2 has 16)


@pytest.fixture(scope="module")
def scorer():
    return build_scorer("dino_discriminator", tiny=True, device="cpu", num_patches=K, head_hidden=24, seed=3)


def hand_head(scorer, x):
    """h(x) = W2 gelu(W1 x + b1) + b2, from the head's weights."""
    (w1, b1), (w2, b2) = [(m.weight.detach(), m.bias.detach()) for m in scorer.head.layers if hasattr(m, "weight")]
    return (F.gelu(x @ w1.T + b1) @ w2.T + b2).squeeze(-1)


def hand_tokens(scorer, images, generator_state):
    """CLS and the drawn patch tokens, recomputed from the backbone with a copy of the generator."""
    with torch.no_grad():
        tokens = scorer.backbone.model(pixel_values=scorer.backbone.tensor_pixels(ImageBatch(images))).last_hidden_state
    g = torch.Generator()
    g.set_state(generator_state)
    idx = torch.randint(0, tokens.shape[1] - 1, (images.shape[0], K), generator=g)
    patches = torch.stack([tokens[i, 1:][idx[i]] for i in range(images.shape[0])])
    return tokens[:, 0], patches


def test_shapes_registry_and_frozen_backbone(scorer, images):
    assert isinstance(scorer, DinoDiscriminator) and scorer.num_patches == K
    assert (scorer.cls_weight, scorer.patch_weight) == (0.7, 0.3)
    shapes = [tuple(p.shape) for p in scorer.trainable_parameters()]
    assert shapes == [(24, 32), (24,), (1, 24), (1,)]
    assert all(p.requires_grad for p in scorer.trainable_parameters())
    assert not any(p.requires_grad for p in scorer.backbone.model.parameters())
    cls, patches = scorer.features(images)
    assert cls.shape == (5, 32) and patches.shape == (5, K, 32) and cls.dtype == torch.float32
    x = images.clone().requires_grad_(True)
    out = scorer(x)
    assert set(out) == {"dino_discriminator", "dino_discriminator/cls", "dino_discriminator/patch"}
    assert all(v.shape == (5,) and v.dtype == torch.float32 for v in out.values())
    assert not out["dino_discriminator"].requires_grad  # scoring builds no graph


def test_reward_formula_by_hand(scorer, images):
    """The reward L2-normalises CLS and patches before the head, x / (||x|| + 1e-6) (Adv-GRPO rewards.py)."""
    state = scorer.patch_generator.get_state()
    out = scorer(images)
    cls, patches = hand_tokens(scorer, images, state)
    cls = cls / (torch.linalg.vector_norm(cls, dim=-1, keepdim=True) + 1e-6)
    patches = patches / (torch.linalg.vector_norm(patches, dim=-1, keepdim=True) + 1e-6)
    h_cls, h_patch = hand_head(scorer, cls), hand_head(scorer, patches)
    expected = 0.7 * h_cls + 0.3 * h_patch.mean(1)
    assert torch.allclose(out["dino_discriminator"], expected, atol=1e-5)
    assert torch.allclose(out["dino_discriminator/cls"], h_cls, atol=1e-5)
    assert torch.allclose(out["dino_discriminator/patch"], h_patch.mean(1), atol=1e-5)
    # the next call draws other patches: the CLS part stays, the patch part moves
    again = scorer(images)
    assert torch.allclose(again["dino_discriminator/cls"], h_cls, atol=1e-5)
    assert not torch.allclose(again["dino_discriminator/patch"], out["dino_discriminator/patch"])


def test_raw_tokens_when_normalisation_is_off(images):
    """normalize_tokens: false scores the raw tokens, which differs from the default here (the tiny
    DINOv2's tokens are far from unit norm), so the by-hand test above pins the normalisation."""
    kw = dict(tiny=True, device="cpu", num_patches=K, head_hidden=24, seed=3)
    raw, unit = (
        build_scorer("dino_discriminator", normalize_tokens=False, **kw),
        build_scorer("dino_discriminator", **kw),
    )
    assert unit.normalize_tokens and not raw.normalize_tokens
    state = raw.patch_generator.get_state()
    cls, patches = hand_tokens(raw, images, state)
    assert not torch.allclose(cls.norm(dim=-1), torch.ones(len(cls)), atol=0.1)
    out_raw, out_unit = raw(images), unit(images)
    expected = 0.7 * hand_head(raw, cls) + 0.3 * hand_head(raw, patches).mean(1)
    assert torch.allclose(out_raw["dino_discriminator"], expected, atol=1e-5)
    assert not torch.allclose(out_unit["dino_discriminator"], expected, atol=1e-3)


def test_hinge_loss_by_hand_and_gradient_on_head_only(scorer):
    """The D loss takes the raw tokens (Adv-GRPO train_dino), even though the reward normalises them."""
    real, fake = quantised_images(3, 24, 24, seed=1), quantised_images(4, 24, 24, seed=2)
    state = scorer.patch_generator.get_state()
    cls, pat = hand_tokens(scorer, torch.cat([real, fake]), state)  # one backbone pass, reals first
    cls_r, cls_f, pat_r, pat_f = cls[:3], cls[3:], pat[:3], pat[3:]
    bias = scorer.head.layers[2].bias
    old_bias = bias.detach().clone()
    with torch.no_grad():  # shift the head so that half the real patch terms sit past the hinge
        bias.add_(1 - hand_head(scorer, pat_r).median())
    try:
        hinge = scorer.hinge_loss(real, fake)
        loss, metrics = hinge.loss, hinge.metrics
        hr, hf, pr, pf = (hand_head(scorer, t) for t in (cls_r, cls_f, pat_r, pat_f))
        cls_loss = 0.5 * (F.relu(1 - hr).mean() + F.relu(1 + hf).mean())
        patch_loss = 0.5 * (F.relu(1 - pr).mean() + F.relu(1 + pf).mean())
        assert (pr > 1).any() and (pr < 1).any()  # both sides of the hinge are exercised
        assert loss.item() == pytest.approx((cls_loss + 0.3 * patch_loss).item(), abs=1e-5)
        assert metrics["cls_loss"] == pytest.approx(cls_loss.item(), abs=1e-5)
        assert metrics["patch_loss"] == pytest.approx(patch_loss.item(), abs=1e-5)
        assert metrics["real_score"] == pytest.approx((0.7 * hr + 0.3 * pr.mean(1)).mean().item(), abs=1e-5)
        assert metrics["fake_score"] == pytest.approx((0.7 * hf + 0.3 * pf.mean(1)).mean().item(), abs=1e-5)
        assert metrics["accuracy"] == pytest.approx(0.5 * ((hr > 0).float().mean() + (hf < 0).float().mean()).item())
        loss.backward()
        assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in scorer.trainable_parameters())
        assert all(p.grad is None for p in scorer.backbone.model.parameters())
    finally:
        with torch.no_grad():
            bias.copy_(old_bias)
        for p in scorer.trainable_parameters():
            p.grad = None


def test_one_adam_step_lowers_the_loss_on_a_fixed_batch():
    s = build_scorer("dino_discriminator", tiny=True, device="cpu", num_patches=K, seed=0)
    real, fake = quantised_images(4, 16, 16, seed=4) * 0.2 + 0.8, quantised_images(4, 16, 16, seed=5) * 0.2
    opt = torch.optim.Adam(s.trainable_parameters(), lr=1e-4, betas=(0.5, 0.999))
    state = s.patch_generator.get_state()
    before = s.hinge_loss(real, fake).loss
    opt.zero_grad()
    before.backward()
    opt.step()
    s.patch_generator.set_state(state)  # the same patches
    after = s.hinge_loss(real, fake).loss
    assert after.item() < before.item() - 1e-5


def test_state_round_trip_and_seeding(tmp_path, images):
    a = build_scorer("dino_discriminator", tiny=True, device="cpu", num_patches=K, seed=0)
    b = build_scorer("dino_discriminator", tiny=True, device="cpu", num_patches=K, seed=0)
    assert torch.equal(a(images)["dino_discriminator"], b(images)["dino_discriminator"])  # seeded
    with torch.no_grad():
        a.head.layers[0].weight.add_(0.1)
    a(images)  # advance the patch generator
    state = a.state_tensors()
    assert set(state) == {
        "head.layers.0.weight",
        "head.layers.0.bias",
        "head.layers.2.weight",
        "head.layers.2.bias",
        "patch_generator",
    }
    c = build_scorer("dino_discriminator", tiny=True, device="cpu", num_patches=K, seed=7)
    assert not torch.equal(c(images)["dino_discriminator"], a(images)["dino_discriminator"])
    state = a.state_tensors()
    c.load_state_tensors(state)
    assert torch.equal(c(images)["dino_discriminator"], a(images)["dino_discriminator"])
    a.save_head(tmp_path / "head.safetensors")
    d = build_scorer(
        "dino_discriminator", tiny=True, device="cpu", num_patches=K, head=str(tmp_path / "head.safetensors")
    )
    assert torch.equal(d(images)["dino_discriminator/cls"], a(images)["dino_discriminator/cls"])


def test_non_finite_images(scorer, images):
    x = images.clone()
    x[1, 0, 0, 0] = float("nan")
    out = scorer(x)["dino_discriminator"]
    assert torch.isnan(out[1]) and torch.isfinite(out[[0, 2, 3, 4]]).all()
    loss = scorer.hinge_loss(images[:2], x).loss  # the NaN fake is left out
    assert torch.isfinite(loss)
    with pytest.raises(ValueError, match="non-finite"):
        scorer.hinge_loss(images[:2], x[1:2])
    with pytest.raises(ValueError, match="num_patches"):
        build_scorer("dino_discriminator", tiny=True, device="cpu", num_patches=0)
