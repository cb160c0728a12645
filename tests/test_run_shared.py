"""What the two trainers share lives once: the on-policy warning, the optimizer step, the method registry, and
the estimator needs the config checks and credit assignment read."""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path

import pytest
import torch

from flowgrpo.core import ESTIMATORS
from flowgrpo.distributed import Distributed
from flowgrpo.guards import GuardConfig, NonFiniteGuard, NonFiniteWarning
from flowgrpo.metrics import COUNTER_KEY, SHARED_KEYS, read_metrics, truncate_metrics
from flowgrpo.run import FirstPassCheck, OnPolicyRatioWarning, OptimConfig, OptimizerStep, build_optimizer


def test_one_on_policy_warning_for_both_trainers():
    import flowgrpo.t2i
    import flowgrpo.text

    assert flowgrpo.t2i.OnPolicyRatioWarning is flowgrpo.text.OnPolicyRatioWarning is OnPolicyRatioWarning


def test_first_pass_check_records_and_warns_past_the_tolerance():
    check = FirstPassCheck(enabled=True, tolerance=1e-4)
    check.observe(2e-5, 3)
    check.observe(1e-5, 2)
    record: dict = {}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check.report(record, "step 1", "suspects")
    assert record == {"check/first_pass_ratio_dev": 2e-5, "check/rows": 5}
    check.observe(1e-3, 1)
    with pytest.warns(OnPolicyRatioWarning, match="ON-POLICY CHECK FAILED at step 2"):
        check.report(record, "step 2", "suspects")
    off: dict = {}
    FirstPassCheck(enabled=False, tolerance=1e-4).report(off, "step 1", "")
    assert off == {}


def test_optimizer_step_clips_counts_and_zeroes():
    p = torch.nn.Parameter(torch.zeros(3))
    built = build_optimizer([p], OptimConfig(lr=0.1, max_grad_norm=1.0), 10, fused=False)
    optimizer, scheduler = built.optimizer, built.scheduler
    step = OptimizerStep([p], optimizer, 1.0, Distributed())
    step.begin()
    p.grad = torch.tensor([3.0, 4.0, 0.0])
    norm = step()
    assert norm == pytest.approx(5.0) and p.grad is None and step.total == 1
    assert step.metrics() == {
        "optimizer_steps": 1,
        "grad_norm": pytest.approx(5.0),
        "grad_norm_max": pytest.approx(5.0),
    }
    assert scheduler.get_last_lr() == [pytest.approx(0.1)] and not math.isnan(float(p.detach().sum()))


def test_optimizer_step_with_a_guard_never_steps_on_a_nan_gradient():
    p = torch.nn.Parameter(torch.ones(3))
    optimizer = build_optimizer([p], OptimConfig(lr=0.1), 10, fused=False).optimizer
    guard = NonFiniteGuard(GuardConfig(max_bad_updates=5), "step")
    step = OptimizerStep([p], optimizer, 1.0, Distributed(), guard=guard)
    step.begin()
    p.grad = torch.tensor([math.nan, 1.0, 0.0])
    assert math.isnan(step())
    assert torch.equal(p.detach(), torch.ones(3)) and p.grad is None and step.total == 0
    assert optimizer.state_dict()["state"] == {}  # no AdamW moment saw the NaN
    p.grad = torch.tensor([1.0, 1.0, 1.0])
    step()
    assert step.total == 1 and bool(torch.isfinite(p.detach()).all()) and not torch.equal(p.detach(), torch.ones(3))
    record: dict = {}
    with pytest.warns(NonFiniteWarning, match="1 optimizer step"):
        guard.end_update(record, 1, [p])
    assert record["guard/skipped_steps"] == 1 and record["guard/bad_streak"] == 1


def test_image_methods_are_registered_plugins():
    from flowgrpo.t2i import trainer  # noqa: F401  (imports the method modules)
    from flowgrpo.t2i.methods import METHODS, WRAPPERS

    assert METHODS.names() == [
        "awm",
        "diffusion_dpo",
        "grpo",
        "grpo_gardo",
        "nft",
        "nft_gardo",
        "reward_backprop",
        "sft",
    ]
    assert WRAPPERS.names() == ["adversarial"]


