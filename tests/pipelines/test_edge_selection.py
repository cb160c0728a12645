"""BranchGRPO depth and width pruning reproduce the paper's edge counts (13.625 -> 8.625 per leaf)."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from toy_adapter import ToyAdapter  # noqa: E402

from pipelines.edge_selection import depth_pruning, last_split_step, width_pruning  # noqa: E402
from pipelines.plans import build_plan  # noqa: E402
from pipelines.sampler import Sampler, SamplerConfig  # noqa: E402


@pytest.fixture(scope="module")
def tree():
    sampler = Sampler(SamplerConfig(num_steps=20, cfg_mode="none"))
    plan = build_plan("tree", 20, split_steps=(0, 3, 6, 9))
    return sampler.run(ToyAdapter(), ["a cat"], plan, 16, torch.Generator().manual_seed(0))


def test_last_split_and_unpruned_count(tree):
    assert last_split_step(tree) == 9
    assert int(tree.edge_trained.sum()) == 218


def test_depth_pruning_five_deep_levels_gives_paper_count(tree):
    keep = depth_pruning(tree, [16, 17, 18, 19, 20]) & tree.edge_trained
    assert int(keep.sum()) / 16 == 8.625
    assert not bool((keep & (tree.depth >= 16)).any())


def test_depth_pruning_slides_and_stops(tree):
    base = [16, 17, 18]
    assert set(tree.depth[~depth_pruning(tree, base, iteration=60, slide_interval=30)].tolist()) == {14, 15, 16}
    assert set(tree.depth[~depth_pruning(tree, base, iteration=10_000, slide_interval=30, stop_depth=9)].tolist()) == {
        9,
        10,
        11,
    }
    assert bool(depth_pruning(tree, []).all())


@pytest.mark.parametrize("mode", [1, 2])
def test_width_pruning_keeps_half_the_last_layer(tree, mode):
    adv = torch.randn(tree.num_nodes)
    keep = width_pruning(tree, adv, 0.5, mode) & tree.edge_trained
    assert int(keep.sum()) / 16 == 8.625  # (218 - 160 / 2) / 16
    last = (tree.edge_step > 9) & (tree.parent >= 0)
    assert bool(keep[~last & tree.edge_trained].all())  # nothing before the last split is touched
    if mode == 2:  # the best and the worst quarter survive
        kept = adv[keep & last]
        dropped = adv[~keep & last]
        assert kept.max() >= dropped.max() and kept.min() <= dropped.min()


def test_width_pruning_mode1_ranks_within_each_chain(tree):
    adv = tree.depth.float()  # deeper = better: each chain keeps its deepest half
    keep = width_pruning(tree, adv, 0.5, 1)
    last = (tree.edge_step > 9) & (tree.parent >= 0)
    assert set(tree.depth[keep & last].tolist()) == {16, 17, 18, 19, 20}


def test_width_pruning_bad_settings(tree):
    with pytest.raises(ValueError, match="mode"):
        width_pruning(tree, torch.zeros(tree.num_nodes), 0.5, 3)
    with pytest.raises(ValueError, match="keep_ratio"):
        width_pruning(tree, torch.zeros(tree.num_nodes), 0.0, 1)
