"""T-PPO's Extended GAE (flowgrpo.core.egae): against a float64 loop re-derivation of the formula, finished vs
truncated responses, the critic's targets, and the clear errors."""

import pytest
import torch

from flowgrpo.core import AdvantageConfig, GroupBatch, compute_advantages
from flowgrpo.core.config import PartSpec
from flowgrpo.core.egae import TokenValueBatch, extended_gae, value_targets


def _loop(r, v, last, finished, length, gamma, lam):
    """A_t = sum_{k=0}^{l-t-1} (gamma lam)^k delta_{t+k}, delta_t = r_t + gamma V(s_{t+1}) - V(s_t), V(s_l) = the
    value at the cut (unfinished) or 0 (finished); one response, Python floats."""
    vals = list(v[:length]) + [0.0 if finished else last]
    deltas = [r[t] + gamma * vals[t + 1] - vals[t] for t in range(length)]
    return [sum((gamma * lam) ** k * deltas[t + k] for k in range(length - t)) for t in range(length)]


def _batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    P, G, T = 2, 3, 6
    lengths = torch.tensor([[6, 3, 1], [4, 6, 2]])
    mask = torch.arange(T).expand(P, G, T) < lengths.unsqueeze(-1)
    finished = torch.tensor([[True, False, True], [False, True, False]])
    rewards = torch.zeros(P, G, T, dtype=torch.float64)
    outcome = torch.rand(P, G, generator=g, dtype=torch.float64)
    for p in range(P):
        for i in range(G):
            if finished[p, i]:
                rewards[p, i, lengths[p, i] - 1] = outcome[p, i]  # the outcome sits on the last token
    values = torch.randn(P, G, T, generator=g, dtype=torch.float64)
    last = torch.randn(P, G, generator=g, dtype=torch.float64)
    return TokenValueBatch(
        step_rewards=rewards, step_mask=mask, values=values, last_value=last, finished=finished
    ), lengths


@pytest.mark.parametrize("gamma,lam", [(1.0, 0.95), (0.9, 0.5), (1.0, 1.0)])
def test_egae_matches_the_float64_loop(gamma, lam):
    batch, lengths = _batch()
    cfg = AdvantageConfig(estimator=PartSpec(name="egae", settings={"gamma": gamma, "lam": lam}))
    out = compute_advantages(batch, cfg)
    assert out.level == "step" and out.advantages.shape == (2, 3, 6)
    for p in range(2):
        for i in range(3):
            n = int(lengths[p, i])
            want = _loop(
                batch.step_rewards[p, i].tolist(), batch.values[p, i].tolist(), float(batch.last_value[p, i]),
                bool(batch.finished[p, i]), n, gamma, lam,
            )  # fmt: skip
            torch.testing.assert_close(out.advantages[p, i, :n], torch.tensor(want, dtype=torch.float64))
            assert bool((out.advantages[p, i, n:] == 0).all()) and bool((out.sample_weight[p, i, n:] == 0).all())
    assert out.metrics["egae/unfinished_frac"] == pytest.approx(0.5)


def test_the_cut_bootstraps_only_unfinished_responses_and_targets_only_finished_ones():
    r = torch.zeros(2, 3, dtype=torch.float64)
    v = torch.zeros(2, 3, dtype=torch.float64)
    mask = torch.ones(2, 3, dtype=torch.bool)
    last = torch.tensor([2.0, 2.0], dtype=torch.float64)
    adv = extended_gae(r, v, last, torch.tensor([False, True]), mask, gamma=1.0, lam=1.0)
    assert adv[0].tolist() == [2.0, 2.0, 2.0] and adv[1].tolist() == [0.0, 0.0, 0.0]
    targets, where = value_targets(adv, v, torch.tensor([False, True]), mask)
    assert torch.equal(targets, adv) and where[0].sum() == 0 and where[1].all()


def test_egae_needs_critic_values():
    with pytest.raises(ValueError, match="'egae' needs per-token critic values.*runs with method tppo"):
        compute_advantages(
            GroupBatch(step_rewards=torch.zeros(1, 2, 3)), AdvantageConfig(estimator=PartSpec(name="egae"))
        )
    with pytest.raises(ValueError, match=r"last_value: expected shape \[1, 2\]"):
        TokenValueBatch(
            step_rewards=torch.zeros(1, 2, 3), values=torch.zeros(1, 2, 3), last_value=torch.zeros(2),
            finished=torch.ones(1, 2, dtype=torch.bool),
        )  # fmt: skip
