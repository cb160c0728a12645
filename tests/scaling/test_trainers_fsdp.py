"""Both trainers under FSDP2 (the environment `accelerate launch --config_file configs/accelerate/fsdp2.yaml`
exports, fp32 on CPU with gloo): the same result as one process, and sharded checkpoints that resume on another
number of ranks.

Tolerances are measured, not guessed (as in tests/t2i/test_two_process.py): a sharded run sums the same float32
gradients in another order (each rank's micro-batches, then the reduce-scatter), so it is compared with the
one-process run against how far the same one-process run lands with other micro-batch sizes (the same sums in
other orders). Anything computed from the same weights (rollouts, rewards) must match to the last bit, which is
what shows that a checkpoint resumed on another world size holds exactly the weights it saved.
"""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pytest
import torch
from filelock import FileLock
from safetensors.torch import load_file

from flowgrpo.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.heavy

# what `accelerate launch` exports for configs/accelerate/fsdp2.yaml (tests/scaling/test_accelerate_configs.py
# checks the file), in fp32: the comparison is about reduction order, not bf16 rounding
FSDP_ENV = {
    "ACCELERATE_USE_FSDP": "true",
    "FSDP_VERSION": "2",
    "ACCELERATE_MIXED_PRECISION": "no",
    "FSDP_AUTO_WRAP_POLICY": "TRANSFORMER_BASED_WRAP",
    "FSDP_TRANSFORMER_CLS_TO_WRAP": "JointTransformerBlock,FluxTransformerBlock,FluxSingleTransformerBlock,Qwen2DecoderLayer",
    "FSDP_RESHARD_AFTER_FORWARD": "true",
    "FSDP_ACTIVATION_CHECKPOINTING": "true",
}
IMAGE = [
    "prompts_per_iteration=4", "rollout_prompts=1", "num_threads=1", "progress=false", "artifacts.tensorboard=false",
    "artifacts.plot=false", "loss.kl.coef=0.01", "train.mini_batches=2", "advantage.estimator.std_scope=batch",
    "optim.lr=0.03", "checkpoint.every=1", "eval.images_per_prompt=1",
]  # fmt: skip
# a 2-iteration run of each trainer, for the `accelerate launch` tests of each shipped config
BOTH_TRAINERS_LAUNCHED = pytest.mark.parametrize(
    "script,config,extra",
    [
        ("train_t2i.py", "configs/t2i/tiny/flow_grpo.yaml", ["iterations=2", "prompts_per_iteration=2"]),
        ("train_text.py", "configs/text/tiny_pattern.yaml", ["iterations=2"]),
    ],
    ids=["t2i", "text"],
)
# world-size invariant quantities of a record (the rollout, its rewards and advantages)
# (not nfe_nograd: a sharded rank's padding passes are forwards too, counted where they run)
ROLLOUT_KEYS = ("reward_mean", "reward_std", "adv/mean", "adv/std", "adv/abs_max", "edges/trained", "images",
                "rollout_nfe_nograd", "reward_calls")  # fmt: skip


@pytest.fixture
def launch(launch_ranks, monkeypatch, plain_runs_dir):
    """launch(script, args, world, sharded=True): `launch_ranks` with or without the FSDP2 environment;
    `launch.plain_runs`: the session's shared folder of finished one-process runs (for `_image`)."""

    def run(script: str, args: list[str], world: int, sharded: bool = True) -> None:
        with monkeypatch.context() as m:
            for key, value in FSDP_ENV.items():
                if sharded:
                    m.setenv(key, value)
                else:
                    m.delenv(key, raising=False)
            launch_ranks(script, args, world)

    run.plain_runs = plain_runs_dir  # type: ignore[attr-defined]
    return run


