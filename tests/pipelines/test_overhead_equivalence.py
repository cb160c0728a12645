"""The loop-overhead rewrites give the same bits as the plain formulas they replaced.

FLUX pack / unpack (a cached gather without grad, pixel_(un)shuffle with grad) against the 6-d permute,
BranchGRPO width pruning (one ranking pass) against the per-group loop, and the Gaussian log-prob (in place
without grad on the variance) against the out-of-place expression, values and gradients.
"""

from __future__ import annotations

import math

import pytest
import torch

from flowgrpo.core.gaussian import _per_sample, gaussian_logprob
from pipelines.adapters.flux import pack, unpack
from pipelines.edge_selection import last_split_step, width_pruning
from pipelines.rollout import RolloutTree


def _pack_ref(x):
    n, c, h, w = x.shape
    return x.reshape(n, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5).reshape(n, (h // 2) * (w // 2), c * 4)


def _unpack_ref(tokens, h, w):
    n, _, d = tokens.shape
    return tokens.reshape(n, h // 2, w // 2, d // 4, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(n, d // 4, h, w)


@pytest.mark.parametrize("shape", [(1, 4, 2, 2), (3, 16, 8, 6), (8, 4, 16, 16), (2, 64, 6, 10)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pack_unpack_match_the_permute(shape, dtype):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(dtype)
    tokens = pack(x)
    assert torch.equal(tokens, _pack_ref(x)) and tokens.is_contiguous()
    assert torch.equal(pack(x.transpose(2, 3).contiguous().transpose(2, 3)), _pack_ref(x))  # strided input
    back = unpack(tokens, *shape[2:])
    assert torch.equal(back, x) and back.is_contiguous()
    with torch.inference_mode():
        assert torch.equal(pack(x), _pack_ref(x))
    for fn, ref, arg in (
        (pack, _pack_ref, x),
        (lambda t: unpack(t, *shape[2:]), lambda t: _unpack_ref(t, *shape[2:]), tokens),
    ):
        leaf = arg.float().clone().requires_grad_(True)
        w = torch.randn(ref(leaf).shape, generator=torch.Generator().manual_seed(1))
        (g1,) = torch.autograd.grad((fn(leaf) * w).sum(), leaf)
        (g2,) = torch.autograd.grad((ref(leaf) * w).sum(), leaf)
        assert torch.equal(g1, g2)


def _width_ref(tree, adv, keep_ratio):
    split = last_split_step(tree)
    last = (tree.edge_step > split) & tree.continues & (tree.parent >= 0)
    keep = ~last
    ids = last.nonzero().squeeze(1)
    group = tree.ancestors(ids)[:, split + 1]
    for g in torch.unique(group).tolist():
        members = ids[group == g]
        n = math.ceil(members.numel() * keep_ratio)
        keep[members[torch.argsort(adv[members].float(), descending=True, stable=True)[:n]]] = True
    return keep


def _tree(P=2, splits=(0, 2), T=6, branch=2) -> RolloutTree:
    """A BranchGRPO-shaped tree (every root splits at `splits`), built level by level like the sampler."""
    parent, depth, prompt, step = [-1] * P, [0] * P, list(range(P)), [-1] * P
    frontier = list(range(P))
    for i in range(T):
        nxt = []
        for node in frontier:
            for _ in range(branch if i in splits else 1):
                parent.append(node), depth.append(i + 1), prompt.append(prompt[node]), step.append(i)
                nxt.append(len(parent) - 1)
        frontier = nxt
    n = len(parent)
    leaves = torch.tensor(sorted(frontier, key=lambda k: prompt[k])).view(P, -1)
    return RolloutTree(
        parent=torch.tensor(parent), depth=torch.tensor(depth), prompt=torch.tensor(prompt),
        continues=torch.ones(n, dtype=torch.bool), states=torch.zeros(n, 1), edge_step=torch.tensor(step),
        edge_sde=torch.ones(n, dtype=torch.bool), edge_trained=torch.ones(n, dtype=torch.bool),
        edge_logp=torch.zeros(n), edge_std=torch.ones(n), leaves=leaves, num_steps=T,
    )  # fmt: skip


@pytest.mark.parametrize("splits", [(0, 2), (1, 3, 4), (0,)])
def test_width_pruning_matches_the_per_group_loop(splits):
    tree = _tree(splits=splits)
    for seed in range(12):
        g = torch.Generator().manual_seed(seed)
        adv = (
            torch.randint(0, 3, (tree.num_nodes,), generator=g).float()
            if seed % 2
            else torch.randn(tree.num_nodes, generator=g)
        )
        for ratio in (0.2, 0.5, 1 / 3, 0.75, 1.0):
            assert torch.equal(width_pruning(tree, adv, ratio, 1), _width_ref(tree, adv, ratio))


def _logprob_ref(x, mean, std):
    x, mean = x.float(), mean.float()
    s = _per_sample(std, x).float()
    return (-((x - mean) ** 2) / (2 * s**2) - torch.log(s) - 0.5 * math.log(2 * math.pi)).flatten(1).mean(1)


@pytest.mark.parametrize("std_kind", ["scalar", "per_sample", "float", "per_sample_grad"])
def test_gaussian_logprob_in_place_is_the_same_expression(std_kind):
    g = torch.Generator().manual_seed(0)
    x, m0 = torch.randn(6, 4, 5, 5, generator=g), torch.randn(6, 4, 5, 5, generator=g)
    std = {"scalar": torch.tensor(0.37), "float": 0.5}.get(std_kind, torch.rand(6, generator=g) + 0.01)
    if std_kind == "per_sample_grad":
        std = std.clone().requires_grad_(True)
    mean = m0.clone().requires_grad_(True)
    a, b = gaussian_logprob(x, mean, std), _logprob_ref(x, mean, std)
    assert torch.equal(a, b)
    leaves = [mean] + ([std] if std_kind == "per_sample_grad" else [])
    for ga, gb in zip(torch.autograd.grad(a.sum(), leaves), torch.autograd.grad(b.sum(), leaves)):
        assert torch.equal(ga, gb)
    with torch.no_grad():
        assert torch.equal(gaussian_logprob(x, m0, std), _logprob_ref(x, m0, std))


@pytest.mark.parametrize(
    "kernel,settings",
    [("ode", {}), ("flow_sde", {"a": 0.7}), ("dance_sde", {"eta": 0.3}), ("cps", {"a": 0.8}), ("ddim", {"eta": 1.0})],
)
def test_kernel_coefficients_built_once_give_the_same_bits(kernel, settings):
    """A kernel's per-step coefficients are kept on the schedule: a fresh schedule (coefficients computed), the
    same schedule again (read back) and another step's cached entry never mix; built inside an inference-mode
    rollout, they still serve a re-scoring with grad (the update)."""
    from pipelines.schedules import ddim_schedule, flow_schedule
    from pipelines.steps import rescore, step

    make = (lambda: ddim_schedule(6)) if kernel == "ddim" else (lambda: flow_schedule(6, shift=3.0))
    g = torch.Generator().manual_seed(0)
    x, v, noise = (torch.randn(3, 4, 6, 6, generator=g) for _ in range(3))
    cached = make()
    with torch.inference_mode():
        step(kernel, x, v, cached, 2, noise, **settings)  # fills the cache inside inference mode
    assert cached.coefficients and not make().coefficients
    for i in range(6):
        fresh = step(kernel, x, v, make(), i, noise, **settings)
        again = step(kernel, x, v, cached, i, noise, **settings)
        for name in ("x_next", "mean", "std", "logp", "x0_hat"):
            assert torch.equal(getattr(fresh, name), getattr(again, name)), (i, name)
    v_grad = v.clone().requires_grad_(True)
    out = rescore(kernel, x, fresh.x_next, v_grad, cached, 2, **settings)
    (out.mean.sum() + out.logp.sum()).backward()
    assert v_grad.grad is not None and bool(torch.isfinite(v_grad.grad).all())
