"""Direct reward back-propagation (flowgrpo/t2i/reward_backprop.py): the window's gradient against a float64
re-derivation, truncation, checkpointing, the scorer check, one tiny iteration's counts per form; the learning runs
(heavy)."""

import statistics
from pathlib import Path

import pytest
import torch

from flowgrpo.config import load_config
from flowgrpo.t2i import train_t2i
from flowgrpo.t2i.config import DEFAULTS, T2IConfig
from flowgrpo.t2i.reward_backprop import (
    RewardBackpropConfig,
    check_differentiable,
    denoise,
    expected_grad_steps,
    grad_rows,
    grad_window,
    renoise,
    reward_loss,
)
from pipelines.schedules import flow_schedule
from reward_models import build_scorer

from .learning_runs import RECIPES_DIR, WATCH


def _load(recipe: str, out: Path, *overrides: str):
    """A tiny recipe's config."""
    quiet = [
        "progress=false",
        "artifacts.tensorboard=false",
        "artifacts.plot=false",
        "checkpoint.save_final_model=false",
    ]
    return load_config(
        T2IConfig, RECIPES_DIR / f"{recipe}.yaml", [f"output_dir={out}", *quiet, *overrides], defaults=DEFAULTS
    )


def _schedule(T=6):
    return flow_schedule(T, shift=3.0, config={"shift": 3.0})


def _sigmas(sched):
    return [float(s) for s in sched.sigmas.double()]


# --- the formulas ----------------------------------------------------------------------------------


def test_grad_windows_per_form():
    g = torch.Generator().manual_seed(0)
    assert grad_window(RewardBackpropConfig(form="draft_k", k=2), 6, g) == (4, 2, False)
    refl = [grad_window(RewardBackpropConfig(form="refl"), 40, g) for _ in range(200)]
    assert {t for t, _, _ in refl} == set(range(30, 40)) and all(n == 1 and x0 for _, n, x0 in refl)  # ReFL's 30..39
    ks = [grad_window(RewardBackpropConfig(form="alignprop", truncation=(2, 4)), 6, g) for _ in range(100)]
    assert {k for _, k, _ in ks} == {2, 3, 4} and all(start == 6 - k for start, k, _ in ks)
    assert expected_grad_steps(RewardBackpropConfig(form="alignprop"), 6) == 3.5  # K ~ U{1..6}
    lv = RewardBackpropConfig(form="draft_lv")
    assert grad_window(lv, 6, g) == (5, 1, False) and lv.lv_samples == 2  # the last step, the paper's n = 2 draws
    assert expected_grad_steps(lv, 6) == 2.0
    with pytest.raises(ValueError, match="lv_samples"):
        RewardBackpropConfig(form="draft_lv", lv_samples=0)
    with pytest.raises(ValueError, match="k 7 exceeds sampler.num_steps 6"):
        grad_window(RewardBackpropConfig(form="draft_k", k=7), 6, g)
    with pytest.raises(ValueError, match=r"truncation: K >= 1"):
        RewardBackpropConfig(truncation=(0, 3))


def test_reward_loss_forms():
    R = torch.tensor([0.5, 2.5, -1.0])
    assert reward_loss(R, None, 0.1).tolist() == pytest.approx([-0.05, -0.25, 0.1], rel=1e-12)
    assert reward_loss(R, 2.0, 1e-3).tolist() == pytest.approx([1.5e-3, 0.0, 3e-3], rel=1e-12)  # ReFL relu(2 - r)


def _linear_velocity(w, c):
    """v(x, s_i) = w s_i x + c: the Euler step is affine in x, so the chain rule is short to write out."""
    sched = _schedule()
    sig = sched.sigmas

    def velocity(x, i):
        return w * sig[i] * x + c

    return sched, velocity