def _image(launch, out: Path, world: int, *extra: str, sharded: bool | int = True, recipe: str = "flow_grpo") -> Path:
    """Run scripts/train_t2i.py on `recipe` with IMAGE + `extra` in `world` processes (`sharded`: the caller's
    engine; False: plain processes) into `out`. A plain one-process run into a new folder (a result of its
    settings alone: no resume, nothing there before) is made once per session: the FSDP2 and ZeRO tests compare
    against the same reference runs from different xdist workers, so the first caller of a setting makes it under
    a file lock and the later ones (any worker) wait for it and copy it."""
    args = [str(ROOT / f"configs/t2i/tiny/{recipe}.yaml"), f"output_dir={out}", *IMAGE, *extra]
    reusable = world == 1 and sharded is False and not out.exists() and "resume=true" not in extra
    if not reusable:
        launch("train_t2i.py", args, world, sharded)
        return out
    key = hashlib.sha1("\0".join((recipe, *IMAGE, *extra)).encode()).hexdigest()[:16]
    done = launch.plain_runs / key
    with FileLock(str(done) + ".lock", timeout=1200):
        if not done.is_dir():
            launch("train_t2i.py", args, world, sharded)
            # a copy (the caller may write into its folder later: a resumed run), renamed into place only whole
            shutil.copytree(out, done.with_suffix(".partial"), dirs_exist_ok=True)
            done.with_suffix(".partial").rename(done)
            return out
    shutil.copytree(done, out)
    return out


def _lora(out: Path, name: str = "lora") -> dict[str, torch.Tensor]:
    return load_file(str(out / name / "pytorch_lora_weights.safetensors"))


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def _records(out: Path) -> list[dict]:
    return read_metrics(out / "metrics.jsonl")


def test_image_trainer_sharded_matches_one_process_and_resumes_across_world_sizes(launch, tmp_path):
    one_iter = ["iterations=1", "train.micro_batch_size=7"]
    plain = _image(launch, tmp_path / "plain", 1, *one_iter, sharded=False)
    # one sharded rank is the plain run: FSDP2 changes where the weights live, not one bit of the arithmetic
    one = _image(launch, tmp_path / "one", 1, *one_iter)
    for name in ("lora", "lora_ema"):
        assert _max_diff(_lora(one, name), _lora(plain, name)) == 0.0, name
    # the EMA export holds the EMA weights (as the checkpoint has them), not the policy's
    ema = load_file(str(plain / "checkpoints/step_00000001/tensors.ema.safetensors"))
    exported = {k.replace(".default.", ".", 1): v for k, v in ema.items()}
    assert _max_diff({f"transformer.{k}": v for k, v in exported.items()}, _lora(plain, "lora_ema")) == 0.0
    assert _max_diff(_lora(plain, "lora_ema"), _lora(plain)) > 0
    assert (one / "checkpoints/step_00000001/sharded").is_dir()
    assert not (plain / "checkpoints/step_00000001/sharded").exists()

    two = _image(launch, tmp_path / "two", 2, *one_iter)
    refs = [_image(launch, tmp_path / f"mb{m}", 1, "iterations=1", f"train.micro_batch_size={m}", sharded=False)
            for m in (1, 3)]  # fmt: skip
    spread = max(_max_diff(_lora(plain), _lora(r)) for r in refs)
    update = max(float(v.abs().max()) for k, v in _lora(plain).items() if "lora_B" in k)  # LoRA B starts at 0
    assert spread > 0 and update > 1000 * spread, (update, spread)  # a missing or doubled rank's gradient shows
    assert _max_diff(_lora(two), _lora(plain)) <= 2 * spread, (_max_diff(_lora(two), _lora(plain)), spread)
    r_plain, r_two = _records(plain)[0], _records(two)[0]
    for key in ROLLOUT_KEYS + ("optimizer_steps",):
        assert r_two[key] == r_plain[key], key

    # resume on another world size: iteration 2's rollouts come from the resumed weights, so they match the
    # uninterrupted run's to the last bit; its update differs only in reduction order
    two_iters = ["iterations=2", "train.micro_batch_size=7"]
    straight = {w: _image(launch, tmp_path / f"straight{w}", w, *two_iters) for w in (1, 2)}
    # the trained edges did not split evenly over the ranks: one ran zero-loss passes to keep in step
    assert sum(r["padding_passes"] for r in _records(straight[2])) > 0
    for saved_on, resumed_on, sharded in ((2, 1, True), (1, 2, True), (2, 1, False)):
        out = tmp_path / f"from{saved_on}to{resumed_on}{'' if sharded else '_plain'}"
        _image(launch, out, saved_on, *two_iters, "stop_after=1")
        _image(launch, out, resumed_on, *two_iters, "resume=true", sharded=sharded)
        want = straight[saved_on]
        got_rec, want_rec = _records(out), _records(want)
        assert [r["iteration"] for r in got_rec] == [1, 2]
        for key in ROLLOUT_KEYS:
            assert got_rec[1][key] == want_rec[1][key], (saved_on, resumed_on, key)
        for name in ("lora", "lora_ema"):
            diff = _max_diff(_lora(out, name), _lora(want, name))
            assert diff <= 4 * spread, (saved_on, resumed_on, name, diff, spread)


