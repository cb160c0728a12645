"""Step- and node-level estimators: TempFlow sibling z-score, TP-GRPO turning points, VGPO value-anchored,
BranchGRPO tree depth (formulas from the TempFlow-GRPO, TP-GRPO, VGPO and BranchGRPO papers)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from _coreref import (
    SETTINGS,
    np64,
    random_rewards,
    ref_step_z,
    ref_tree_depth,
    ref_turning_point_rewards,
    ref_value_anchored,
    t32,
    tb,
)
from flowgrpo.core import AdvantageConfig, GroupBatch, TreeStructure, compute_advantages


def close(actual, expected, rtol=1e-4, atol=1e-4):
    np.testing.assert_allclose(np64(actual), expected, rtol=rtol, atol=atol)


def step_run(R, estimator, step_mask=None, valid=None, **settings):
    batch = GroupBatch(
        step_rewards=t32(R),
        step_mask=None if step_mask is None else tb(step_mask),
        valid=None if valid is None else tb(valid),
    )
    return compute_advantages(batch, AdvantageConfig(estimator={"name": estimator, **settings}))


# --- TempFlow-GRPO sibling z-score ------------------------------------------------------------


@SETTINGS
@given(
    seed=st.integers(0, 2**31 - 1),
    P=st.integers(1, 3),
    k=st.integers(2, 7),
    T=st.integers(1, 5),
    unbiased=st.booleans(),
    holes=st.booleans(),
)
def test_sibling_formula(seed, P, k, T, unbiased, holes):
    rng = np.random.default_rng(seed)
    R = rng.normal(size=(P, k, T)).astype(np.float32).astype(np.float64)
    mask = rng.uniform(size=R.shape) > (0.2 if holes else 0.0)
    if holes:
        R[rng.uniform(size=R.shape) < 0.1] = np.nan
    valid = rng.uniform(size=(P, k)) > (0.2 if holes else 0.0)
    out = step_run(R, "sibling", mask, valid, unbiased=unbiased)
    ok = mask & np.isfinite(R) & valid[..., None]
    close(out.advantages, ref_step_z(R, ok, 1e-4, unbiased), rtol=1e-3, atol=1e-3)
    close(out.sample_weight, ok.astype(float), atol=0)
    assert out.level == "step"


def test_sibling_constant_branch_point_gives_zero():
    R = np.array([[[0.7, 1.0], [0.7, 2.0], [0.7, 0.5]]])
    adv = np64(step_run(R, "sibling").advantages)
    assert np.all(adv[:, :, 0] == 0) and np.abs(adv[:, :, 1]).max() > 0.5


# --- TP-GRPO turning points -------------------------------------------------------------------

# Four hand-made chains of probe rewards R_0 (pure ODE) .. R_3 (final SDE sample), T = 3 steps.
# Step reward R~_k = B_k = R_3 - R_{k-1} at a turning point, d_k = R_k - R_{k-1} elsewhere.
INCREASING = [0.0, 1.0, 2.0, 3.0]  # d = 1,1,1; trend +3; k=1 turns (d_1 and R_3 - R_1 agree) -> 3, 1, 1
DIP = [1.0, 0.0, 2.0, 3.0]  # d = -1,2,1; trend +2; k=1 no; k=2 turns (s_1<0, s_2>0, R_3>R_2) -> -1, 3, 1
DECREASING = [3.0, 2.0, 1.5, 0.0]  # d = -1,-.5,-1.5; trend -3; k=1 turns -> -3, -0.5, -1.5
FLAT = [1.0, 1.0, 1.0, 1.0]  # nothing moves -> 0, 0, 0
HAND = {
    "increasing": ([3.0, 1.0, 1.0], [True, False, False]),
    "dip": ([-1.0, 3.0, 1.0], [False, True, False]),
    "decreasing": ([-3.0, -0.5, -1.5], [True, False, False]),
    "flat": ([0.0, 0.0, 0.0], [False, False, False]),
}


def test_turning_point_hand_made_chains_without_balancing():
    R = np.array([[INCREASING, DIP, DECREASING, FLAT]])
    out = step_run(R, "turning_point", balance=False)
    steps = np.array([[HAND[n][0] for n in ["increasing", "dip", "decreasing", "flat"]]])
    close(out.advantages, ref_step_z(steps, np.ones(steps.shape, bool), 1e-4, False), rtol=1e-5, atol=1e-5)
    assert out.metrics["turning_point/count"] == 3.0
    assert out.metrics["turning_point/dropped_by_balance"] == 0.0
    assert out.advantages.shape == (1, 4, 3)


def test_turning_point_increasing_chain_alone():
    """Next to a flat chain, the increasing chain's first step (a turning point, B_1 = 3) stands out."""
    R = np.array([[INCREASING, FLAT]])
    out = step_run(R, "turning_point", eps=0.0, balance=False)
    # two members: z = +-1 whenever they differ; the step rewards are (3, 1, 1) vs (0, 0, 0)
    close(out.advantages[0, 0], [1.0, 1.0, 1.0], atol=1e-6)
    assert out.metrics["turning_point/count"] == 1.0


