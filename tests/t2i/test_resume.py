"""Exact resume: a run killed mid-way and resumed ends with weights identical to an uninterrupted run."""

from pathlib import Path

import pytest
import torch

from flowgrpo.checkpoint import latest_checkpoint
from flowgrpo.metrics import read_metrics
from flowgrpo.t2i import T2ITrainer, train_t2i

ROOT = Path(__file__).resolve().parents[2]


def _final_tensors(run_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    path = latest_checkpoint(run_dir / "checkpoints")
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        if f.name != "rng.safetensors":
            out.update({f"{f.stem}/{k}": v for k, v in load_file(f).items()})
    return out


def _assert_identical(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


# several optimizer steps per iteration, KL to the reference, EMA, a cosine schedule with warmup
COMMON = [
    "iterations=5",
    "checkpoint.every=1",
    "checkpoint.keep_last=10",
    "train.inner_epochs=2",
    "train.mini_batches=2",
    "train.micro_batch_size=12",
    "loss.kl.coef=0.01",
    "optim.schedule=cosine",
    "optim.warmup_steps=1",
    "num_threads=1",
    "eval.every=2",
]


# the published FLUX runs' grid, decoding and per-sample random trained steps (redrawn identically on resume)
PUBLISHED_FLUX = [
    "sampler.schedule={name: time_shift, shift: 3.0, integer_timesteps: true}",
    "sampler.decode=last_x0",
    "plan={name: full_sde, train_fraction: 1.0}",
    "edges.per_sample_fraction=0.6",
    "edges.exclude_last=true",
]

# Flow-GRPO's EMA: warm-up decay counted in optimizer steps, two updates per step (restored from the step count)
PUBLISHED_EMA = ["ema={decay: 0.9, update_every: 2, schedule: flow_grpo, updates_per_step: 2}"]
# Adv-GRPO's: discriminator iterations advance the EMA's clock (saved in the checkpoint)
ADV_EMA = ["ema={decay: 0.9, update_every: 2, schedule: flow_grpo, updates_per_step: 2, count_idle_iterations: true}"]
VARIANTS = {"published": PUBLISHED_FLUX, "ema": PUBLISHED_EMA, "ema_idle": ADV_EMA}


@pytest.mark.parametrize(
    "recipe", ["flow_grpo", "diffusion_nft", "branchgrpo", "dance_grpo+published", "flow_grpo+ema", "adv_grpo+ema_idle"]
)
def test_stop_and_resume_in_new_trainer_is_bit_identical(recipe_config, recipe):
    recipe, _, variant = recipe.partition("+")
    extra = (
        COMMON
        if recipe != "diffusion_nft"
        else [c for c in COMMON if not c.startswith("loss.kl")] + ["nft.kl_coef=0.001"]
    )
    extra = extra + VARIANTS.get(variant, [])
    full = train_t2i(recipe_config(recipe, *extra, name="uninterrupted"))
    first = train_t2i(recipe_config(recipe, *extra, "stop_after=2", name="interrupted"))
    assert [r["iteration"] for r in first] == [1, 2]
    torch.manual_seed(12345)  # the resumed process starts from an unrelated RNG state
    resumed = T2ITrainer(recipe_config(recipe, *extra, "resume=true", name="interrupted"))
    assert resumed.iteration == 2
    rest = resumed.train()
    assert [r["iteration"] for r in rest] == [3, 4, 5]
    _assert_identical(
        _final_tensors(Path(resumed.cfg.output_dir).parent / "uninterrupted"),
        _final_tensors(Path(resumed.cfg.output_dir)),
    )
    assert [r["reward_mean"] for r in first + rest] == [r["reward_mean"] for r in full]
    assert [r["iteration"] for r in read_metrics(Path(resumed.cfg.output_dir) / "metrics.jsonl")] == [1, 2, 3, 4, 5]


def test_sigkill_then_resume_is_bit_identical(recipe_config, tmp_path, kill_after_first_checkpoint):
    """A real training process killed with SIGKILL once it has written a checkpoint, resumed by this one."""
    overrides = [
        "iterations=5",
        "checkpoint.every=1",
        "checkpoint.keep_last=3",
        "num_threads=1",
        "progress=false",
        "artifacts.tensorboard=false",
        "artifacts.plot=false",
    ]
    run_dir = tmp_path / "killed"
    killed_at = kill_after_first_checkpoint(
        "train_t2i.py", [str(ROOT / "configs/t2i/tiny/flow_grpo.yaml"), *overrides], run_dir, timeout=300
    )
    assert killed_at < 5

    torch.manual_seed(987)
    trainer = T2ITrainer(recipe_config("flow_grpo", *overrides, "resume=true", name="killed"))
    assert trainer.iteration == killed_at
    trainer.train()
    assert latest_checkpoint(run_dir / "checkpoints").name == "step_00000005"
    reference = recipe_config("flow_grpo", *overrides, name="reference")
    train_t2i(reference)
    _assert_identical(_final_tensors(Path(reference.output_dir)), _final_tensors(run_dir))
    assert [r["iteration"] for r in read_metrics(run_dir / "metrics.jsonl")] == [1, 2, 3, 4, 5]
