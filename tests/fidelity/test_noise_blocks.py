"""Mini-groups that share their own initial noise (sampler.share_noise_size), as the fast pipeline builds them.

yifan123/flow_grpo's fast pipeline, read in its verbatim descendant showlab/Adv-GRPO
adv_grpo/diffusers_patch/sd3_pipeline_with_logprob_fast.py: one call per (prompt, mini-group) draws one initial
noise, runs the ODE steps before the SDE window once, and at the window start repeats the latent
`mini_num_image_per_prompt` times; the training scripts build a group of `num_image_per_prompt` from
`k = num_image_per_prompt // mini_num_image_per_prompt` such calls (DistributedKRepeatSampler), each with a fresh
noise. Adv-GRPO: 16 = 2 x 8; Flow-GRPO-Fast: 18 = 2 x 9. The published structure, checked on our rollout tree:
per prompt k distinct noises, each shared by one contiguous block, the prefix run once per block.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "pipelines"))
from toy_adapter import ToyAdapter  # noqa: E402

from pipelines.plans import build_plan  # noqa: E402
from pipelines.sampler import Sampler, SamplerConfig  # noqa: E402

PROMPTS = ["a cat", "a red dog"]
T = 8


def _run(plan: str, settings: dict, group: int, **cfg):
    sampler = Sampler(SamplerConfig(num_steps=T, cfg_mode="none", **cfg))
    return sampler.run(ToyAdapter(), PROMPTS, build_plan(plan, T, **settings), group, torch.Generator().manual_seed(0))


def _blocks(values: torch.Tensor) -> list[int]:
    """Lengths of the runs of equal rows along dim 0 (values: [G, ...])."""
    runs, start = [], 0
    for j in range(1, values.shape[0] + 1):
        if j == values.shape[0] or not torch.equal(values[j], values[start]):
            runs.append(j - start)
            start = j
    return runs


@pytest.mark.parametrize("start, group, size", [(0, 16, 8), (3, 18, 9)], ids=["adv_grpo", "flow_grpo_fast"])
def test_each_mini_group_has_its_own_noise_and_prefix(start, group, size):
    tree = _run(
        "window", {"size": 2, "schedule": "fixed", "start": start}, group, share_noise=True, share_noise_size=size
    )
    chains = tree.ancestors(tree.leaves)  # [P, G, T + 1] node ids
    k = group // size
    for p in range(len(PROMPTS)):
        noises = tree.states[chains[p, :, 0]]
        assert _blocks(noises) == [size] * k  # k noises, one per contiguous block
        at_window = tree.states[chains[p, :, start]]
        assert _blocks(at_window) == [size] * k  # the deterministic prefix is shared within a block only
        assert len(set(chains[p, :, start].tolist())) == k  # ...and stored (run) once per block
    others = [n for p in range(len(PROMPTS)) for n in tree.states[chains[p, ::size, 0]]]
    assert all(not torch.equal(a, b) for i, a in enumerate(others) for b in others[i + 1 :])
    # forwards: the prefix and the split step once per block, the rest once per image
    assert tree.counters["nfe_nograd"] == len(PROMPTS) * (k * (start + 1) + group * (T - start - 1))


def test_blocks_without_a_shared_prefix_share_the_initial_noise_only():
    tree = _run("full_sde", {}, 6, share_noise=True, share_noise_size=3)
    chains = tree.ancestors(tree.leaves)
    assert _blocks(tree.states[chains[0, :, 0]]) == [3, 3]
    assert _blocks(tree.states[chains[0, :, 1]]) == [1] * 6  # SDE from the first step on


def test_default_is_one_noise_per_group_and_blocks_change_it():
    whole = _run("window", {"size": 2, "schedule": "fixed", "start": 0}, 16, share_noise=True)
    chains = whole.ancestors(whole.leaves)
    assert _blocks(whole.states[chains[0, :, 0]]) == [16]
    assert _blocks(_run("full_sde", {}, 4).states[:8]) == [1] * 8  # share_noise off: a noise per image


def test_fewer_roots_than_a_block_share_one_noise():
    """Evaluation samples one image per prompt with the same sampler settings."""
    tree = _run("ode_only", {}, 1, share_noise=True, share_noise_size=8)
    assert tree.leaves.shape == (len(PROMPTS), 1)


def test_bad_block_sizes_are_rejected():
    with pytest.raises(ValueError, match="needs share_noise"):
        SamplerConfig(share_noise_size=8)
    with pytest.raises(ValueError, match="must divide"):
        _run("window", {"size": 2, "schedule": "fixed", "start": 0}, 16, share_noise=True, share_noise_size=6)