def test_turning_point_balancing_keeps_equal_positive_and_negative():
    """Three rising chains turn at k=1 (trend +3, +5, +4) and one falling chain (trend -3): balancing keeps
    the largest positive one (+5) and the negative one; the two others fall back to d_k."""
    rise5 = [0.0, 1.0, 3.0, 5.0]  # d = 1,2,2 -> B_1 = 5
    rise4 = [0.0, 2.0, 3.0, 4.0]  # d = 2,1,1 -> B_1 = 4
    R = np.array([[INCREASING, rise5, rise4, DECREASING]])
    out = step_run(R, "turning_point", balance=True)
    kept = np.array([[[1.0, 1.0, 1.0], [5.0, 2.0, 2.0], [2.0, 1.0, 1.0], [-3.0, -0.5, -1.5]]])
    close(out.advantages, ref_step_z(kept, np.ones(kept.shape, bool), 1e-4, False), rtol=1e-5, atol=1e-5)
    assert out.metrics["turning_point/count"] == 2.0
    assert out.metrics["turning_point/dropped_by_balance"] == 2.0
    # with one sign only, nothing is dropped
    only_pos = step_run(np.array([[INCREASING, rise5, rise4, FLAT]]), "turning_point", balance=True)
    assert only_pos.metrics["turning_point/count"] == 3.0
    assert only_pos.metrics["turning_point/dropped_by_balance"] == 0.0


@SETTINGS
@given(
    seed=st.integers(0, 2**31 - 1),
    P=st.integers(1, 3),
    G=st.integers(2, 6),
    T=st.integers(1, 6),
    balance=st.booleans(),
    by=st.sampled_from(["trend", "bonus"]),
    eta=st.sampled_from([1.0, 0.5]),
)
def test_turning_point_formula(seed, P, G, T, balance, by, eta):
    R = np.random.default_rng(seed).normal(size=(P, G, T + 1)).astype(np.float32).astype(np.float64)
    out = step_run(R, "turning_point", balance=balance, balance_by=by, eta=eta)
    options, before = ref_turning_point_rewards(R, eta, balance, by)
    adv = np64(out.advantages)
    full = np.ones(options[0][0].shape, bool)
    matches = [np.allclose(adv, ref_step_z(steps, full, 1e-4, False), rtol=1e-3, atol=1e-3) for steps, _ in options]
    assert any(matches), f"no allowed tie resolution matches ({len(options)} options)"
    kept = int(options[0][1].sum())
    assert all(int(m.sum()) == kept for _, m in options)
    assert out.metrics["turning_point/count"] == float(kept)
    assert out.metrics["turning_point/dropped_by_balance"] == float(before - kept)
    if balance:  # equal positive and negative counts whenever both signs occurred
        ((_, raw),) = ref_turning_point_rewards(R, eta, False, by)[0]
        cand = (R[..., -1:] - R[..., :1]) * np.ones((1, 1, T)) if by == "trend" else eta * (R[..., -1:] - R[..., :-1])
        pos, neg = (raw & (cand > 0)).sum(), (raw & (cand < 0)).sum()
        if pos and neg:
            assert out.metrics["turning_point/count"] == 2 * min(pos, neg)
            for _, m in options:
                assert (m & (cand > 0)).sum() == (m & (cand < 0)).sum()


def test_turning_point_missing_probe_excludes_the_chain_steps():
    R = np.array([[INCREASING, DIP, DECREASING]])
    mask = np.ones(R.shape, dtype=bool)
    mask[0, 1, 2] = False  # R_2 of the dip chain is missing: steps 2 and 3 of that chain are not ok
    out = step_run(R, "turning_point", mask, balance=False)
    w = np64(out.sample_weight)
    np.testing.assert_array_equal(w[0, 1], [1.0, 0.0, 0.0])
    assert np.all(np64(out.advantages)[0, 1, 1:] == 0)


def test_turning_point_needs_two_probes():
    with pytest.raises(ValueError, match="step_rewards"):
        step_run(np.zeros((1, 2, 1)), "turning_point")