@pytest.mark.parametrize("k", [1, 3])
def test_draft_k_gradient_matches_a_float64_derivation(k):
    """R = mean(x_T) after K Euler steps with grad: dR/dw from the product rule over the steps, in float64."""
    x0 = torch.tensor([[0.3, -1.2], [0.7, 2.0]]).view(1, 1, 2, 2)
    w = torch.tensor(0.4, requires_grad=True)
    c = 0.25
    sched, velocity = _linear_velocity(w, c)
    T = 6
    out = denoise(velocity, x0, T - k, k, sched, use_checkpoint=False)
    (g,) = torch.autograd.grad(out.mean(), w)
    s = _sigmas(sched)
    wf = 0.4
    # x_{i+1} = a_i x_i - d_i c with a_i = 1 - d_i w s_i: track (x, dx/dw) per element, float64
    xs = [(float(v), 0.0) for v in x0.flatten()]
    for i in range(T - k, T):
        d = s[i] - s[i + 1]
        a, da = 1 - d * wf * s[i], -d * s[i]
        xs = [(a * x - d * c, a * dx + da * x) for x, dx in xs]
    assert float(out.detach().mean()) == pytest.approx(sum(x for x, _ in xs) / 4, rel=1e-6)
    assert float(g) == pytest.approx(sum(dx for _, dx in xs) / 4, rel=1e-5)


def test_refl_gradient_is_the_one_step_x0_prediction():
    """ReFL: x0 = x_t - s_t v(x_t) = x_t (1 - w s_t^2) - s_t c, so dR/dw = -s_t^2 mean(x_t)."""
    x_t = torch.tensor([0.5, -0.1, 1.5, 0.2]).view(1, 1, 2, 2)
    w = torch.tensor(-0.3, requires_grad=True)
    sched, velocity = _linear_velocity(w, 0.1)
    out = denoise(velocity, x_t, 4, 1, sched, predict_x0=True, use_checkpoint=False)
    (g,) = torch.autograd.grad(out.mean(), w)
    s = _sigmas(sched)[4]
    mean_x = sum(float(v) for v in x_t.flatten()) / 4
    assert float(out.detach().mean()) == pytest.approx(mean_x * (1 + 0.3 * s * s) - s * 0.1, rel=1e-6)
    assert float(g) == pytest.approx(-s * s * mean_x, rel=1e-5)


def test_draft_lv_gradient_matches_a_float64_derivation():
    """DRaFT-LV: x_t^j = (1 - s) x_T + s eps_j at the last step's sigma s, one Euler step to s' with grad:
    out_j = x_t^j - (s - s') (w s x_t^j + c), so d sum_j mean(out_j) / dw = -(s - s') s sum_j mean(x_t^j); the
    final sample x_T is a constant (stop_grad)."""
    x_T = torch.tensor([0.4, -0.9, 1.1, 0.3]).view(1, 1, 2, 2).requires_grad_(True)
    eps = torch.randn(2, 1, 1, 2, 2, generator=torch.Generator().manual_seed(3))
    w = torch.tensor(0.6, requires_grad=True)
    sched, velocity = _linear_velocity(w, 0.2)
    R = sum(denoise(velocity, renoise(x_T, sched, 5, e), 5, 1, sched, use_checkpoint=False).mean() for e in eps)
    g, g_x = torch.autograd.grad(R, [w, x_T], allow_unused=True)
    assert g_x is None  # no gradient into the no-grad sample
    s, s_next = _sigmas(sched)[5:7]
    x_t = [
        [(1 - s) * float(a) + s * float(b) for a, b in zip(x_T.detach().flatten(), e.flatten())] for e in eps.double()
    ]
    assert float(R.detach()) == pytest.approx(
        sum(sum(x * (1 - (s - s_next) * 0.6 * s) - (s - s_next) * 0.2 for x in xs) / 4 for xs in x_t), rel=1e-6
    )
    assert float(g) == pytest.approx(-(s - s_next) * s * sum(sum(xs) / 4 for xs in x_t), rel=1e-5)


def test_draft_lv_on_a_ddim_grid_renoises_with_alpha_bar():
    """An epsilon model: x_t = sqrt(ab) x + sqrt(1 - ab) eps, then DDIM (eta 0) to ab' with eps_hat = w x_t + c:
    out = sqrt(ab') (x_t - b eps_hat) / a + sqrt(1 - ab') eps_hat, d mean(out) / dw = (sqrt(1 - ab') - sqrt(ab') b /
    a) mean(x_t), a = sqrt(ab), b = sqrt(1 - ab)."""
    import math

    from pipelines.schedules import ddim_schedule

    sched = ddim_schedule(6)
    x, e = torch.tensor([0.5, -0.1, 1.5, 0.2]).view(1, 1, 2, 2), torch.tensor([1.0, -2.0, 0.5, 0.0]).view(1, 1, 2, 2)
    w = torch.tensor(0.2, requires_grad=True)
    x_t = renoise(x, sched, 5, e)
    ab, ab_prev = float(sched.alpha_bar.double()[5]), float(sched.alpha_bar_prev.double()[5])
    a, b = math.sqrt(ab), math.sqrt(1 - ab)
    mean_xt = sum(a * float(u) + b * float(v) for u, v in zip(x.flatten(), e.flatten())) / 4
    assert float(x_t.mean()) == pytest.approx(mean_xt, rel=1e-6)
    out = denoise(lambda x, i: w * x + 0.1, x_t, 5, 1, sched, False, False, "ddim", {"eta": 0.0})
    (g,) = torch.autograd.grad(out.mean(), w)
    assert float(g) == pytest.approx((math.sqrt(1 - ab_prev) - math.sqrt(ab_prev) * b / a) * mean_xt, rel=1e-5)


