"""MultiReward (weights, per-reward outputs, NaN) and pairwise from pointwise."""

import math

import pytest
import torch

from reward_models import build_scorer
from reward_models.multi import MultiReward

from rewards_helpers import PROMPTS


def test_total_is_weighted_sum_and_outputs_are_kept(images):
    multi = build_scorer(
        "multi",
        rewards=[
            {"name": "brightness", "weight": 2.0},
            {"name": "jpeg_compressibility", "weight": -1 / 500},
            {"name": "pickscore", "tiny": True, "device": "cpu", "weight": 1 / 26},
        ],
    )
    out = multi(images, PROMPTS)
    assert set(out) == {"brightness", "jpeg_compressibility", "pickscore", "total"}
    expected = 2 * out["brightness"] - out["jpeg_compressibility"] / 500 + out["pickscore"] / 26
    assert torch.allclose(out["total"], expected, atol=1e-6)
    assert multi.weights == {"brightness": 2.0, "jpeg_compressibility": -1 / 500, "pickscore": 1 / 26}
    assert multi.requires_prompts


def test_nan_propagates_unless_weight_is_zero(images):
    x = images.clone()
    x[1] = float("nan")
    b, c = build_scorer("brightness"), build_scorer("colorfulness")
    out = MultiReward([(b, 1.0), (c, 0.0)])(x)
    assert torch.isnan(out["total"][1]) and torch.isfinite(out["total"][[0, 2, 3, 4]]).all()
    assert torch.isnan(out["colorfulness"][1])  # logged, still NaN, never 0
    assert torch.equal(out["total"][[0, 2, 3, 4]], out["brightness"][[0, 2, 3, 4]])


def test_key_collisions_are_errors():
    with pytest.raises(ValueError, match="share the key"):
        MultiReward([(build_scorer("brightness"), 1.0), (build_scorer("brightness"), 1.0)])
    with pytest.raises(ValueError, match="reserved"):
        MultiReward([(build_scorer("brightness", key="total"), 1.0)])
    ok = MultiReward([(build_scorer("brightness"), 1.0), (build_scorer("brightness", key="luma2"), 0.5)])
    assert set(ok.weights) == {"brightness", "luma2"}


def test_multi_is_differentiable_when_its_parts_are(images):
    multi = build_scorer("multi", rewards=[{"name": "brightness"}, {"name": "colorfulness", "weight": 0.01}])
    assert multi.differentiable
    x = images.clone().requires_grad_(True)
    multi(x)["total"].sum().backward()
    assert x.grad.abs().sum() > 0


def test_pointwise_as_pairwise(images):
    pair = build_scorer("pointwise_as_pairwise", scorer={"name": "brightness"}, temperature=0.1)
    a, b = images, images.flip(0)
    p_ab, p_ba = pair(a, b), pair(b, a)
    assert torch.allclose(p_ab + p_ba, torch.ones(5), atol=1e-6)
    assert torch.allclose(pair(a, a), torch.full((5,), 0.5))
    s = build_scorer("brightness")(a)["brightness"]
    assert p_ab[0].item() == pytest.approx(1 / (1 + math.exp(-(s[0] - s[4]).item() / 0.1)), abs=1e-6)
    x = a.clone()
    x[2] = float("nan")
    assert torch.isnan(pair(x, b)[2]) and torch.isnan(pair(b, x)[2])
    with pytest.raises(ValueError, match="5 images in a but 4"):
        pair(a, b[:4])
    with pytest.raises(ValueError, match="temperature"):
        build_scorer("pointwise_as_pairwise", scorer="brightness", temperature=0)