def test_estimators_declare_the_plan_they_read():
    planned = {n: ESTIMATORS.get(n).plan for n in ESTIMATORS.names() if ESTIMATORS.get(n).plan}
    assert planned == {
        "sibling": "branch_points",
        "turning_point": "probes",
        "value_anchored": "probes",
        "tree_depth": "tree",
        "egae": "probes",  # step values / potentials: probe rewards in the image trainer
        "spae": "probes",
    }
    for name in ESTIMATORS.names():  # per-step and node estimators cannot read any plan's final rewards
        entry = ESTIMATORS.get(name)
        assert bool(entry.plan) == bool({"step_rewards", "tree"} & entry.requires), name


# --- metrics.jsonl: one name per quantity, and one switch for the final model ------------------------------------

QUIET = ["progress=false", "checkpoint.every=0"]


def _image_run(out, save_final_model: bool) -> list[dict]:
    """One iteration of the smallest image run (tiny SD3, 1 prompt x 2 images, 3 steps)."""
    from flowgrpo.t2i import load_t2i_config, train_t2i

    root = Path(__file__).resolve().parents[1]
    cfg = load_t2i_config(
        root / "configs" / "t2i" / "tiny" / "flow_grpo.yaml",
        [
            f"output_dir={out}",
            "iterations=1",
            "prompts_per_iteration=1",
            "group_size=2",
            "sampler.num_steps=3",
            "eval.images_per_prompt=1",
            "artifacts.tensorboard=false",
            "artifacts.plot=false",
            f"checkpoint.save_final_model={str(save_final_model).lower()}",
            *QUIET,
        ],
    )
    return train_t2i(cfg)


def _text_run(out) -> list[dict]:
    from flowgrpo.text import load_text_config, train_text

    root = Path(__file__).resolve().parents[1]
    cfg = load_text_config(
        root / "configs" / "text" / "tiny_pattern.yaml",
        [f"output_dir={out}", "iterations=1", "checkpoint.save_final_model=false", *QUIET],
    )
    return train_text(cfg)


def test_both_trainers_write_the_same_names_for_the_same_quantities(tmp_path):
    _image_run(tmp_path / "image", False)
    _text_run(tmp_path / "text")
    image, text = (read_metrics(tmp_path / side / "metrics.jsonl") for side in ("image", "text"))
    assert len(image) == len(text) == 1
    for side, record, reward in (("image", image[0], "brightness"), ("text", text[0], "target_pattern")):
        missing = [k for k in (*SHARED_KEYS, f"rewards/{reward}/mean", f"rewards/{reward}/std") if k not in record]
        assert not missing, (side, missing)
        assert record[COUNTER_KEY] == 1 and record["nfe_nograd"] > 0 and record["nfe_grad"] > 0
        assert record["backward_passes"] > 0
        # the names these replaced, and per-scorer extras under `rewards/` only
        old = {"step", "time_step_s", "count/forward_nograd", "count/forward_grad", "ratio_mean"}
        assert not old & set(record), (side, old & set(record))
        assert not [k for k in record if k.startswith("reward/")], side
    # the image run's final model is off: no LoRA folder
    assert not (tmp_path / "image" / "lora").exists() and not (tmp_path / "image" / "lora_ema").exists()


def test_checkpoint_save_final_model_writes_the_image_lora(tmp_path):
    _image_run(tmp_path / "run", True)
    assert (tmp_path / "run" / "lora" / "pytorch_lora_weights.safetensors").is_file()


def test_truncate_reads_the_legacy_step_counter(tmp_path):
    """A text run's metrics.jsonl written before the counter was `iteration` still truncates on resume."""
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s}) + "\n" for s in range(1, 6)))
    truncate_metrics(path, 3)
    assert [r["step"] for r in read_metrics(path)] == [1, 2, 3]
