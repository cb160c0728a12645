"""BranchGRPO's loss scale against its accumulation loop.

Fredreic1849/BranchGRPO fastvideo/train_branchgrpo_flux.py, train_one_step_tree: for each trained edge (one per
backward), `loss = mean(max(-A r, -A clip(r, 1 - eps, 1 + eps))) / (gradient_accumulation_steps *
num_samples_per_step)` with num_samples_per_step = 218 edges per tree; after every 12 edges: clip the gradient norm
to `max_grad_norm` and step AdamW. The step's gradient is therefore (mean over its edges) / 218: a constant factor
that matters through the clip and AdamW's eps (AdamW is otherwise scale-free, so it shows over several steps
whose gradient norms differ). The reference replays that loop in float64 on a toy log-prob logp_e(w) = <w - w0, f_e>
over 6 optimizer steps and is compared with our `token_mean` aggregation at `scale: 1 / 218`.
"""

from __future__ import annotations

import pytest
import torch

from flowgrpo.core import LossConfig, LossInputs, policy_loss

EDGES, ACCUM, PER_TREE, EPS, CLIP, LR = 12, 12, 218, 1e-3, 1.0, 1e-5
SIZES = [400.0, 1.0, 2000.0, 1e-4, 50.0, 5.0]  # gradient scales of the 6 steps: clipped, unclipped, eps-sized


def _toy(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Initial weights and, per optimizer step, its 12 edges: features [S, E, 5], old log-probs, advantages."""
    g = torch.Generator().manual_seed(seed)
    w0 = torch.randn(5, generator=g, dtype=torch.float64)
    feats = torch.randn(len(SIZES), EDGES, 5, generator=g, dtype=torch.float64)
    feats = feats * torch.tensor(SIZES, dtype=torch.float64)[:, None, None]
    logp_old = 1e-4 * torch.randn(len(SIZES), EDGES, generator=g, dtype=torch.float64)
    adv = torch.randn(len(SIZES), EDGES, generator=g, dtype=torch.float64)
    return w0, feats, logp_old, adv


def _adamw(w: torch.nn.Parameter) -> torch.optim.AdamW:
    return torch.optim.AdamW([w], lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-4)


def published_step(w0, feats, logp_old, adv) -> torch.Tensor:
    w = torch.nn.Parameter(w0.clone())
    opt = _adamw(w)
    for s in range(len(SIZES)):
        for e in range(EDGES):  # one edge per backward, accumulated
            ratio = torch.exp(feats[s, e] @ (w - w0) - logp_old[s, e])
            per = torch.maximum(-adv[s, e] * ratio, -adv[s, e] * torch.clamp(ratio, 1 - EPS, 1 + EPS))
            (per / (ACCUM * PER_TREE)).backward()
        torch.nn.utils.clip_grad_norm_([w], CLIP)
        opt.step()
        opt.zero_grad()
    return w.detach()


def our_step(w0, feats, logp_old, adv, scale: float) -> torch.Tensor:
    w = torch.nn.Parameter(w0.clone())
    opt = _adamw(w)
    cfg = LossConfig(preset="flow_grpo", bounds={"eps": EPS}, aggregation={"scale": scale})
    for s in range(len(SIZES)):
        inputs = LossInputs(
            logp=(feats[s] @ (w - w0))[:, None],
            logp_old=logp_old[s, :, None],
            advantages=adv[s],
            mask=torch.ones(EDGES, 1, dtype=torch.bool),
        )
        policy_loss(inputs, cfg).loss.backward()
        torch.nn.utils.clip_grad_norm_([w], CLIP)
        opt.step()
        opt.zero_grad()
    return w.detach()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_scaled_mean_is_the_published_accumulated_step(seed):
    toy = _toy(seed)
    reference = published_step(*toy)
    moved = float((reference - toy[0]).abs().max())  # about 3e-5 over the 6 steps
    # equal up to our float32 log-ratio (policy_loss computes logp - logp_old in float32)
    torch.testing.assert_close(our_step(*toy, scale=1 / PER_TREE), reference, rtol=0, atol=1e-10)
    # the plain mean (scale 1) is clipped 218x earlier and leaves eps behind: a different trajectory
    assert float((our_step(*toy, scale=1.0) - reference).abs().max()) > 0.2 * moved


def test_scale_defaults_to_the_plain_mean_and_rejects_nonpositive():
    assert LossConfig(preset="flow_grpo").aggregation.settings == {}
    inputs = LossInputs(
        logp=torch.zeros(2, 1),
        logp_old=torch.zeros(2, 1),
        advantages=torch.ones(2),
        mask=torch.ones(2, 1, dtype=torch.bool),
    )
    with pytest.raises(ValueError, match=r"scale: must be a finite number > 0"):
        policy_loss(inputs, LossConfig(preset="flow_grpo", aggregation={"scale": 0.0}))