def test_a_model_without_the_listed_blocks_stops_in_one_line(launch_ranks, monkeypatch, tmp_path):
    for key, value in FSDP_ENV.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("FSDP_TRANSFORMER_CLS_TO_WRAP", "Qwen2DecoderLayer")
    args = [str(ROOT / "configs/t2i/tiny/flow_grpo.yaml"), f"output_dir={tmp_path}", *IMAGE]
    (code, err), *_ = launch_ranks("train_t2i.py", args, 1, check=False)
    assert code == 2 and "Traceback" not in err, err[-2000:]
    assert "JointTransformerBlock" in err and "fsdp_transformer_layer_cls_to_wrap" in err


def full_finetune_matches_one_process(launch, tmp_path: Path) -> Path:
    """A full fine-tune (with its frozen KL reference) on 2 ranks of `launch`'s engine and in one plain process:
    the exported `transformer/` folders load with diffusers and agree to 1e-4; the 2-rank run folder."""
    from diffusers import SD3Transformer2DModel

    full = ["iterations=1", "model.finetune=full", "optim.lr=1e-3", "train.micro_batch_size=7"]
    two = _image(launch, tmp_path / "full2", 2, *full)
    plain = _image(launch, tmp_path / "full1", 1, *full, sharded=False)
    exported = SD3Transformer2DModel.from_pretrained(two / "transformer")
    reference = SD3Transformer2DModel.from_pretrained(plain / "transformer")
    diffs = [
        float((a - b).abs().max()) for a, b in zip(exported.state_dict().values(), reference.state_dict().values())
    ]
    assert max(diffs) < 1e-4, max(diffs)  # Adam steps of 1e-3: a missed or doubled gradient moves far more
    return two


def test_image_methods_under_fsdp_on_two_ranks(launch, tmp_path):
    """DiffusionNFT (its old policy is a second adapter inside the sharded blocks), Adv-GRPO (a replicated
    discriminator beside the sharded policy) and a full fine-tune with its sharded frozen KL reference: each
    trains, saves and exports on 2 sharded ranks; the full fine-tune's folder loads with diffusers."""
    for recipe in ("diffusion_nft", "adv_grpo"):
        out = _image(launch, tmp_path / recipe, 2, "iterations=2", recipe=recipe)
        assert max(float(v.abs().max()) for k, v in _lora(out).items() if "lora_B" in k) > 0, recipe
        assert (out / "checkpoints/step_00000002/sharded").is_dir()
    two = full_finetune_matches_one_process(launch, tmp_path)
    assert (two / "transformer_ema").is_dir()


