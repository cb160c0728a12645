"""The shared update loop (flowgrpo.run.update): the order every method's update keeps, on fakes that record it."""

from __future__ import annotations

import torch

from flowgrpo.run.ratio_check import FirstPassCheck
from flowgrpo.run.update import MiniBatch, MicroLoss, pass_order, run_update


class Events:
    def __init__(self) -> None:
        self.log: list[str] = []
        self.norms: list[float] = []

    def backward(self, loss: torch.Tensor) -> None:
        self.log.append(f"backward {float(loss):g}")

    def __call__(self) -> float:
        self.log.append("step")
        return 0.0


class Dist:
    """One rank of a lockstep run whose busiest rank has `busiest` micro-batches in every mini-batch."""

    def __init__(self, busiest: int = 0) -> None:
        self.busiest, self.active = busiest, False

    def passes_to_pad(self, passes: int) -> int:
        return max(self.busiest - passes, 0)


def test_order_padding_first_one_step_per_mini_batch_check_before_the_first_step():
    events, seen = Events(), []

    def micro_loss(micro, norm, on_policy):
        seen.append((micro, norm, on_policy))
        return MicroLoss(torch.tensor(float(micro)), {"clip/frac": 0.5, "loss/policy": 1.0}, 2, (micro / 10, 2))

    passes = [[MiniBatch([1, 2], "n0"), MiniBatch([3], "n1")], [MiniBatch([4], "n2")]]
    check = FirstPassCheck(True, 1.0)
    result = run_update(passes, micro_loss, lambda norm: torch.tensor(7.0), events, Dist(busiest=2), check)
    assert events.log == [
        "backward 1", "backward 2", "step",  # mini-batch 1: this rank is the busiest
        "backward 0", "backward 3", "step",  # mini-batch 2: one padding pass first, its loss zeroed
        "backward 0", "backward 4", "step",
    ]  # fmt: skip
    assert [s[2] for s in seen] == [True, True, False, False]  # on policy until the first optimizer step
    assert [s[1] for s in seen] == ["n0", "n0", "n1", "n2"]  # each micro-batch gets its mini-batch's normaliser
    assert (check.deviation, check.rows) == (0.2, 4)  # only the first mini-batch's micro-batches are checked
    assert (result.backward_passes, result.padding_passes) == (4, 2)
    out = result.metrics.result(optimizer_steps=3)
    assert out["clip/frac"] == 0.5 and out["loss/policy"] == 4.0 / 3  # losses: summed, averaged per step


def test_a_method_without_metrics_or_check():
    events = Events()
    result = run_update(
        [[MiniBatch([1]), MiniBatch([])]], lambda m, n, p: MicroLoss(torch.tensor(1.0)), None, events, Dist(), None
    )
    assert events.log == ["backward 1", "step", "step"]  # an empty mini-batch still steps (every rank alike)
    assert result.metrics.result(2) == {}


def test_pass_order_is_seeded_by_seed_iteration_and_epoch():
    a = pass_order(10, seed=3, iteration=5, epoch=1, shuffle=True)
    assert torch.equal(a, pass_order(10, seed=3, iteration=5, epoch=1, shuffle=True))
    assert not torch.equal(a, pass_order(10, seed=3, iteration=6, epoch=1, shuffle=True))
    assert sorted(a.tolist()) == list(range(10))
    assert torch.equal(pass_order(4, 3, 5, 1, shuffle=False), torch.arange(4))