def test_truncation_keeps_the_gradient_inside_the_window():
    """A parameter per step: only the window's steps are called with grad, and only their parameters get one."""
    sched = _schedule()
    ws = [torch.tensor(0.1 * (i + 1), requires_grad=True) for i in range(6)]
    calls = []

    def velocity(x, i):
        calls.append(i)
        return ws[i] * x

    x = torch.randn(2, 1, 2, 2, generator=torch.Generator().manual_seed(1))
    denoise(velocity, x, 4, 2, sched, use_checkpoint=False).sum().backward()
    assert calls == [4, 5]
    assert [w.grad is not None and float(w.grad) != 0 for w in ws] == [False] * 4 + [True] * 2


def test_checkpointing_gives_the_same_gradient_with_less_saved(saved_for_backward):
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Conv2d(4, 32, 3, padding=1), torch.nn.SiLU(), torch.nn.Conv2d(32, 4, 3, padding=1)
    )
    sched = _schedule()
    x = torch.randn(3, 4, 8, 8, generator=torch.Generator().manual_seed(2))

    def velocity(x, i):
        return net(x) * sched.sigmas[i]

    grads, saved = [], []
    for use in (False, True):
        net.zero_grad()
        size, out = saved_for_backward(lambda use=use: denoise(velocity, x, 2, 4, sched, use_checkpoint=use))
        out.square().mean().backward()
        grads.append([p.grad.clone() for p in net.parameters()])
        saved.append(size)
    for a, b in zip(*grads):
        assert torch.allclose(a, b, rtol=1e-6, atol=1e-9)
    assert saved[1] < saved[0] / 4, saved  # a checkpointed step keeps its input latent, not the activations


def test_a_non_differentiable_scorer_is_named():
    jpeg, bright = build_scorer({"name": "jpeg_compressibility"}), build_scorer({"name": "brightness"})
    check_differentiable([("brightness", 1.0, bright), ("jpeg_compressibility", 0.0, jpeg)])  # weight 0: not scored
    with pytest.raises(ValueError, match="scorer 'jpeg_compressibility' is not differentiable.*brightness"):
        check_differentiable([("brightness", 1.0, bright), ("jpeg_compressibility", 0.5, jpeg)])


def test_ddim_window_of_an_epsilon_model_matches_a_float64_derivation():
    """SD1.5's kernel (DDIM, eta 0): x0 = (x - sqrt(1 - ab) eps) / sqrt(ab) with eps = w x + c, so
    dx0/dw = -sqrt(1 - ab) x / sqrt(ab); the window's last step predicts it (ReFL on an epsilon model)."""
    import math

    from pipelines.schedules import ddim_schedule

    sched = ddim_schedule(6)
    x_t = torch.tensor([0.5, -0.1, 1.5, 0.2]).view(1, 1, 2, 2)
    w = torch.tensor(0.2, requires_grad=True)
    out = denoise(lambda x, i: w * x + 0.1, x_t, 3, 1, sched, True, False, "ddim", {"eta": 0.0})
    (g,) = torch.autograd.grad(out.mean(), w)
    ab = float(sched.alpha_bar.double()[3])
    mean_x = sum(float(v) for v in x_t.flatten()) / 4
    a, b = math.sqrt(ab), math.sqrt(1 - ab)
    assert float(out.detach().mean()) == pytest.approx((mean_x * (1 - b * 0.2) - b * 0.1) / a, rel=1e-5)
    assert float(g) == pytest.approx(-b * mean_x / a, rel=1e-5)