def test_text_trainer_sharded_matches_one_process(launch, tmp_path):
    def text(out: Path, world: int, micro: int, sharded: bool = True) -> dict[str, torch.Tensor]:
        args = [str(ROOT / "configs/text/tiny_pattern.yaml"), f"output_dir={out}", "progress=false", "iterations=1",
                f"train.micro_batch_size={micro}", "train.shared_prompt=false", "checkpoint.save_final_model=true"]  # fmt: skip
        launch("train_text.py", args, world, sharded)
        return load_file(str(out / "final" / "model.safetensors"))

    plain = text(tmp_path / "plain", 1, 4, sharded=False)
    two = text(tmp_path / "two", 2, 4)
    spread = max(_max_diff(plain, text(tmp_path / f"mb{m}", 1, m, sharded=False)) for m in (1, 16))
    assert 0 < spread and _max_diff(two, plain) <= 2 * spread, (_max_diff(two, plain), spread)
    r_plain, r_two = _records(tmp_path / "plain")[0], _records(tmp_path / "two")[0]
    assert r_two["reward_mean"] == r_plain["reward_mean"] and r_two["tokens/generated"] == r_plain["tokens/generated"]


@BOTH_TRAINERS_LAUNCHED
def test_accelerate_launch_with_the_shipped_fsdp2_file(tmp_path, script, config, extra):
    """The command docs/scaling.md gives, verbatim but for 2 CPU processes: accelerate's own launcher, the
    shipped configs/accelerate/fsdp2.yaml (bf16 compute, activation checkpointing), a sharded checkpoint."""
    out = accelerate_launch("fsdp2.yaml", script, config, extra, tmp_path)
    ckpt = sorted((out / "checkpoints").iterdir())[-1]
    assert len(list((ckpt / "sharded").glob("*.safetensors"))) == 2  # each rank wrote its own shards
    assert len(_records(out)) == 2


def accelerate_launch(file: str, script: str, config: str, extra: list[str], tmp_path: Path) -> Path:
    """`accelerate launch --config_file configs/accelerate/<file> --num_processes 2 scripts/<script> <config>`
    as a user types it; the run folder, after checking that it ran and printed one summary (rank 0's)."""
    import os
    import subprocess
    import sys

    out = tmp_path / "run"
    # the accelerate CLI imports transformers: on a CPU torch it needs the torchvision hook first (the trap in
    # pyproject.toml); on a GPU machine `accelerate launch ...` runs as is
    cli = "import sys, torchvision_cpu_hook; from accelerate.commands.accelerate_cli import main; sys.exit(main())"
    argv = [sys.executable, "-c", cli, "launch", "--config_file", str(ROOT / "configs/accelerate" / file),
            "--num_processes", "2", "--main_process_port", "0", str(ROOT / "scripts" / script), str(ROOT / config),
            f"output_dir={out}", "progress=false", *extra]  # fmt: skip
    # tests/deepspeed_cpu: its sitecustomize skips DeepSpeed's CPU shm kernel in ZeRO ranks (tests/ds_shm.py)
    hooks = os.pathsep.join([str(ROOT), str(ROOT / "tests"), str(ROOT / "tests" / "deepspeed_cpu")])
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": hooks}
    env = {k: v for k, v in env.items() if not k.startswith(("ACCELERATE_", "FSDP_"))}
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("metrics in") == 1  # one summary per run, from rank 0
    return out


def test_text_trainer_resumes_a_sharded_checkpoint_on_another_world_size(launch, tmp_path):
    """Saved on 2 sharded ranks, resumed on 1: step 2 generates from exactly the saved weights (the same
    tokens and rewards as the uninterrupted 2-rank run) and scores them to float32 rounding."""
    args = [str(ROOT / "configs/text/tiny_pattern.yaml"), "progress=false", "iterations=2", "checkpoint.every=1"]
    launch("train_text.py", [*args, f"output_dir={tmp_path / 'resumed'}", "stop_after=1"], 2)
    assert (tmp_path / "resumed/checkpoints/step_00000001/sharded").is_dir()
    launch("train_text.py", [*args, f"output_dir={tmp_path / 'resumed'}", "resume=true"], 1)
    launch("train_text.py", [*args, f"output_dir={tmp_path / 'straight'}"], 2)
    got, want = _records(tmp_path / "resumed")[1], _records(tmp_path / "straight")[1]
    assert got["iteration"] == want["iteration"] == 2
    for key in ("reward_mean", "tokens/generated", "completions/mean_length"):
        assert got[key] == want[key], key
    assert got["loss/policy"] == pytest.approx(want["loss/policy"], rel=1e-5)
