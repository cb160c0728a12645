"""NaN rewards are excluded and counted; a reward server that stays down stops the run loudly, and the
last checkpoint stays loadable."""

import threading
import time
from pathlib import Path

import pytest
import torch

from flowgrpo.checkpoint import latest_checkpoint, load_checkpoint
from flowgrpo.t2i import T2ITrainer, train_t2i
from reward_models import build_scorer, register
from reward_models.base import Scorer
from reward_models.remote import RemoteRewardError
from reward_models.serving import make_server


class _EveryThirdNaN(Scorer):
    name = "test_every_third_nan"

    def score_batch(self, images, prompts, metadata):
        value = images.tensor().float().mean(dim=(1, 2, 3))
        value[::3] = float("nan")
        return {self.key: value}


@register("test_every_third_nan")
def _build_every_third_nan(*, batch_size: int = 64) -> _EveryThirdNaN:
    """Brightness, NaN for every third image of a call (tests)."""
    return _EveryThirdNaN(batch_size=batch_size)


def test_nan_rewards_are_excluded_and_counted(recipe_config):
    history = train_t2i(recipe_config("flow_grpo", "iterations=2", "rewards=[{name: test_every_third_nan}]"))
    for record in history:
        n_images = record["images"]
        per_batch = 8  # one rollout batch = one prompt x 8 images, scored in one call
        expected = (n_images // per_batch) * len(range(0, per_batch, 3))
        assert record["rewards/nan_count"] == expected
        assert torch.isfinite(torch.tensor(record["reward_mean"]))
        assert record["edges/trained"] == (n_images - expected) * record["plan/trained_steps"]


def test_reward_server_down_stops_the_run_and_keeps_the_checkpoint(recipe_config):
    server = make_server(build_scorer("brightness"))
    server.serve_in_thread()
    cfg = recipe_config(
        "flow_grpo",
        "iterations=6",
        "checkpoint.every=1",
        "num_threads=1",
        f"rewards=[{{name: remote, url: '{server.url}', max_attempts: 2, backoff_s: 0.05, "
        f"max_backoff_s: 0.1, timeout_s: 2.0}}]",
    )
    trainer = T2ITrainer(cfg)
    ckpt_dir = Path(cfg.output_dir) / "checkpoints"

    def stop_after_two_checkpoints():
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            latest = latest_checkpoint(ckpt_dir)
            if latest is not None and latest.name >= "step_00000002":
                server.shutdown()
                server.server_close()
                return
            time.sleep(0.01)

    watcher = threading.Thread(target=stop_after_two_checkpoints, daemon=True)
    watcher.start()
    started = time.monotonic()
    with pytest.raises(RemoteRewardError):
        trainer.train()
    assert time.monotonic() - started < 300
    last = load_checkpoint(latest_checkpoint(ckpt_dir), restore_rng=False)
    assert 2 <= last.step < 6 and "policy" in last.tensors