# --- the plug-in on the tiny SD3 -------------------------------------------------------------------


@pytest.mark.parametrize(
    "form, overrides",
    [
        ("draft_k", ["reward_backprop.k=2"]),
        # an epsilon model: the DDIM window (heavy: building the tiny SD1.5 costs ~10 s of CPU)
        pytest.param("draft_k", ["reward_backprop.k=2", "model.family=sd15"], marks=pytest.mark.heavy),
        ("refl", []),
        ("alignprop", []),
        ("draft_lv", []),
        pytest.param("draft_lv", ["model.family=sd15"], marks=pytest.mark.heavy),  # the DDIM re-noising
    ],
    ids=["draft_k", "draft_k_sd15", "refl", "alignprop", "draft_lv", "draft_lv_sd15"],
)
def test_one_iteration_counts_and_is_on_policy(tmp_path, form, overrides):
    cfg = _load(form, tmp_path / "run", "iterations=1", "group_size=4", "train.micro_batch_size=3", *overrides)
    (r,) = train_t2i(cfg)
    n, T = cfg.prompts_per_iteration * cfg.group_size, cfg.sampler.num_steps
    assert r["reward_backprop/samples"] == n and r["backward_passes"] == 3 and r["optimizer_steps"] == 1
    assert r["nfe_nograd"] == r["rollout_nfe_nograd"] == n * T  # the rollout is the no-grad prefix: no re-run
    assert r["nfe_grad"] == grad_rows(cfg, 0, n)  # the windows drawn for the three micro-batches, replayed
    if form != "alignprop":  # a fixed window: K rows per image (draft_lv: one per noise draw)
        K = {"draft_k": 2, "refl": 1, "draft_lv": 2}[form]
        assert r["nfe_grad"] == n * expected_grad_steps(cfg.reward_backprop, T) == n * K
    assert r["reward_backprop/recompute_rows"] == r["nfe_grad"]  # checkpointing: each window call again in backward
    draws = cfg.reward_backprop.lv_samples if form == "draft_lv" else 1
    assert r["reward_calls"] == 2 + 3 * draws  # the rollout's two batches, then each grad pass of each micro-batch
    assert r["grad_norm"] > 0
    if form == "draft_k":  # the window re-runs the rollout's last steps under the same weights: the same images
        assert r["reward_backprop/reward_mean"] == pytest.approx(r["rewards/brightness/mean"], abs=1e-5)


def test_a_non_differentiable_reward_fails_before_training(tmp_path):
    cfg = _load(
        "draft_k", tmp_path / "run", "iterations=1", "rewards=[{name: brightness}, {name: jpeg_compressibility}]"
    )
    with pytest.raises(ValueError, match="'jpeg_compressibility' is not differentiable"):
        train_t2i(cfg)


def test_config_rules(tmp_path):
    with pytest.raises(ValueError, match="set plan \\{name: ode_only\\}"):
        _load("draft_k", tmp_path / "a", "plan={name: full_sde}")
    with pytest.raises(ValueError, match="refl_steps \\[2, 6\\]: steps lie in \\[0, 5\\]"):
        _load("refl", tmp_path / "b", "reward_backprop.refl_steps=[2, 6]")


# --- learning (heavy) ------------------------------------------------------------------------------


def _margin(recipe: str, tmp: Path, iterations: int = 8, last: int = 3) -> dict[str, float]:
    runs = {}
    for name, extra in (("learn", []), ("still", ["optim.lr=0"])):
        cfg = _load(recipe, tmp / name, f"iterations={iterations}", *extra)
        runs[name] = [r[WATCH] for r in train_t2i(cfg)]
    learn, still = runs["learn"], runs["still"]
    gain = statistics.fmean(learn[-last:]) - statistics.fmean(still[-last:])
    return {"gain": gain, "noise": statistics.pstdev(still) / last**0.5, "first": learn[0] - still[0]}


@pytest.mark.heavy
@pytest.mark.parametrize("recipe", ["draft_k", "refl", "alignprop", "draft_lv"])
def test_reward_backprop_learns(tmp_path, recipe):
    m = _margin(recipe, tmp_path)
    assert m["first"] == pytest.approx(0.0, abs=1e-7), m
    assert m["gain"] > 5.0 * m["noise"] and m["gain"] > 0, m