def test_turning_point_rejects_unknown_balance_by():
    with pytest.raises(ValueError, match="balance_by"):
        step_run(np.zeros((1, 2, 3)), "turning_point", balance_by="trends")


# --- VGPO value-anchored ----------------------------------------------------------------------


@SETTINGS
@given(
    seed=st.integers(0, 2**31 - 1),
    P=st.integers(1, 3),
    G=st.integers(2, 6),
    T=st.integers(1, 8),
    gamma=st.sampled_from([0.95, 0.5, 1.0]),
    k=st.sampled_from([0.1, 0.0, 1.0]),
    steps=st.integers(0, 6),
    holes=st.booleans(),
    unbiased=st.booleans(),
)
def test_value_anchored_formula(seed, P, G, T, gamma, k, steps, holes, unbiased):
    rng = np.random.default_rng(seed)
    r = rng.uniform(0.1, 1.0, size=(P, G, T)).astype(np.float32).astype(np.float64)  # non-negative rewards
    mask = np.ones(r.shape, dtype=bool)
    if holes:
        mask[..., 1:] = rng.uniform(size=(P, G, T - 1)) > 0.2
    out = step_run(r, "value_anchored", mask, gamma=gamma, k=k, absolute_steps=steps, unbiased=unbiased)
    close(out.advantages, ref_value_anchored(r, mask, gamma, k, steps, 1e-4, unbiased), rtol=1e-3, atol=1e-3)
    close(out.sample_weight, mask.astype(float), atol=0)


def test_value_anchored_absolute_term_survives_zero_std():
    """Identical trajectories: the relative term vanishes, omega_t * k * Q_t remains for t < absolute_steps."""
    r = np.array([[[1.0, 1.0], [1.0, 1.0]]])
    out = np64(step_run(r, "value_anchored", gamma=0.5, k=0.1, absolute_steps=1).advantages)
    Q = np.array([1.0 + 0.5, 1.0])
    omega = Q / Q.mean()
    np.testing.assert_allclose(out[0, 0], [omega[0] * 0.1 * Q[0], 0.0], atol=1e-6)


# --- BranchGRPO tree depth --------------------------------------------------------------------


def one_split_tree(P, G, L):
    """Root with G children, each continuing as a chain of L nodes: depth 1..L, leaf at depth L."""
    N = 1 + G * L
    parent, depth = np.full(N, -1), np.zeros(N, dtype=int)
    leaf = np.zeros(G, dtype=int)
    for g in range(G):
        prev = 0
        for d in range(1, L + 1):
            n = 1 + g * L + (d - 1)
            parent[n], depth[n], prev = prev, d, n
        leaf[g] = prev
    rep = lambda a: torch.as_tensor(np.tile(a, (P, 1)))  # noqa: E731
    return TreeStructure(parent=rep(parent), depth=rep(depth), leaf_index=rep(leaf)), parent, depth, leaf


@SETTINGS
@given(
    seed=st.integers(0, 2**31 - 1),
    P=st.integers(1, 3),
    G=st.integers(2, 6),
    L=st.integers(1, 4),
    nan=st.sampled_from([0.0, 0.2]),
    unbiased=st.booleans(),
    eps=st.sampled_from([1e-8, 1e-4]),
)
def test_tree_depth_one_split_equals_grpo_on_leaves(seed, P, G, L, nan, unbiased, eps):
    r, _ = random_rewards(np.random.default_rng(seed), P, G, "normal", nan)
    tree, parent, depth, leaf = one_split_tree(P, G, L)
    batch = GroupBatch(rewards=t32(r), tree=tree)
    out = compute_advantages(batch, AdvantageConfig(estimator={"name": "tree_depth", "eps": eps, "unbiased": unbiased}))
    grpo = compute_advantages(
        GroupBatch(rewards=t32(r)), AdvantageConfig(estimator={"name": "grpo", "eps": eps, "unbiased": unbiased})
    )
    adv = np64(out.advantages)
    for g in range(G):
        for d in range(1, L + 1):
            node = 1 + g * L + (d - 1)
            np.testing.assert_allclose(adv[:, node], np64(grpo.advantages[:, g]), rtol=1e-4, atol=1e-4)
    assert np.all(adv[:, 0] == 0)  # the root: one node at depth 0
    assert out.level == "node"
    np.testing.assert_allclose(np64(out.sample_weight[:, 0]), 0.0)  # no edge into the root


