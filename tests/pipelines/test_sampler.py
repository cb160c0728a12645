"""Sampler: every plan x kernel re-scores to ratio 1, log-probs match an independent Gaussian density,
forward-pass counts match their closed forms, and bad input is rejected."""

import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from toy_adapter import ToyAdapter  # noqa: E402

from pipelines.plans import build_plan  # noqa: E402
from pipelines.sampler import Sampler, SamplerConfig  # noqa: E402

PROMPTS = ["a cat", "a red dog"]
PLANS = [
    ("full_sde", {}, 3),
    ("window", {"size": 2}, 3),
    ("tree", {"split_steps": (0, 2)}, 4),
    ("branch_points", {"k": 3, "points": [1, 4]}, 1),
    ("probes", {}, 2),
    ("probes", {"one_step": True}, 2),
]
FLOW_KERNELS = [("flow_sde", {"a": 0.7}), ("dance_sde", {"eta": 0.3}), ("cps", {"a": 0.7})]


def _run(adapter, plan_name, settings, group, kernel=("flow_sde", {}), T=6, **cfg):
    sampler = Sampler(SamplerConfig(num_steps=T, sde_kernel={"name": kernel[0], **kernel[1]}, **cfg))
    plan = build_plan(plan_name, T, **settings)
    return sampler, sampler.run(adapter, PROMPTS, plan, group, torch.Generator().manual_seed(0))


def _gaussian_logp(x, mean, std):
    """Independent density: log N(x; mean, std^2), mean over latent dims, with math.log."""
    per_dim = -((x.double() - mean.double()) ** 2) / (2 * std**2) - math.log(std) - 0.5 * math.log(2 * math.pi)
    return per_dim.flatten(1).mean(1)


@pytest.mark.parametrize("kernel", FLOW_KERNELS, ids=[k[0] for k in FLOW_KERNELS])
@pytest.mark.parametrize(
    "plan_name,settings,group", PLANS, ids=[f"{p[0]}{'-1step' if p[1].get('one_step') else ''}" for p in PLANS]
)
def test_on_policy_ratio_is_one_for_every_plan_and_kernel(plan_name, settings, group, kernel):
    adapter = ToyAdapter()
    sampler, tree = _run(adapter, plan_name, settings, group, kernel, keep_means=True)
    edges = tree.trained_edges()
    assert edges.numel() > 0
    out = sampler.rescore(adapter, tree, edges, PROMPTS)
    assert torch.allclose(out.logp, tree.edge_logp[edges], atol=1e-6, rtol=0)
    assert torch.allclose(out.mean, tree.edge_mean[edges], atol=1e-6)
    if kernel[0] != "cps":  # cps publishes a constant-free surrogate, not a density
        for e in edges[:4].tolist():
            want = _gaussian_logp(tree.states[e : e + 1], tree.edge_mean[e : e + 1], float(tree.edge_std[e]))
            assert abs(float(want) - float(tree.edge_logp[e])) < 1e-4


def test_ddim_epsilon_model_ratio_one():
    adapter = ToyAdapter("epsilon")
    sampler, tree = _run(adapter, "full_sde", {}, 2, ("ddim", {"eta": 1.0}))
    edges = tree.trained_edges()
    assert torch.allclose(sampler.rescore(adapter, tree, edges, PROMPTS).logp, tree.edge_logp[edges], atol=1e-6)


def test_changed_weights_change_the_ratio():
    adapter = ToyAdapter()
    sampler, tree = _run(adapter, "full_sde", {}, 2)
    with torch.no_grad():
        adapter.denoiser.weight.add_(0.05)
    edges = tree.trained_edges()
    assert (sampler.rescore(adapter, tree, edges, PROMPTS).logp - tree.edge_logp[edges]).abs().max() > 1e-4


def test_rescore_carries_gradient_and_counts_grad_passes():
    adapter = ToyAdapter()
    sampler, tree = _run(adapter, "full_sde", {}, 2)
    edges = tree.trained_edges()
    out = sampler.rescore(adapter, tree, edges, PROMPTS)
    out.logp.sum().backward()
    assert adapter.denoiser.weight.grad.abs().sum() > 0
    assert sampler.counters.nfe_grad == 2 * edges.numel()  # CFG doubles the rows


def test_forward_counts_match_closed_forms():
    T, P = 20, 2
    adapter = ToyAdapter()
    # BranchGRPO: splits {0,3,6,9}, factor 2 -> 218 edges per tree (13.625 per leaf); forwards = nodes at depths < T
    _, tree = _run(adapter, "tree", {"split_steps": (0, 3, 6, 9)}, 16, T=T, cfg_mode="none")
    assert tree.trained_edges().numel() == P * 218 and tree.trained_edges().numel() / (P * 16) == 13.625
    assert tree.counters["nfe_nograd"] == P * (218 - 16 + 1)
    # Flow-GRPO chains with CFG: G * T rows, doubled
    _, tree = _run(adapter, "full_sde", {}, 4, T=10)
    assert tree.counters["nfe_nograd"] == P * 4 * 10 * 2
    # TP-GRPO probes: per chain T + sum_{d<T-1} (T - d) completions
    _, tree = _run(adapter, "probes", {}, 3, T=10, cfg_mode="none")
    assert tree.counters["nfe_nograd"] == P * 3 * (10 + sum(10 - d for d in range(9)))
    # TempFlow branch points (all but the last step, k siblings): spine T + k * sum_i (T - i - 1)
    _, tree = _run(adapter, "branch_points", {"k": 6}, 1, T=10, cfg_mode="none")
    assert tree.counters["nfe_nograd"] == P * (10 + 6 * sum(10 - i - 1 for i in range(9)))
    # VGPO one-step probes are free: they reuse the step's own forward
    _, tree = _run(adapter, "probes", {"one_step": True}, 3, T=10, cfg_mode="none")
    assert tree.counters["nfe_nograd"] == P * 3 * 10


