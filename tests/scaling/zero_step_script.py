"""Run by tests/scaling/test_zero_step.py in its own process (DeepSpeed sets up process-wide state): the
optimizer step of a one-process ZeRO-2 run against plain AdamW on the same model and losses."""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path
from typing import Iterator

import torch
import torch.distributed as dist

import flowgrpo  # noqa: F401  (first: the torchvision hook)
from flowgrpo.distributed import Distributed
from flowgrpo.guards import GuardConfig, NonFiniteGuard
from flowgrpo.run.optim import OptimizerStep
from flowgrpo.scaling.zero import ZeroConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import ds_shm  # noqa: E402  (tests/ds_shm.py: no JIT build of DeepSpeed's inference-only shm kernel)

ds_shm.skip_shm_kernel()


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    m[0].weight.requires_grad_(False)  # a frozen part beside the trained ones, as under LoRA
    return m


def losses(m: torch.nn.Module, step: int) -> Iterator[torch.Tensor]:
    """Three micro-batches (an update may take any number), each forward run just before its backward as in the
    trainers (ZeRO-3 accumulates a micro-batch's gradients at the next forward); step 1's hold a NaN."""
    for k in range(3):
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(10 * step + k))
        loss = m(x).pow(2).mean()
        yield loss * float("nan") if step == 1 and k == 1 else loss


def build(
    zero: bool, weights: list[torch.Tensor] | None = None
) -> tuple[OptimizerStep, torch.nn.Module, list, NonFiniteGuard]:
    m = model()
    params = [p for p in m.parameters() if p.requires_grad]
    if weights is not None:
        with torch.no_grad():
            for p, w in zip(params, weights):
                p.copy_(w)
    opt = torch.optim.AdamW(params, lr=0.05, weight_decay=0.01)
    d = Distributed(0, 1, zero=ZeroConfig(stage=STAGE)) if zero else Distributed()
    guard = NonFiniteGuard(GuardConfig())
    return OptimizerStep(params, opt, 0.5, d, guard=guard, module=m), m, params, guard


def train(step: OptimizerStep, module: torch.nn.Module, steps: range) -> None:
    for s in steps:
        for loss in losses(module, s):
            step.backward(loss)
        step()


def run(zero: bool) -> dict:
    step, m, params, guard = build(zero)
    train(step, m, range(3))
    if zero:
        step.checkpointed.gather()
    state = step.checkpointed.state_dict()
    return {
        "weights": [p.detach().flatten().tolist() for p in params],
        "moments": [[state["state"][i][k].flatten().tolist() for k in ("exp_avg", "exp_avg_sq")] for i in range(3)],
        "steps": [float(state["state"][i]["step"]) for i in range(3)],
        "norms": step.norms,
        "total": step.total,
        "skipped": guard.skipped_steps,
        "lr": state["param_groups"][0]["lr"],
    }


def resumed() -> dict:
    """A plain run's weights and AdamW state loaded into a ZeRO step, one more step: as the plain run's."""
    plain, m, params, _ = build(False)
    train(plain, m, range(3))
    saved = [p.detach().clone() for p in params]
    state = copy.deepcopy(plain.checkpointed.state_dict())  # AdamW's state_dict holds its live tensors
    train(plain, m, range(3, 4))
    zero, zm, zparams, _ = build(True)  # as a trainer resumes: the optimizer state, then the weights
    zero.checkpointed.load_state_dict(state)
    with torch.no_grad():
        for p, w in zip(zparams, saved):
            p.copy_(w)
    zero.weights_loaded()
    train(zero, zm, range(3, 4))
    return {
        "plain": [p.detach().flatten().tolist() for p in params],
        "zero": [p.detach().flatten().tolist() for p in zparams],
        "before": [w.flatten().tolist() for w in saved],
    }


STAGE = int(sys.argv[1]) if len(sys.argv) > 1 else 2  # ZeRO-3 partitions the frozen first weight (48 > 24 + 1)

if __name__ == "__main__":
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    initial = [p.detach().flatten().tolist() for p in model().parameters() if p.requires_grad]
    print(json.dumps({"plain": run(False), "zero": run(True), "resumed": resumed(), "initial": initial}))
    sys.stdout.flush()
