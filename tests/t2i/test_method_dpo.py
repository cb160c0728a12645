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
    # flow_grpo's stat_tracking.py on an all-tied group: max_idx 1 chosen, min_idx 0 rejected (first two scored)
    assert preference_pairs(r, "best_worst", tied="first_two").tolist() == [[1, 0], [5, 4], [11, 9]]
    assert preference_pairs(r[3:], "best_worst", tied="first_two").shape == (0, 2)


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


def test_noise_prediction_form_is_diffusers_add_noise_with_the_noise_as_target():
    """sd15: x_t = DDPMScheduler.add_noise(x0, eps, t) (DiffusionDPO's), the target eps; flow: (1 - t) x0 + t eps."""
    from diffusers import DDPMScheduler

    from flowgrpo.t2i.dpo import noised

    sched = DDPMScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear")
    g = torch.Generator().manual_seed(0)
    x0, eps = torch.randn(3, 4, 2, 2, generator=g), torch.randn(3, 4, 2, 2, generator=g)
    t = torch.tensor([0.0, 499.0, 999.0])
    x_t, target = noised(x0, eps, t, sched.alphas_cumprod)
    assert torch.allclose(x_t, sched.add_noise(x0, eps, t.long()), atol=1e-6) and torch.equal(target, eps)
    x_f, target_f = noised(x0, eps, torch.tensor([0.0, 0.5, 1.0]), None)
    assert torch.equal(x_f[0], x0[0]) and torch.equal(x_f[2], eps[2]) and torch.equal(target_f, eps - x0)


def test_noise_prediction_timesteps_uniform_is_randint_over_the_training_grid():
    g = torch.Generator().manual_seed(0)
    from flowgrpo.t2i.dpo import draw_timesteps

    t = draw_timesteps(g, 50000, DPOConfig(time_sampling="uniform"), 1000)
    assert torch.equal(t, t.round()) and int(t.min()) == 0 and int(t.max()) == 999
    assert float(t.mean()) == pytest.approx(499.5, abs=5)  # uniform over {0, ..., 999}
    assert torch.bincount(t.long(), minlength=1000).min() > 0


def test_empty_prompt_fraction_needs_offline_pairs():
    with pytest.raises(ValueError, match=r"dpo.empty_prompt_fraction 0.2 applies to offline pairs"):
        DPOConfig(empty_prompt_fraction=0.2)
    assert DPOConfig(empty_prompt_fraction=0.2, data="pairs.jsonl").empty_prompt_fraction == 0.2


def test_sd15_offline_iteration_noise_prediction_form_encoded_per_iteration(recipe_config, monkeypatch):
    """DiffusionDPO's shape on the tiny sd15: eps form, pairs VAE-encoded when drawn, prompts dropped to "";
    at theta = ref every pair-term's loss is log 2."""
    from flowgrpo.t2i import pair_data, train_t2i
    from flowgrpo.t2i import dpo as dpo_module

    encoded: list[int] = []
    real_encode = pair_data.encode_pairs
    monkeypatch.setattr(pair_data, "encode_pairs", lambda a, p, h, w: encoded.append(len(p)) or real_encode(a, p, h, w))
    seen: list[str] = []
    real_noised = dpo_module.noised
    monkeypatch.setattr(
        dpo_module,
        "noised",
        lambda x0, e, t, a: seen.append("eps" if a is not None else "flow") or real_noised(x0, e, t, a),
    )
    cfg = recipe_config(
        "diffusion_dpo_offline", "model.family=sd15", "iterations=1", "artifacts.grid_every=0", "group_size=2",
        "sampler.num_steps=2", "dpo.encode=per_iteration", "dpo.empty_prompt_fraction=0.5", "dpo.sft_coef=0",
        "dpo.time_sampling=uniform", "dpo.pairs_per_iteration=3", "dpo.timesteps=1", "train.mini_batches=1",
    )  # fmt: skip
    (r,) = train_t2i(cfg)
    assert encoded == [3] and r["dpo/pairs"] == 3  # this iteration's 3 pairs, not the file's 4
    assert seen and set(seen) == {"eps"}
    assert r["nfe_grad"] == 2 * 3 and r["loss/policy"] == pytest.approx(math.log(2), abs=1e-4)


def test_pickapic_rows_convert_to_pairs_the_loader_reads(tmp_path):
    """scripts/pickapic_to_pairs.py on fake Pick-a-Pic rows: no-decision rows dropped, label_0 = 0 swaps the sides."""
    import base64
    import importlib.util
    import io

    from PIL import Image

    spec = importlib.util.spec_from_file_location(
        "pickapic_to_pairs", Path(__file__).resolve().parents[2] / "scripts" / "pickapic_to_pairs.py"
    )
    assert spec is not None and spec.loader is not None
    conv = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(conv)

    def png(value: int) -> str:
        buf = io.BytesIO()
        Image.new("RGB", (8, 8), (value, value, value)).save(buf, format="PNG")
        return base64.b64encode(buf.getvalue()).decode()

    rows = [
        {"caption": "bright first", "jpg_0": png(250), "jpg_1": png(10), "label_0": 1},
        {"caption": "a tie", "jpg_0": png(250), "jpg_1": png(10), "label_0": 0.5},
        {"caption": "bright second", "jpg_0": png(10), "jpg_1": png(250), "label_0": 0},
    ]
    src = tmp_path / "rows.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    counts = conv.convert([src], tmp_path / "out")
    assert counts == {"pairs": 2, "no_decision": 1}
    pairs = load_pairs(tmp_path / "out" / "pairs.jsonl")
    assert [p.prompt for p in pairs] == ["bright first", "bright second"]
    for p in pairs:  # the preferred (bright) image is the chosen one
        assert (
            float(read_image(p.chosen, p.where, 8, 8).mean())
            > 0.9
            > 0.1
            > float(read_image(p.rejected, p.where, 8, 8).mean())
        )
    src.write_text(json.dumps({"caption": "x", "jpg_0": png(1), "label_0": 1}) + "\n", encoding="utf-8")
    with pytest.raises(SystemExit, match=r"rows\.jsonl:1: missing column\(s\) \['jpg_1'\]"):
        conv.convert([src], tmp_path / "bad")