def small_binary_tree():
    """root 0 -> 1, 2; 1 -> 3, 4; 2 -> 5, 6. Leaves 3..6 carry rewards 1, 2, 3, 5."""
    parent = [-1, 0, 0, 1, 1, 2, 2]
    depth = [0, 1, 1, 2, 2, 2, 2]
    leaf = [3, 4, 5, 6]
    return parent, depth, leaf, [1.0, 2.0, 3.0, 5.0]


def zscore_unbiased(vals, eps=1e-8):
    vals = np.asarray(vals, dtype=np.float64)
    return (vals - vals.mean()) / (vals.std(ddof=1) + eps)


def test_tree_depth_mean_fusion_small_binary_tree():
    parent, depth, leaf, r = small_binary_tree()
    tree = TreeStructure(torch.tensor([parent]), torch.tensor([depth]), torch.tensor([leaf]))
    out = compute_advantages(GroupBatch(rewards=t32([r]), tree=tree), AdvantageConfig(estimator="tree_depth"))
    adv = np64(out.advantages)[0]
    # R(1) = (1 + 2) / 2 = 1.5, R(2) = (3 + 5) / 2 = 4: depth 1 z-scores [1.5, 4]
    np.testing.assert_allclose(adv[[1, 2]], zscore_unbiased([1.5, 4.0]), rtol=1e-5)
    np.testing.assert_allclose(adv[[1, 2]], [-1 / math.sqrt(2), 1 / math.sqrt(2)], rtol=1e-5)
    np.testing.assert_allclose(adv[3:], zscore_unbiased([1.0, 2.0, 3.0, 5.0]), rtol=1e-5)
    assert adv[0] == 0.0
    np.testing.assert_array_equal(np64(out.sample_weight)[0], [0, 1, 1, 1, 1, 1, 1])
    assert out.metrics["tree/degenerate_depth_frac"] == pytest.approx(1 / 3)  # the root's depth


@pytest.mark.parametrize("alpha, r1", [(1.0, 0.25 * 1 + 0.75 * 2), (2.0, (1 * 1 + 9 * 2) / 10)])
def test_tree_depth_softmax_fusion_small_binary_tree(alpha, r1):
    """Edge log-probs: node 3 -> 0, node 4 -> ln 3 (softmax weights 1/4, 3/4 at alpha = 1; 1/10, 9/10 at
    alpha = 2), nodes 5, 6 equal (R(2) = 4)."""
    parent, depth, leaf, r = small_binary_tree()
    edge = [0.0, 0.0, -math.log(3), 0.0, math.log(3), 0.0, 0.0]
    tree = TreeStructure(
        torch.tensor([parent]), torch.tensor([depth]), torch.tensor([leaf]), edge_logp=torch.tensor([edge])
    )
    cfg = AdvantageConfig(estimator={"name": "tree_depth", "fusion": "softmax", "alpha": alpha})
    adv = np64(compute_advantages(GroupBatch(rewards=t32([r]), tree=tree), cfg).advantages)[0]
    np.testing.assert_allclose(adv[[1, 2]], zscore_unbiased([r1, 4.0]), rtol=1e-5)
    np.testing.assert_allclose(adv[3:], zscore_unbiased(r), rtol=1e-5)  # leaves hold their own reward


def random_forest(rng, P, depth_max):
    """P random trees (1 or 2 children per node, 3 children sometimes), padded to a common N and G."""
    trees = []
    for _ in range(P):
        parent, depth = [-1], [0]
        frontier = [0]
        for d in range(1, depth_max + 1):
            nxt = []
            for n in frontier:
                for _ in range(int(rng.choice([1, 2, 3], p=[0.5, 0.4, 0.1]))):
                    parent.append(n)
                    depth.append(d)
                    nxt.append(len(parent) - 1)
            frontier = nxt
        trees.append((parent, depth, frontier))
    N = max(len(t[0]) for t in trees)
    G = max(len(t[2]) for t in trees)
    par, dep = np.full((P, N), -1), np.zeros((P, N), dtype=int)
    leaf, node_valid, valid = np.zeros((P, G), dtype=int), np.zeros((P, N), dtype=bool), np.zeros((P, G), dtype=bool)
    for p, (parent, depth, leaves) in enumerate(trees):
        par[p, : len(parent)], dep[p, : len(depth)], node_valid[p, : len(parent)] = parent, depth, True
        leaf[p, : len(leaves)], valid[p, : len(leaves)] = leaves, True
    return trees, par, dep, leaf, node_valid, valid


