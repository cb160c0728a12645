"""The reward stage scores on worker threads, or (an iteration's last batch) in the thread that asks for the
result: the same values either way, and a scorer's error surfaces at `.result()` in both."""

from __future__ import annotations

import threading

import pytest
import torch

from flowgrpo.t2i.config import RewardConfig
from flowgrpo.t2i.reward_stage import RewardStage


def _decode_recording(threads: list):
    def decode(latents: torch.Tensor) -> torch.Tensor:
        threads.append(threading.current_thread().name)
        return latents[:, :3].sigmoid()

    return decode


@pytest.fixture
def stage():
    s = RewardStage([RewardConfig(name="brightness"), RewardConfig(name="colorfulness")])
    yield s
    s.close()


def test_inline_scoring_equals_the_worker_thread(stage):
    latents = torch.randn(4, 4, 8, 8, generator=torch.Generator().manual_seed(0))
    threads: list[str] = []
    args = (_decode_recording(threads), latents, ["a"] * 4, [{}] * 4, 2, 4)
    pooled = stage.submit(*args).result()
    inline = stage.submit(*args, inline=True)
    assert len(threads) == 1  # scored when asked for: the caller's reward wait, not its rollout
    assert torch.equal(inline.result().values, pooled.values) and inline.result().calls == pooled.calls == 2
    assert len(threads) == 2  # once
    assert threads[0].startswith("reward") and threads[1] == threading.current_thread().name


def test_an_inline_scoring_error_is_raised_at_result(stage):
    def broken(latents):
        raise RuntimeError("decoder fell over")

    future = stage.submit(broken, torch.zeros(2, 4, 8, 8), ["a", "b"], [{}, {}], 2, 2, inline=True)
    with pytest.raises(RuntimeError, match="decoder fell over"):
        future.result()
