"""Diffusion-DPO (flowgrpo/t2i/dpo.py, pair_data.py): the loss against a float64 re-derivation, the pairs, the
offline file's errors, one iteration's counts online and offline; the learning runs (heavy)."""

import json
import math
from pathlib import Path

import pytest
import torch

from flowgrpo.config import ConfigError
from flowgrpo.t2i.dpo import DPOConfig, draw_sigmas, dpo_loss, preference_pairs, velocity_error
from flowgrpo.t2i.pair_data import load_pairs, read_image


NAN = float("nan")
PAIRS = Path(__file__).resolve().parents[2] / "configs" / "t2i" / "tiny" / "data" / "dpo_pairs" / "pairs.jsonl"


def test_dpo_loss_matches_a_float64_rederivation():
    g = torch.Generator().manual_seed(3)
    v, v_ref, eps, x0 = (torch.randn(4, 2, 3, 3, generator=g) for _ in range(4))
    err, ref = velocity_error(v, eps, x0), velocity_error(v_ref, eps, x0)
    beta = 7.5
    per, inside = dpo_loss(err[:2], err[2:], ref[:2], ref[2:], beta)

    def mse(a, e, x):
        d = [(float(p) - (float(q) - float(r))) ** 2 for p, q, r in zip(a.flatten(), e.flatten(), x.flatten())]
        return sum(d) / len(d)

    for k in range(2):
        w, lo = k, k + 2
        ew, el = mse(v[w], eps[w], x0[w]), mse(v[lo], eps[lo], x0[lo])
        rw, rl = mse(v_ref[w], eps[w], x0[w]), mse(v_ref[lo], eps[lo], x0[lo])
        z = -beta / 2 * ((ew - rw) - (el - rl))
        assert float(inside[k]) == pytest.approx(z, rel=1e-4, abs=1e-5)
        assert float(per[k].detach()) == pytest.approx(math.log1p(math.exp(-z)), rel=1e-4, abs=1e-5)


def test_the_gradient_lowers_the_chosen_error_and_raises_the_rejected_one():
    err = torch.tensor([1.0, 1.0], requires_grad=True)
    per, _ = dpo_loss(err[:1], err[1:], torch.ones(1), torch.ones(1), beta=10.0)
    per.sum().backward()
    assert err.grad[0] > 0 > err.grad[1]  # descent: err_w down, err_l up
    assert float(err.grad[0]) == pytest.approx(10.0 / 2 * 0.5)  # sigmoid(0) = 1/2


def test_the_sft_term_adds_the_chosen_error_and_its_gradient_in_float64():
    """RPO's term (dpo.sft_coef): L = -log sigmoid(z) + c err_w, z = -beta/2 ((err_w - ref_w) - (err_l - ref_l));
    dL/derr_w = beta/2 sigmoid(-z) + c, dL/derr_l = -beta/2 sigmoid(-z), no gradient to the reference."""
    beta, c = 7.5, 0.3
    e = torch.tensor([[1.3, 0.9], [1.1, 1.4]], dtype=torch.float64, requires_grad=True)  # rows: err_w, err_l
    ref = torch.tensor([[1.2, 1.0], [1.0, 1.5]], dtype=torch.float64, requires_grad=True)
    per, inside = dpo_loss(e[0], e[1], ref[0], ref[1], beta, sft_coef=c)
    base, _ = dpo_loss(e[0], e[1], ref[0], ref[1], beta)
    assert per.dtype == torch.float64
    per.sum().backward()
    (ews, els), (rws, rls) = e.detach().tolist(), ref.detach().tolist()
    for k, (ew, el, rw, rl) in enumerate(zip(ews, els, rws, rls)):
        z = -beta / 2 * ((ew - rw) - (el - rl))
        s_neg = 1 / (1 + math.exp(z))  # sigmoid(-z)
        assert float(inside[k]) == pytest.approx(z, rel=1e-12)
        assert float(per[k].detach()) == pytest.approx(math.log1p(math.exp(-z)) + c * ew, rel=1e-12)
        assert float((per[k] - base[k]).detach()) == pytest.approx(c * ew, rel=1e-12)  # sft_coef 0: the published loss
        assert float(e.grad[0, k]) == pytest.approx(beta / 2 * s_neg + c, rel=1e-12)
        assert float(e.grad[1, k]) == pytest.approx(-beta / 2 * s_neg, rel=1e-12)
    assert ref.grad is None or not bool(ref.grad.any())


