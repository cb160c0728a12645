"""Best-of-N SFT / RWR (flowgrpo/t2i/sft.py): group weights and the weighted matching loss against a float64
re-derivation; one tiny iteration's counts; the learning run (heavy)."""

import math

import pytest
import torch

from flowgrpo.t2i.sft import group_weights


NAN = float("nan")


def test_top_k_keeps_the_best_valid_samples_of_each_group():
    rewards = torch.tensor([[0.1, 0.9, 0.5, 0.9], [NAN, 0.2, 0.3, NAN], [NAN, NAN, NAN, NAN]])
    w = group_weights(rewards, "top_k", top_k=2)
    assert w.tolist() == [[0.0, 0.5, 0.0, 0.5], [0.0, 0.5, 0.5, 0.0], [0.0, 0.0, 0.0, 0.0]]
    w1 = group_weights(rewards, "top_k", top_k=1)
    assert w1[0].tolist() == [0.0, 1.0, 0.0, 0.0]  # a tie: the earlier sample
    assert w1[1].tolist() == [0.0, 0.0, 1.0, 0.0]
    w3 = group_weights(rewards, "top_k", top_k=3)
    assert w3[1].tolist() == [0.0, 0.5, 0.5, 0.0]  # fewer valid than k: all valid ones


def test_rwr_is_a_softmax_over_the_valid_samples():
    rewards = torch.tensor([[0.1, 0.9, NAN, 0.4], [NAN, NAN, NAN, NAN]])
    w = group_weights(rewards, "rwr", temperature=0.5)
    z = [math.exp(0.1 / 0.5), math.exp(0.9 / 0.5), 0.0, math.exp(0.4 / 0.5)]
    assert w[0].tolist() == pytest.approx([x / sum(z) for x in z], rel=1e-6)
    assert w[1].tolist() == [0.0] * 4


def test_weighted_matching_loss_is_the_weighted_mean(monkeypatch):
    """SFTMethod.term_loss numerators / the mini-batch normaliser = sum w_i err_i / sum w_i, err in float64."""
    from flowgrpo.t2i.awm import Term
    from flowgrpo.t2i.sft import SFTMethod

    g = torch.Generator().manual_seed(1)
    v, eps, x0 = (torch.randn(3, 2, 3, 3, generator=g) for _ in range(3))
    w = torch.tensor([0.5, 0.5, 0.0])
    term = Term(torch.arange(3), torch.full((3,), 0.4), eps)
    per, metrics = SFTMethod.term_loss(None, v, term, x0, w)  # type: ignore[arg-type]  # uses no state
    errs = []
    for i in range(3):
        d = [
            (float(a) - (float(b) - float(c))) ** 2
            for a, b, c in zip(v[i].flatten(), eps[i].flatten(), x0[i].flatten())
        ]
        errs.append(sum(d) / len(d))
    assert (per.sum() / w.sum()).item() == pytest.approx((0.5 * errs[0] + 0.5 * errs[1]) / 1.0, rel=1e-12)
    assert metrics["sft/matching_loss"] == pytest.approx(sum(errs) / 3, rel=1e-12)


def test_one_iteration_trains_only_the_kept_samples(recipe_config):
    from flowgrpo.t2i import train_t2i

    cfg = recipe_config("sft_best_of_n", "iterations=1", "group_size=4", "artifacts.grid_every=0")
    (r,) = train_t2i(cfg)
    kept = cfg.prompts_per_iteration * cfg.sft.top_k
    assert r["sft/samples"] == kept and r["sft/kept_fraction"] == kept / (cfg.prompts_per_iteration * cfg.group_size)
    assert r["nfe_grad"] == kept * cfg.sft.timesteps and r["nfe_nograd"] == r["rollout_nfe_nograd"]
    assert r["backward_passes"] == cfg.sft.timesteps and r["optimizer_steps"] == 1
    assert r["sft/kept_reward_mean"] >= r["reward_mean"]


def test_max_keeps_every_sample_tied_at_the_maximum():
    """flow_grpo's type 'sft': (rewards == max(rewards)) per group, so ties are all kept."""
    rewards = torch.tensor([[1.0, 0.0, 1.0, 1.0], [0.5, NAN, 0.25, 0.0], [0.0, 0.0, 0.0, 0.0]])
    w = group_weights(rewards, "max").reshape(-1)
    assert w.tolist() == pytest.approx([1 / 3, 0.0, 1 / 3, 1 / 3] + [1.0, 0.0, 0.0, 0.0] + [0.25] * 4, rel=1e-6)


def test_samples_normalization_is_flow_grpo_plain_batch_mean():
    """normalize: samples -> sum_kept coef_i err_i / sum_kept norm_i = mean over all scored samples of a_i err_i,
    a_i = 1 on the group maximum (train_sd3_sft.py: torch.mean(advantages * (v - target)^2))."""
    from flowgrpo.t2i.sft import samples_normalized

    rewards = torch.tensor([[1.0, 0.0, 1.0, 0.5], [0.2, 0.7, 0.1, 0.3]], dtype=torch.float64)
    err = torch.tensor([0.3, 0.9, 0.5, 0.2, 0.4, 0.8, 0.6, 0.1], dtype=torch.float64)
    coef, norm = samples_normalized(group_weights(rewards, "max"), torch.isfinite(rewards), "max")
    kept = norm > 0
    ours = (coef.double()[kept] * err[kept]).sum() / norm.double()[kept].sum()
    a = (rewards == rewards.max(1, keepdim=True).values).double().reshape(-1)  # flow_grpo's advantages
    assert float(ours) == pytest.approx(float((a * err).mean()), rel=1e-12)
    assert coef[kept].tolist() == [1.0, 1.0, 1.0]
    rwr, _ = samples_normalized(group_weights(rewards.float(), "rwr"), torch.isfinite(rewards), "rwr")
    assert float(rwr.view(2, 4).mean(1)[0]) == pytest.approx(1.0, rel=1e-6)  # rwr: mean coefficient 1 per group


def test_sample_with_reference_needs_the_reference():
    from flowgrpo.t2i.sft import SFTMethod

    class Cfg:
        sft = type("S", (), {"kl_coef": 0.0, "sample_with": "reference"})()

    assert SFTMethod.needs_reference(Cfg())
    Cfg.sft.sample_with = "policy"
    assert not SFTMethod.needs_reference(Cfg())
