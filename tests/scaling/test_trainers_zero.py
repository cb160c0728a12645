"""Both trainers under DeepSpeed ZeRO-2 and ZeRO-3 (the environment `accelerate launch --config_file
configs/accelerate/deepspeed_zero2.yaml` / `deepspeed_zero3.yaml` exports; DeepSpeed's CPU accelerator with
gloo): the same result as one process, checkpoints in the plain format that resume on another world size with
or without ZeRO.

Tolerances as in tests/scaling/test_trainers_fsdp.py: the engine sums the same float32 gradients in another
order, so the weights are compared against the spread other micro-batch sizes give one process; what comes from
the same weights (rollouts, rewards, advantages) must match to the last bit.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from safetensors.torch import load_file

from .test_trainers_fsdp import (
    BOTH_TRAINERS_LAUNCHED,
    ROLLOUT_KEYS,
    ROOT,
    _image,
    _lora,
    _max_diff,
    _records,
    accelerate_launch,
    full_finetune_matches_one_process,
)

pytestmark = pytest.mark.heavy

# what `accelerate launch` exports for configs/accelerate/deepspeed_zero2.yaml (tests/scaling/test_sharded_launch.py
# reads the file through accelerate)
ZERO_ENV = {
    "ACCELERATE_USE_DEEPSPEED": "true",
    "ACCELERATE_DEEPSPEED_ZERO_STAGE": "2",
    "ACCELERATE_GRADIENT_ACCUMULATION_STEPS": "1",
    "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE": "none",
    "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE": "none",
    "ACCELERATE_MIXED_PRECISION": "no",
    "ACCELERATE_DEEPSPEED_ZERO3_INIT": "false",
}


@pytest.fixture
def launch(launch_ranks, monkeypatch, plain_runs_dir):
    """launch(script, args, world, zero=True): `launch_ranks` with or without the ZeRO-2 environment;
    `launch.plain_runs` as in tests/scaling/test_trainers_fsdp.py."""

    def run(script: str, args: list[str], world: int, zero: bool | int = True, check: bool = True):
        """`zero`: False (no DeepSpeed), True (ZeRO-2) or a stage."""
        stage = 2 if zero is True else int(zero)
        with monkeypatch.context() as m:
            for key in ("ACCELERATE_USE_FSDP", "FSDP_VERSION"):
                m.delenv(key, raising=False)
            for key, value in {**ZERO_ENV, "ACCELERATE_DEEPSPEED_ZERO_STAGE": str(stage)}.items():
                if zero:
                    m.setenv(key, value)
                else:
                    m.delenv(key, raising=False)
            return launch_ranks(script, args, world, check=check)

    run.plain_runs = plain_runs_dir  # type: ignore[attr-defined]
    return run


def test_image_trainer_zero2_matches_one_process_and_resumes_across_world_sizes(launch, tmp_path):
    one_iter = ["iterations=1", "train.micro_batch_size=7"]
    plain = _image(launch, tmp_path / "plain", 1, *one_iter, sharded=False)
    two = _image(launch, tmp_path / "two", 2, *one_iter)
    refs = [_image(launch, tmp_path / f"mb{m}", 1, "iterations=1", f"train.micro_batch_size={m}", sharded=False)
            for m in (1, 3)]  # fmt: skip
    spread = max(_max_diff(_lora(plain), _lora(r)) for r in refs)
    update = max(float(v.abs().max()) for k, v in _lora(plain).items() if "lora_B" in k)  # LoRA B starts at 0
    assert spread > 0 and update > 1000 * spread, (update, spread)  # a missing or doubled rank's gradient shows
    for name in ("lora", "lora_ema"):
        assert _max_diff(_lora(two, name), _lora(plain, name)) <= 2 * spread, name
    r_plain, r_two = _records(plain)[0], _records(two)[0]
    for key in ROLLOUT_KEYS + ("optimizer_steps",):
        assert r_two[key] == r_plain[key], key
    assert abs(r_two["grad_norm"] - r_plain["grad_norm"]) <= 1e-4 * r_plain["grad_norm"]  # DeepSpeed's norm
    # the checkpoint is the plain format: the same AdamW moments, gathered from both ranks' partitions
    name = "checkpoints/step_00000001/optim.policy.safetensors"
    moments_plain, moments_two = load_file(str(plain / name)), load_file(str(two / name))
    assert moments_plain.keys() == moments_two.keys()
    for key, value in moments_plain.items():
        scale = float(value.abs().max()) or 1.0
        assert float((moments_two[key] - value).abs().max()) <= 1e-3 * scale, key

    # resume on another world size, from and to a run without ZeRO: iteration 2's rollouts come from the
    # resumed weights (DeepSpeed's fp32 master copy included), so they match the uninterrupted run's to the bit
    two_iters = ["iterations=2", "train.micro_batch_size=7"]
    # the uninterrupted run of each saving set-up: 2 ZeRO ranks, 1 plain process
    straight = {2: _image(launch, tmp_path / "straight2", 2, *two_iters),
                1: _image(launch, tmp_path / "straight1", 1, *two_iters, sharded=False)}  # fmt: skip
    assert sum(r["padding_passes"] for r in _records(straight[2])) > 0  # uneven edges: zero-loss backward passes
    for saved_on, resumed_on in ((2, 1), (1, 2)):
        out = tmp_path / f"from{saved_on}to{resumed_on}"
        _image(launch, out, saved_on, *two_iters, "stop_after=1", sharded=saved_on == 2)
        _image(launch, out, resumed_on, *two_iters, "resume=true", sharded=resumed_on == 2)
        want = straight[saved_on]
        got_rec, want_rec = _records(out), _records(want)
        assert [r["iteration"] for r in got_rec] == [1, 2]
        for key in ROLLOUT_KEYS:
            assert got_rec[1][key] == want_rec[1][key], (saved_on, resumed_on, key)
        for name in ("lora", "lora_ema"):
            diff = _max_diff(_lora(out, name), _lora(want, name))
            assert diff <= 4 * spread, (saved_on, resumed_on, name, diff, spread)


def test_image_methods_under_zero2_on_two_ranks(launch, tmp_path):
    """DiffusionNFT (its old policy, a second adapter, outside the engine's optimizer), Adv-GRPO (its own
    discriminator optimizer beside the engine) and a full fine-tune with its frozen KL reference."""
    for recipe in ("diffusion_nft", "adv_grpo"):
        out = _image(launch, tmp_path / recipe, 2, "iterations=2", recipe=recipe)
        assert max(float(v.abs().max()) for k, v in _lora(out).items() if "lora_B" in k) > 0, recipe
        assert sum(r["optimizer_steps"] for r in _records(out)) > 0, recipe  # Adv-GRPO: 1 discriminator-only iteration
        assert (out / "checkpoints/step_00000002/optim.policy.safetensors").is_file()
    full_finetune_matches_one_process(launch, tmp_path)


def test_text_trainer_zero2_matches_one_process_and_resumes_without_zero(launch, tmp_path):
    def text(out: Path, world: int, micro: int, zero: bool = True, *extra: str) -> dict:
        args = [str(ROOT / "configs/text/tiny_pattern.yaml"), f"output_dir={out}", "progress=false", "iterations=1",
                f"train.micro_batch_size={micro}", "checkpoint.save_final_model=true", *extra]  # fmt: skip
        launch("train_text.py", args, world, zero)
        return load_file(str(out / "final" / "model.safetensors"))

    plain = text(tmp_path / "plain", 1, 4, False)
    two = text(tmp_path / "two", 2, 4)
    spread = max(_max_diff(plain, text(tmp_path / f"mb{m}", 1, m, False)) for m in (1, 16))
    assert 0 < spread and _max_diff(two, plain) <= 2 * spread, (_max_diff(two, plain), spread)
    r_plain, r_two = _records(tmp_path / "plain")[0], _records(tmp_path / "two")[0]
    assert r_two["reward_mean"] == r_plain["reward_mean"] and r_two["tokens/generated"] == r_plain["tokens/generated"]

    # saved on 2 ZeRO ranks, resumed on one plain process: step 2 generates from exactly the saved weights
    args = [str(ROOT / "configs/text/tiny_pattern.yaml"), "progress=false", "iterations=2", "checkpoint.every=1"]
    launch("train_text.py", [*args, f"output_dir={tmp_path / 'resumed'}", "stop_after=1"], 2)
    launch("train_text.py", [*args, f"output_dir={tmp_path / 'resumed'}", "resume=true"], 1, False)
    launch("train_text.py", [*args, f"output_dir={tmp_path / 'straight'}"], 2)
    got, want = _records(tmp_path / "resumed")[1], _records(tmp_path / "straight")[1]
    for key in ("reward_mean", "tokens/generated", "completions/mean_length"):
        assert got[key] == want[key], key
    assert got["loss/policy"] == pytest.approx(want["loss/policy"], rel=1e-5)


def test_zero3_lora_partitions_the_base_and_matches_one_process(launch, tmp_path):
    """ZeRO-3 partitions a LoRA run's frozen base; the LoRA weights stay whole. Image side: 2 ranks against one
    plain process (rollouts to the bit: ZeRO-3 runs with torch's own linear), resumed on 1 plain process;
    DiffusionNFT's old-policy adapter; a full fine-tune refused in one line. Text side: 2 ranks against one
    process (Adam's eps raised so that a gradient at rounding level cannot flip a first step's sign)."""
    one_iter = ["iterations=1", "train.micro_batch_size=7"]
    plain = _image(launch, tmp_path / "plain", 1, *one_iter, sharded=False)
    ref = _image(launch, tmp_path / "mb3", 1, "iterations=1", "train.micro_batch_size=3", sharded=False)
    spread = _max_diff(_lora(plain), _lora(ref))
    two_iters = ["iterations=2", "train.micro_batch_size=7"]
    out = tmp_path / "resumed"
    _image(launch, out, 2, *two_iters, "stop_after=1", sharded=3)
    # its first iteration is a 1-iteration run's (the default constant LR schedule does not depend on
    # `iterations`): the 2 ZeRO-3 ranks' step-1 weights and iteration-1 rollout against the plain process's
    saved = load_file(str(out / "checkpoints/step_00000001/tensors.policy.safetensors"))
    two = {f"transformer.{k.replace('.default.', '.', 1)}": v for k, v in saved.items()}  # the export's names
    assert spread > 0 and _max_diff(two, _lora(plain)) <= 2 * spread, (_max_diff(two, _lora(plain)), spread)
    for key in ROLLOUT_KEYS:
        assert _records(out)[0][key] == _records(plain)[0][key], key
    _image(launch, out, 1, *two_iters, "resume=true", sharded=False)
    straight = _image(launch, tmp_path / "straight", 2, *two_iters, sharded=3)
    for key in ROLLOUT_KEYS:
        assert _records(out)[1][key] == _records(straight)[1][key], key
    assert _max_diff(_lora(out), _lora(straight)) <= 4 * spread

    nft = _image(launch, tmp_path / "nft", 2, "iterations=2", recipe="diffusion_nft", sharded=3)
    assert max(float(v.abs().max()) for k, v in _lora(nft).items() if "lora_B" in k) > 0
    args = [str(ROOT / "configs/t2i/tiny/flow_grpo.yaml"), f"output_dir={tmp_path / 'full'}", "model.finetune=full"]
    (code, err), *_ = launch("train_t2i.py", args, 1, zero=3, check=False)
    assert code == 2 and "Traceback" not in err and "fsdp2.yaml" in err and "full fine-tune" in err, err[-2000:]

    def text(name: str, world: int, micro: int, zero: bool | int) -> dict:
        args = [str(ROOT / "configs/text/tiny_pattern.yaml"), f"output_dir={tmp_path / name}", "progress=false",
                "iterations=1", f"train.micro_batch_size={micro}", "checkpoint.save_final_model=true",
                "model.lora.enabled=true", "optim.lr=0.05", "optim.eps=1e-4", "train.shared_prompt=false"]  # fmt: skip
        launch("train_text.py", args, world, zero)
        return load_file(str(tmp_path / name / "final" / "adapter_model.safetensors"))

    t_plain, t_two = text("t_plain", 1, 4, False), text("t_two", 2, 4, 3)
    t_spread = _max_diff(t_plain, text("t_mb1", 1, 1, False))
    assert 0 < t_spread and _max_diff(t_two, t_plain) <= 2 * t_spread, (_max_diff(t_two, t_plain), t_spread)
    r_plain, r_two = _records(tmp_path / "t_plain")[0], _records(tmp_path / "t_two")[0]
    assert r_two["reward_mean"] == r_plain["reward_mean"] and r_two["tokens/generated"] == r_plain["tokens/generated"]


@BOTH_TRAINERS_LAUNCHED
def test_accelerate_launch_with_the_shipped_zero2_file(tmp_path, script, config, extra):
    """The command docs/scaling.md gives, for 2 CPU processes: accelerate's launcher with the shipped
    configs/accelerate/deepspeed_zero2.yaml; checkpoints in the plain format."""
    out = accelerate_launch("deepspeed_zero2.yaml", script, config, extra, tmp_path)
    assert len(_records(out)) == 2
    assert (out / "checkpoints" / "step_00000002" / "optim.policy.safetensors").is_file()
