"""Per-sample random trained steps against DanceGRPO's rule.

XueZeyue/DanceGRPO fastvideo/train_grpo_flux.py (and Pref-GRPO train_flux_pref_grpo.py):
    samples[k] = samples[k][:, :-1]                                  # the last step is never trained
    perms = stack([randperm(T - 1) for _ in range(batch_size)])      # one permutation per sample
    train_timesteps = int((T - 1) * timestep_fraction)               # the first 9 of 15 at T = 16, 0.6
Our rule draws from another generator, so the test compares the law, not the draw: every sample trains
exactly int(f n) distinct steps of the n allowed ones, each step with probability k / n, each pair with
probability k (k - 1) / (n (n - 1)), independently across samples.
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "pipelines"))
from toy_adapter import ToyAdapter  # noqa: E402

from flowgrpo.t2i.config import T2IConfig  # noqa: E402
from flowgrpo.t2i.credit import assign_credit  # noqa: E402
from pipelines.edge_selection import per_sample_steps  # noqa: E402
from pipelines.plans import build_plan  # noqa: E402
from pipelines.sampler import Sampler, SamplerConfig  # noqa: E402

T = 16


def dance_rule(num_samples: int, T: int, fraction: float, rng: np.random.Generator) -> np.ndarray:
    """The published rule in numpy: [S, T] bool of trained steps."""
    out = np.zeros((num_samples, T), dtype=bool)
    k = int((T - 1) * fraction)
    for s in range(num_samples):
        out[s, rng.permutation(T - 1)[:k]] = True
    return out


def rollout(prompts=("a cat", "a dog"), G=8, plan="full_sde", **plan_settings):
    cfg = SamplerConfig(
        num_steps=T,
        sde_kernel={"name": "dance_sde", "eta": 0.3},
        cfg_mode="none",
        height=8,
        width=8,
        schedule={"name": "time_shift", "shift": 3.0},
    )
    settings = {"train_fraction": 1.0, **plan_settings} if plan == "full_sde" else plan_settings
    return Sampler(cfg).run(
        ToyAdapter(), list(prompts), build_plan(plan, T, **settings), G, torch.Generator().manual_seed(0)
    )


def trained_steps(tree, keep) -> np.ndarray:
    """[S, T] bool: which steps of each final sample's chain are kept."""
    chains = tree.ancestors(tree.leaves).flatten(0, 1)[:, 1:]
    return (keep & tree.edge_trained)[chains].numpy()


def test_each_sample_trains_int_fraction_of_the_steps_but_the_last():
    tree = rollout()
    keep = per_sample_steps(tree, 0.6, torch.Generator().manual_seed(1), exclude_last=True)
    mask = trained_steps(tree, keep)
    assert mask.shape == (16, T)
    assert int(0.6 * 15) == 9 and (mask.sum(1) == 9).all()
    assert not mask[:, T - 1].any()
    assert len({tuple(row) for row in mask}) > 1  # not one subset shared by the group
    # edges outside the chains' trained steps are untouched (none here: every step is trained)
    again = per_sample_steps(tree, 0.6, torch.Generator().manual_seed(1), exclude_last=True)
    torch.testing.assert_close(again, keep)  # deterministic given the generator


def test_the_law_matches_the_published_rule():
    """Inclusion and pair-inclusion frequencies over many samples, ours vs the published rule."""
    tree = rollout(prompts=[f"p{i}" for i in range(25)], G=8)  # 200 samples per draw
    ours = np.concatenate(
        [
            trained_steps(tree, per_sample_steps(tree, 0.6, torch.Generator().manual_seed(s), exclude_last=True))
            for s in range(10)
        ]
    )
    ref = dance_rule(ours.shape[0], T, 0.6, np.random.default_rng(0))
    n, k = T - 1, 9
    for mask in (ours, ref):
        single = mask[:, :n].mean(0)
        np.testing.assert_allclose(single, k / n, atol=0.05)  # 2000 samples: sd ~0.011
        pairs = np.array([(mask[:, a] & mask[:, b]).mean() for a, b in itertools.combinations(range(n), 2)])
        assert abs(pairs.mean() - k * (k - 1) / (n * (n - 1))) < 0.01
        assert np.abs(pairs - k * (k - 1) / (n * (n - 1))).max() < 0.06
    # samples are independent: the overlap of two samples' subsets has the hypergeometric mean k^2 / n
    overlap = (ours[0::2, :n] & ours[1::2, :n]).sum(1).mean()
    assert overlap == pytest.approx(k * k / n, abs=0.25)


def test_fraction_applies_to_the_plans_trained_steps():
    """With the Flow-GRPO prefix (train_fraction 0.5: steps 0-7), each sample keeps int(0.5 * 8) = 4 of those."""
    tree = rollout(train_fraction=0.5)
    mask = trained_steps(tree, per_sample_steps(tree, 0.5, torch.Generator().manual_seed(3)))
    assert (mask.sum(1) == 4).all() and not mask[:, 8:].any()


def config(**edges) -> T2IConfig:
    return T2IConfig(
        model={"tiny": True},
        sampler={
            "num_steps": T,
            "sde_kernel": {"name": "dance_sde", "eta": 0.3},
            "schedule": {"name": "time_shift", "shift": 3.0},
        },
        plan={"name": "full_sde", "train_fraction": 1.0},
        group_size=8,
        advantage={"estimator": {"name": "grpo", "unbiased": True, "eps": 1e-8}},
        edges={"drop_zero_advantage": False, **edges},
    )


def test_credit_trains_each_samples_own_subset_deterministically():
    tree = rollout()
    values = torch.randn(16, 1, generator=torch.Generator().manual_seed(4))
    cfg = config(per_sample_fraction=0.6, exclude_last=True)
    a = assign_credit(tree, values, None, None, cfg, iteration=7)
    b = assign_credit(tree, values, None, None, cfg, iteration=7)  # a resumed run redraws the same subsets
    c = assign_credit(tree, values, None, None, cfg, iteration=8)
    torch.testing.assert_close(a.edges, b.edges)
    assert a.edges.numel() == 16 * 9 and not torch.equal(a.edges, c.edges)
    assert int(tree.edge_step[a.edges].max()) <= T - 2
    chains = tree.ancestors(tree.leaves).flatten(0, 1)[:, 1:]
    per_chain = torch.isin(chains, a.edges).sum(1)
    assert (per_chain == 9).all()
    full = assign_credit(tree, values, None, None, config(), iteration=7)
    assert full.edges.numel() == 16 * T  # without the option every trained edge of every sample


def test_bad_combinations_are_refused():
    with pytest.raises(ValueError, match="exclude_last belongs to the per-sample step subsets"):
        config(exclude_last=True)
    with pytest.raises(ValueError, match="per_sample_fraction"):
        config(per_sample_fraction=0.0)
    with pytest.raises(ValueError, match="picks steps per final sample"):
        T2IConfig(
            model={"tiny": True},
            plan={"name": "tree", "split_steps": [0], "branch": 2},
            advantage={"estimator": {"name": "tree_depth"}},
            edges={"per_sample_fraction": 0.6},
        )
    tree = rollout(plan="tree", split_steps=[0, 3], branch=2, G=4)
    with pytest.raises(ValueError, match="share no trained edge"):
        per_sample_steps(tree, 0.6, torch.Generator().manual_seed(0))