def test_pairs_best_worst_and_margin():
    r = torch.tensor([[0.1, 0.9, 0.5, 0.9], [0.3, 0.3, 0.3, 0.3], [NAN, 0.2, NAN, 0.4], [NAN, 0.2, NAN, NAN]])
    assert preference_pairs(r, "best_worst").tolist() == [[1, 0], [11, 9]]  # tie at the top: the earlier
    m = preference_pairs(r, "margin", margin=0.35).tolist()
    assert m == [[1, 0], [1, 2], [2, 0], [3, 0], [3, 2]]  # 0.9 - 0.5 = 0.4 > 0.35; group 2: 0.2 apart, none
    assert preference_pairs(r[3:], "best_worst").shape == (0, 2)  # one scored sample: no pair


def test_sigmas_are_flow_grpo_logit_normal_indices_shifted():
    s = DPOConfig(time_shift=3.0)
    sig = draw_sigmas(torch.Generator().manual_seed(0), 20000, s)
    assert 0 < float(sig.min()) and float(sig.max()) <= 1.0
    # u ~ logit-normal(0, 1) is symmetric: median t = 1/2, shifted to 3 * 0.5 / (1 + 2 * 0.5) = 0.75
    assert float(sig.median()) == pytest.approx(0.75, abs=0.01)
    plain = draw_sigmas(torch.Generator().manual_seed(0), 20000, DPOConfig(time_shift=1.0))
    assert float(plain.median()) == pytest.approx(0.5, abs=0.01)


def test_offline_file_errors_name_file_and_line(tmp_path):
    good = tmp_path / "a.png"
    good.write_bytes((PAIRS.parent / "0_chosen.png").read_bytes())
    bad = tmp_path / "b.png"
    bad.write_bytes(b"not a png")
    f = tmp_path / "pairs.jsonl"
    f.write_text(json.dumps({"prompt": "x", "chosen": "a.png", "rejected": "a.png"}) + "\n\n"
                 + json.dumps({"prompt": "x", "chosen": "a.png", "rejected": "missing.png"}) + "\n")  # fmt: skip
    with pytest.raises(ConfigError, match=r"pairs\.jsonl:3: rejected image 'missing\.png' not found"):
        load_pairs(f)
    f.write_text('{"prompt": "x", "chosen": "a.png"}\n')
    with pytest.raises(ConfigError, match=r"pairs\.jsonl:1: needs non-empty string fields"):
        load_pairs(f)
    f.write_text(json.dumps({"prompt": "x", "chosen": "a.png", "rejected": "b.png"}) + "\n")
    (pair,) = load_pairs(f)
    assert pair.chosen == good and pair.where.endswith("pairs.jsonl:1")
    with pytest.raises(ConfigError, match=r"pairs\.jsonl:1: cannot read image '.*b\.png'"):
        read_image(pair.rejected, pair.where, 32, 32)
    assert read_image(pair.chosen, pair.where, 16, 16).shape == (3, 16, 16)


def test_one_online_iteration_counts_its_model_calls(recipe_config):
    from flowgrpo.t2i import train_t2i

    cfg = recipe_config("diffusion_dpo_online", "iterations=1", "group_size=4", "artifacts.grid_every=0")
    (r,) = train_t2i(cfg)
    pairs, T = r["dpo/pairs"], cfg.dpo.timesteps
    assert pairs == cfg.prompts_per_iteration  # best vs worst of each group (the tiny rewards never tie)
    assert r["nfe_grad"] == 2 * pairs * T  # chosen + rejected, with gradient
    assert r["nfe_nograd"] == r["rollout_nfe_nograd"] + 2 * pairs * T  # + the reference's
    assert r["backward_passes"] == T and r["optimizer_steps"] == 1
    assert r["dpo/reward_gap"] > 0 and r["loss/policy"] == pytest.approx(math.log(2), abs=1e-3)  # theta = ref


def test_one_offline_iteration_trains_the_dataset_pairs(recipe_config):
    from flowgrpo.t2i import train_t2i

    cfg = recipe_config("diffusion_dpo_offline", "iterations=1", "artifacts.grid_every=0")
    (r,) = train_t2i(cfg)
    assert r["dpo/pairs"] == cfg.dpo.pairs_per_iteration and "dpo/reward_gap" not in r
    assert r["nfe_grad"] == 2 * 8 * cfg.dpo.timesteps
    assert r["nfe_nograd"] == r["rollout_nfe_nograd"] + 2 * 8 * cfg.dpo.timesteps
    assert r["backward_passes"] == cfg.train.mini_batches * cfg.dpo.timesteps  # 8 pairs fit one micro-batch
