"""SPO's KL-adaptive forgetting factor (flowgrpo.core.spo, rho_type 'kl'): D and rho against the public code's
formulas (verl-recipe spo/spo_ray_trainer.py `_get_spo_rho`) in Python floats, and the tracker update with a
per-prompt rho."""

import pytest
import torch

from flowgrpo.core import AdvantageConfig, GroupBatch, compute_advantages
from flowgrpo.core.config import PartSpec
from flowgrpo.core.prompt_state import PromptTable
from flowgrpo.core.spo import kl_adaptive_rho, kl_drift


def test_drift_and_rho_follow_the_source():
    stored = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.5, 0.0]], dtype=torch.float64)
    current = torch.tensor([[-1.1, -1.8, -9.0], [-0.5, -0.5, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[True, True, False], [True, True, True]])
    D = kl_drift(stored, current, mask)
    assert D.tolist() == pytest.approx([(0.1 + 0.2) / 2, 0.0])
    rho = kl_adaptive_rho(torch.tensor([0.0, 0.005, 0.06, 1.0], dtype=torch.float64))
    want = [min(max(2 ** (-d / 0.06), 0.875), 0.96) for d in (0.0, 0.005, 0.06, 1.0)]
    assert rho.tolist() == pytest.approx(want) and want == pytest.approx([0.96, 2 ** (-1 / 12), 0.875, 0.875])
    assert kl_adaptive_rho(torch.tensor([0.01]), rho_min=0.0, rho_max=1.0).item() == pytest.approx(2 ** (-1 / 6))
    with pytest.raises(ValueError, match="d_half > 0"):
        kl_adaptive_rho(torch.tensor([0.1]), d_half=0.0)


def test_spo_forgets_each_prompt_by_its_own_rho():
    table = PromptTable(3)
    table["alpha"][:] = torch.tensor([2.0, 1.0, 0.0], dtype=torch.float64)
    table["beta"][:] = torch.tensor([2.0, 3.0, 0.0], dtype=torch.float64)
    batch = GroupBatch(rewards=torch.tensor([[1.0], [0.0]]), prompt_ids=torch.tensor([0, 1]), prompt_state=table)
    batch.drift = torch.tensor([0.0, 0.03])  # GroupBatch.drift: each prompt's D (the trainer fills it)
    cfg = AdvantageConfig(estimator=PartSpec(name="spo", settings={"rho_type": "kl", "rho_min": 0.5}))
    out = compute_advantages(batch, cfg)
    r1 = 2**-0.5
    assert table["alpha"][:2].tolist() == pytest.approx([0.96 * 2 + 1, r1 * 1 + 0])
    assert table["beta"][:2].tolist() == pytest.approx([0.96 * 2 + 0, r1 * 3 + 1])
    assert out.metrics["spo/rho"] == pytest.approx((0.96 + r1) / 2)
    plain = GroupBatch(rewards=torch.tensor([[1.0]]), prompt_ids=torch.tensor([2]), prompt_state=table)
    with pytest.raises(ValueError, match="rho_type 'kl' needs GroupBatch.drift"):
        compute_advantages(plain, cfg)
    with pytest.raises(ValueError, match="rho_type: must be one of 'constant', 'kl'"):
        compute_advantages(plain, AdvantageConfig(estimator=PartSpec(name="spo", settings={"rho_type": "adaptive"})))