def test_shared_prefix_runs_once_per_prompt_and_splits_at_the_window():
    adapter = ToyAdapter()
    _, tree = _run(
        adapter, "window", {"size": 2, "schedule": "fixed", "start": 3}, 4, T=8, cfg_mode="none", share_noise=True
    )
    # steps 0-3 once per prompt (the split step shares its forward), then 4 chains for steps 4-7
    assert tree.counters["nfe_nograd"] == 2 * (4 + 4 * 4)
    leaves = tree.leaf_latents()
    assert not torch.allclose(leaves[0, 0], leaves[0, 1])  # the SDE window made them differ
    chains = tree.ancestors(tree.leaves)
    assert (chains[0, :, :4] == chains[0, :1, :4]).all()  # ...after a common prefix


def test_layouts_for_step_estimators():
    adapter = ToyAdapter()
    _, tree = _run(adapter, "branch_points", {"k": 3, "points": [1, 4]}, 1)
    side = tree.side_children()
    assert side.shape == (2, 3, 6) and (side[:, :, [1, 4]] >= 0).all() and (side[:, :, [0, 2, 3, 5]] == -1).all()
    assert set(tree.probe_nodes.tolist()) == set(side[side >= 0].tolist())
    _, tree = _run(adapter, "probes", {}, 2)
    values = tree.node_values_along_chains(tree.depth.float())
    assert values.shape == (2, 2, 7) and torch.equal(values[0, 0], torch.arange(7).float())
    structure, local = _run(adapter, "tree", {"split_steps": (0, 2)}, 4)[1].tree_structure()
    structure.validate(2, 4)
    assert int(structure.node_valid.sum()) == 2 * (1 + 2 + 2 + 4 + 4 + 4 + 4)


@pytest.mark.parametrize(
    "change,match",
    [
        ({"group": 3, "plan": ("tree", {"split_steps": (0,)})}, "multiple"),
        ({"plan_steps": 5}, "num_steps"),
    ],
)
def test_bad_rollouts_raise(change, match):
    adapter = ToyAdapter()
    sampler = Sampler(SamplerConfig(num_steps=6))
    name, settings = change.get("plan", ("full_sde", {}))
    plan = build_plan(name, change.get("plan_steps", 6), **settings)
    with pytest.raises(ValueError, match=match):
        sampler.run(adapter, PROMPTS, plan, change.get("group", 2))


def test_kernel_family_mismatch_and_unknown_kernel():
    with pytest.raises(ValueError, match="epsilon"):
        _run(ToyAdapter("epsilon"), "full_sde", {}, 2, ("flow_sde", {}))
    with pytest.raises(ValueError, match="epsilon-prediction"):
        _run(ToyAdapter(), "full_sde", {}, 2, ("ddim", {}))
    with pytest.raises(ValueError, match="valid names"):
        SamplerConfig(sde_kernel="flow_sdee")
    with pytest.raises(ValueError, match="dpm2m"):
        _run(ToyAdapter("epsilon"), "window", {"size": 2, "post_solver": "dpm2m"}, 2, ("ddim", {}))


# --- real tiny diffusers models: every kernel x adapter x plan ------------------------------------

ADAPTER_KERNELS = [("sd3", k) for k in FLOW_KERNELS] + [
    ("flux", ("flow_sde", {"a": 0.9})),
    ("flux", ("cps", {"a": 0.7})),
    ("qwenimage", ("dance_sde", {"eta": 0.3})),
    ("sd15", ("ddim", {"eta": 1.0})),
]


@pytest.fixture(scope="module")
def tiny_adapters():
    from pipelines.adapters import build_adapter

    return {name: build_adapter(name, tiny=True) for name in ("sd3", "flux", "qwenimage", "sd15")}


@pytest.mark.parametrize(
    "plan_name,settings,group", PLANS, ids=[f"{p[0]}{'-1step' if p[1].get('one_step') else ''}" for p in PLANS]
)
@pytest.mark.parametrize("family,kernel", ADAPTER_KERNELS, ids=[f"{a}-{k[0]}" for a, k in ADAPTER_KERNELS])
def test_tiny_models_rescore_to_ratio_one(tiny_adapters, family, kernel, plan_name, settings, group):
    adapter = tiny_adapters[family]
    cfg_mode = "none" if family == "flux" else "full"
    sampler = Sampler(
        SamplerConfig(
            num_steps=4,
            sde_kernel={"name": kernel[0], **kernel[1]},
            cfg_mode=cfg_mode,
            guidance_scale=3.0,
            keep_means=True,
        )
    )
    plan = build_plan(
        plan_name,
        4,
        **{
            **settings,
            **({"points": [1, 2]} if plan_name == "branch_points" else {}),
            **({"split_steps": (0, 2)} if plan_name == "tree" else {}),
        },
    )
    tree = sampler.run(adapter, ["a cat"], plan, group, torch.Generator().manual_seed(0))
    edges = tree.trained_edges()
    out = sampler.rescore(adapter, tree, edges, ["a cat"])
    assert torch.allclose(out.logp, tree.edge_logp[edges], atol=1e-5, rtol=0), (
        (out.logp - tree.edge_logp[edges]).abs().max()
    )
    if kernel[0] != "cps":
        e = int(edges[0])
        want = _gaussian_logp(tree.states[e : e + 1], tree.edge_mean[e : e + 1], float(tree.edge_std[e]))
        assert abs(float(want) - float(tree.edge_logp[e])) < 1e-4