@SETTINGS
@given(
    seed=st.integers(0, 2**31 - 1),
    P=st.integers(1, 3),
    D=st.integers(1, 4),
    fusion=st.sampled_from(["mean", "softmax"]),
    alpha=st.sampled_from([1.0, 0.5]),
    nan=st.sampled_from([0.0, 0.2]),
    unbiased=st.booleans(),
)
def test_tree_depth_formula_random_trees(seed, P, D, fusion, alpha, nan, unbiased):
    rng = np.random.default_rng(seed)
    trees, par, dep, leaf, node_valid, valid = random_forest(rng, P, D)
    N, G = par.shape[1], leaf.shape[1]
    r = rng.normal(size=(P, G)).astype(np.float32).astype(np.float64)
    r[rng.uniform(size=r.shape) < nan] = np.nan
    edge = rng.normal(size=(P, N)).astype(np.float32).astype(np.float64)
    tree = TreeStructure(torch.as_tensor(par), torch.as_tensor(dep), torch.as_tensor(leaf), tb(node_valid), t32(edge))
    cfg = AdvantageConfig(estimator={"name": "tree_depth", "fusion": fusion, "alpha": alpha, "unbiased": unbiased})
    out = compute_advantages(GroupBatch(rewards=t32(r), valid=tb(valid), tree=tree), cfg)
    for p, (parent, depth, leaves) in enumerate(trees):
        leaf_of = [leaves[g] if g < len(leaves) else None for g in range(G)]
        adv, value = ref_tree_depth(parent, depth, leaf_of, r[p], fusion, edge[p], alpha, unbiased=unbiased)
        n = len(parent)
        np.testing.assert_allclose(np64(out.advantages[p, :n]), adv, rtol=1e-3, atol=1e-3)
        weight = [1.0 if parent[m] >= 0 and value[m] is not None else 0.0 for m in range(n)]
        np.testing.assert_array_equal(np64(out.sample_weight[p, :n]), weight)
        assert np.all(np64(out.advantages[p, n:]) == 0) and np.all(np64(out.sample_weight[p, n:]) == 0)


@pytest.mark.parametrize("min_std", [1e-6, 0.0])
@pytest.mark.parametrize("value", [0.7, 22.3, 1.0])
def test_tree_depth_constant_tree_gives_zero(value, min_std):
    """A root with three children, each splitting in three, and a flat forest of 24 chains: every depth holds
    equal values, so every advantage is 0 (not float noise blown up by the per-depth z-score)."""
    parent = [-1, 0, 0, 0] + [1, 1, 1, 2, 2, 2, 3, 3, 3]
    depth = [0, 1, 1, 1] + [2] * 9
    leaf = list(range(4, 13))
    tree = TreeStructure(torch.tensor([parent]), torch.tensor([depth]), torch.tensor([leaf]))
    cfg = AdvantageConfig(estimator={"name": "tree_depth", "min_std": min_std})
    out = compute_advantages(GroupBatch(rewards=t32([[value] * 9]), tree=tree), cfg)
    assert np.all(np64(out.advantages) == 0)
    chains, *_ = one_split_tree(2, 24, 3)
    r = np.stack([np.full(24, value), np.linspace(0, 1, 24)])
    out = compute_advantages(GroupBatch(rewards=t32(r), tree=chains), cfg)
    assert np.all(np64(out.advantages[0]) == 0)
    assert np.abs(np64(out.advantages[1])).max() > 1.0


def test_tree_depth_errors():
    parent, depth, leaf, r = small_binary_tree()
    tree = TreeStructure(torch.tensor([parent]), torch.tensor([depth]), torch.tensor([leaf]))
    batch = GroupBatch(rewards=t32([r]), tree=tree)
    with pytest.raises(ValueError, match="edge_logp"):
        compute_advantages(batch, AdvantageConfig(estimator={"name": "tree_depth", "fusion": "softmax"}))
    with pytest.raises(ValueError, match="fusion"):
        compute_advantages(batch, AdvantageConfig(estimator={"name": "tree_depth", "fusion": "max"}))
    with pytest.raises(ValueError, match="needs GroupBatch.tree"):
        compute_advantages(GroupBatch(rewards=t32([r])), AdvantageConfig(estimator="tree_depth"))


@pytest.mark.parametrize("name", ["sibling", "turning_point", "value_anchored"])
def test_step_estimators_need_step_rewards(name):
    with pytest.raises(ValueError, match="needs GroupBatch.step_rewards"):
        compute_advantages(GroupBatch(rewards=t32([[1.0, 2.0]])), AdvantageConfig(estimator=name))


def test_sample_estimator_without_rewards_raises():
    with pytest.raises(ValueError, match="rewards"):
        compute_advantages(GroupBatch(step_rewards=t32(np.zeros((1, 2, 3)))), AdvantageConfig(estimator="grpo"))
