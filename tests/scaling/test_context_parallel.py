"""Context parallelism (diffusers' Ulysses) composed with FSDP2: a tiny Wan transformer on 2 gloo ranks against
one process, the image trainer under it (a tiny Wan Flow-GRPO step on 2 and 4 ranks against 1 and 2 processes; its
checkpoint resumed on the same ranks and on one process without context parallelism), the settings' checks, the
(dp_shard, ring, ulysses) rank layout, and the video memory table."""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from flowgrpo.metrics import read_metrics

from flowgrpo.scaling import context_parallel as cpm
from flowgrpo.scaling import video_memory as vm
from flowgrpo.scaling.context_parallel import ContextParallelSettings as CP


def _check_ranks(out_dir, world: int, groups: int) -> None:
    ranks = [json.loads((out_dir / f"cp_rank{r}.json").read_text()) for r in range(world)]
    per_group = world // groups
    assert [r["data_index"] for r in ranks] == [k // per_group for k in range(world)]  # consecutive groups
    for r in ranks:
        assert r["sharded"] and r["lora_params"] == 32  # FSDP2 shards, LoRA attached
        assert r["tokens_seen"] * per_group == r["tokens_full"]  # each rank's blocks hold its share of the sequence
        # Ulysses exchanges heads, so each attention sees every token: the output is the one-process output to
        # float32 rounding; FSDP2's reduce-scatter sums the gradients over the token shares and the groups' samples
        assert r["out_max_abs_diff"] <= 1e-6 * r["out_scale"]
        worst = max(r["grad_max_abs_diff"].values())
        assert worst <= 1e-6 * r["grad_scale"], sorted(r["grad_max_abs_diff"].items(), key=lambda kv: -kv[1])[:3]
        # ring attention needs a kernel that returns the log-sum-exp (CUDA backends): refused here, naming them
        assert "needs an attention backend" in r["ring_error"] and "_native_cudnn" in r["ring_error"]


def test_ulysses_with_fsdp2_on_two_gloo_ranks_equals_one_process(launch_ranks, tmp_path):
    launch_ranks("../tests/scaling/cp_ranks.py", [str(tmp_path)], world=2, timeout=300)
    _check_ranks(tmp_path, world=2, groups=1)


def test_degree_must_divide_world_size_and_sequence_and_heads():
    assert cpm.world_problem(CP(ulysses=2, ring=2), 8) is None
    assert "valid degrees: [1, 2, 3, 6]" in cpm.world_problem(CP(ulysses=4), 6)
    assert cpm.shape_problem(CP(ulysses=8), vm.latent_tokens(81, 720, 1280, 4, 8, 2), heads=40) is None
    assert "50546 tokens" in cpm.shape_problem(CP(ulysses=4), 50546, heads=16)
    assert "valid: [1, 2, 4, 5, 8, 10, 20, 40]" in cpm.shape_problem(CP(ulysses=16), 75600, heads=40)
    assert cpm.wan_tokens(81, 480, 832) == 21 * 30 * 52


def test_a_context_parallel_group_is_consecutive_ranks_sharing_one_data_index():
    cp = CP(ulysses=2, ring=2)
    coords = [cpm.data_parallel_coords(rank, 8, cp) for rank in range(8)]
    assert coords == [(0, 2)] * 4 + [(1, 2)] * 4  # ranks 0-3 take the samples of data index 0
    with pytest.raises(cpm.ContextParallelError, match="must divide the world size 6"):
        cpm.data_parallel_coords(0, 6, cp)


def test_the_trainer_split_is_per_group_under_context_parallelism():
    """Distributed's per-rank split becomes per group: both ranks of a group run the same batches, localize to
    the same edges, and take part in every forward (lockstep, gathered evaluation)."""
    from flowgrpo.config import ConfigError
    from flowgrpo.distributed import Distributed

    ranks = [Distributed(rank, 4, context_parallel=CP(ulysses=2)) for rank in range(4)]
    assert [d.my_chunks(4) for d in ranks] == [[0, 2], [0, 2], [1, 3], [1, 3]]
    nodes = torch.arange(4 * 3)  # 4 batches of 3 nodes: batch 1 and 3 on group 1, in that order
    mine, local = ranks[3].localize(nodes, 3)
    assert mine.tolist() == [False] * 3 + [True] * 3 + [False] * 3 + [True] * 3 and local.tolist() == list(range(6))
    assert all(d.lockstep and d.gathers_weights and d.cp_degree == 2 for d in ranks)
    plain = Distributed(3, 4, context_parallel=CP())  # degree 1: the per-rank split, unchanged
    assert plain.my_chunks(4) == [3] and not plain.lockstep and plain.cp_degree == 1
    with pytest.raises(ConfigError, match="must divide the world size 4; valid degrees: \\[1, 2, 4\\]"):
        Distributed(0, 4, context_parallel=CP(ulysses=3))


def test_config_refuses_what_cannot_run_in_one_line(monkeypatch):
    from flowgrpo.t2i.config import ImageModelConfig, load_t2i_config

    assert not ImageModelConfig(tiny=True, family="wan").context_parallel.enabled
    assert ImageModelConfig(tiny=True, family="wan", context_parallel={"ulysses": 2}).context_parallel.degree == 2
    with pytest.raises(ValueError, match="needs a video family"):
        ImageModelConfig(tiny=True, family="sd3", context_parallel={"ulysses": 2})
    with pytest.raises(ValueError, match="greater than or equal to 1"):
        ImageModelConfig(tiny=True, family="wan", context_parallel={"ring": 0})
    recipe = str(ROOT / "configs/t2i/tiny/wan_flow_grpo.yaml")
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(ValueError, match="must divide the world size 1; valid degrees: \\[1\\]"):
        load_t2i_config(recipe, ["model.context_parallel.ulysses=2"])
    monkeypatch.setenv("WORLD_SIZE", "4")  # 2 groups of 2: one rollout batch cannot feed both
    with pytest.raises(ValueError, match="1 rollout batches must divide evenly over the 2 context-parallel groups"):
        load_t2i_config(recipe, ["model.context_parallel.ulysses=2", "prompts_per_iteration=1"])
    assert load_t2i_config(recipe, ["model.context_parallel.ulysses=4", "prompts_per_iteration=1"])
    with pytest.raises(ValueError, match="does not run with method diffusion_dpo"):
        load_t2i_config(recipe, ["model.context_parallel.ulysses=2", "method=diffusion_dpo"])


def test_a_resume_may_change_the_context_parallel_layout_and_nothing_else_of_the_model():
    """The degree must divide the world size, so a resume on other ranks changes it (the test below runs one)."""
    from flowgrpo.checkpoint import check_resume_config
    from flowgrpo.config import ConfigError

    saved = {"model": {"family": "wan", "lora": {"rank": 8}, "context_parallel": {"ulysses": 2, "ring": 1}}}
    check_resume_config({"model": {**saved["model"], "context_parallel": {"ulysses": 1, "ring": 1}}}, saved, set())
    with pytest.raises(ConfigError, match="model.lora.rank: 8 in the checkpoint, 4 now"):
        check_resume_config({"model": {**saved["model"], "lora": {"rank": 4}}}, saved, set())
    check_resume_config({"model": {**saved["model"], "lora": {"rank": 4}}}, saved, {"model.lora"})  # a dotted key


# --- the image trainer under context parallelism ---------------------------------------------------------------

ROOT = Path(__file__).resolve().parents[2]
# what `accelerate launch --config_file configs/accelerate/fsdp2.yaml --fsdp_transformer_layer_cls_to_wrap
# WanTransformerBlock` exports (docs/scaling.md), in fp32: the comparison is about the split, not bf16 rounding
FSDP_WAN_ENV = {
    "ACCELERATE_USE_FSDP": "true",
    "FSDP_VERSION": "2",
    "ACCELERATE_MIXED_PRECISION": "no",
    "FSDP_AUTO_WRAP_POLICY": "TRANSFORMER_BASED_WRAP",
    "FSDP_TRANSFORMER_CLS_TO_WRAP": "WanTransformerBlock",
    "FSDP_RESHARD_AFTER_FORWARD": "true",
    "FSDP_ACTIVATION_CHECKPOINTING": "true",
}
# one tiny Wan Flow-GRPO iteration (5 frames at 32 x 32: 2 latent frames x 2 x 2 = 8 tokens, 2 heads), a KL term.
# Adam's eps 1.0 makes its first step lr * g / (|g| + 1), about lr * g: the LoRA weights after the step are a
# linear read-out of the gradient, so a gradient counted twice (a group's ranks each adding the whole sample's)
# or half (a missing token share) shows as a factor 2, not hidden by Adam's sign-like first step
WAN_STEP = [
    "iterations=1", "num_threads=1", "progress=false", "artifacts.tensorboard=false", "artifacts.plot=false",
    "checkpoint.every=0", "loss.kl.coef=0.01", "optim.eps=1.0", "train.micro_batch_size=4", "sampler.num_steps=3",
    "group_size=4", "eval.images_per_prompt=1",
]  # fmt: skip
# a record's quantities that do not depend on the launch (rollout, rewards, advantages, counts of work)
SAME_KEYS = ("reward_mean", "reward_std", "adv/mean", "adv/std", "adv/abs_max", "edges/trained", "images",
             "rollout_nfe_nograd", "reward_calls", "nfe_grad", "backward_passes")  # fmt: skip
# relative to the largest LoRA update: float32 sums of the token shares and samples in another order
LORA_RTOL = 1e-5


def _wan_run(launch_ranks, monkeypatch, out: Path, world: int, *extra: str, sharded: bool = True) -> Path:
    with monkeypatch.context() as m:
        for key, value in FSDP_WAN_ENV.items():
            m.setenv(key, value) if sharded else m.delenv(key, raising=False)
        args = [str(ROOT / "configs/t2i/tiny/wan_flow_grpo.yaml"), f"output_dir={out}", *WAN_STEP, *extra]
        launch_ranks("train_t2i.py", args, world, timeout=300)
    return out


def _lora_at(run: Path, step: int) -> dict[str, torch.Tensor]:
    """The policy's LoRA weights in a checkpoint of `run`, whole (a sharded run's shards stitched in this process)
    and named as the final export names them."""
    from torch.distributed.checkpoint import load
    from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageReader

    from flowgrpo.checkpoint import SHARDED, checkpoint_name, load_checkpoint

    folder = run / "checkpoints" / checkpoint_name(step)
    shards: dict[str, torch.Tensor] = {}
    if (folder / SHARDED).is_dir():
        reader = HuggingFaceStorageReader(str(folder / SHARDED))
        meta = reader.read_metadata().state_dict_metadata
        shards = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in meta.items()
                  if k.startswith("tensors.policy/")}  # fmt: skip
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.simplefilter("ignore", UserWarning)
            load(shards, storage_reader=reader, no_dist=True)
    policy = load_checkpoint(folder, restore_rng=False, shards=shards).tensors["policy"]
    return {f"transformer.{k.replace('.default.', '.', 1)}": v for k, v in policy.items() if "lora_" in k}


def _lora_diff(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    """The largest LoRA difference relative to the largest LoRA update (LoRA B starts at 0)."""
    assert got.keys() == want.keys() and len(got) == 32  # the 2 blocks' self- and cross-attention projections
    update = max(float(v.abs().max()) for k, v in want.items() if "lora_B" in k)
    assert update > 0
    return max(float((got[k] - want[k]).abs().max()) for k in got) / update


def _final_lora(run: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run / "lora/pytorch_lora_weights.safetensors"))


def _same_step(got: Path, want: Path) -> float:
    """Assert the two runs rolled out, scored and counted the same; the LoRA difference relative to the update."""
    (g,), (w,) = read_metrics(got / "metrics.jsonl"), read_metrics(want / "metrics.jsonl")
    for key in SAME_KEYS:
        assert g[key] == w[key], (key, g[key], w[key])
    diff = _lora_diff(_final_lora(got), _final_lora(want))
    assert diff <= LORA_RTOL, diff
    return diff


def _resume_copy(run: Path, out: Path, step: int) -> Path:
    """`run`'s folder as a launch stopped after `step` left it: its later checkpoints and final exports left out
    (the resumed run drops the later metrics records itself)."""
    from flowgrpo.checkpoint import checkpoint_name

    def later(folder: str, names: list[str]) -> list[str]:
        exports = ["lora", "lora_ema", "eval_final.json"] if Path(folder) == run else []
        return [n for n in names if n.startswith("step_") and n > checkpoint_name(step)] + exports

    shutil.copytree(run, out, ignore=later)
    return out


@pytest.mark.heavy
def test_wan_step_with_ulysses_2_on_2_ranks_equals_one_process_and_resumes(launch_ranks, monkeypatch, tmp_path):
    """One rollout batch (prompts_per_iteration 1): a data-parallel launch of 2 ranks is refused, so the 2 ranks
    are one context-parallel group running the same batch, each block on half of the tokens. Its 2-iteration run
    checkpoints iteration 1; resumed from there on the same 2 ranks it is the uninterrupted run to the bit, and on
    one process without context parallelism (another world size) to float32 reduction order."""
    one = _wan_run(launch_ranks, monkeypatch, tmp_path / "one", 1, "prompts_per_iteration=1", sharded=False)
    two_iters = ("prompts_per_iteration=1", "iterations=2", "checkpoint.every=1")
    cp = _wan_run(launch_ranks, monkeypatch, tmp_path / "cp", 2, *two_iters, "model.context_parallel.ulysses=2")
    got, want = read_metrics(cp / "metrics.jsonl"), read_metrics(one / "metrics.jsonl")
    assert [r["iteration"] for r in got] == [1, 2]
    for key in SAME_KEYS:  # iteration 1: the same rollout and counts of work as one process
        assert got[0][key] == want[0][key], (key, got[0][key], want[0][key])
    assert _lora_diff(_lora_at(cp, 1), _final_lora(one)) <= LORA_RTOL

    # a second launch resumes the CP checkpoint of iteration 1 on the same 2 ranks: iteration 2 is the same work
    # in the same order, so its record (timings aside) and its LoRA weights are the uninterrupted run's to the bit
    again = _resume_copy(cp, tmp_path / "again", 1)
    _wan_run(launch_ranks, monkeypatch, again, 2, *two_iters, "model.context_parallel.ulysses=2", "resume=true")
    resumed = read_metrics(again / "metrics.jsonl")
    assert resumed[0] == got[0]  # iteration 1's record is the first launch's, timings included: it did resume
    for key in set(got[1]) | set(resumed[1]):
        if not key.startswith("time_") and key != "peak_memory_mb":  # what the host measures
            assert resumed[1].get(key) == got[1].get(key), (key, resumed[1].get(key), got[1].get(key))
    assert _lora_diff(_final_lora(again), _final_lora(cp)) == 0.0

    # and in one process without context parallelism: iteration 2 rolls out from exactly the saved weights (the
    # same rollout as the CP run's), its update sums the same float32 gradients in another order
    alone = _resume_copy(cp, tmp_path / "alone", 1)
    _wan_run(launch_ranks, monkeypatch, alone, 1, *two_iters, "resume=true", sharded=False)
    resumed = read_metrics(alone / "metrics.jsonl")
    assert resumed[0] == got[0] and [r["iteration"] for r in resumed] == [1, 2]
    for key in SAME_KEYS:
        assert resumed[1][key] == got[1][key], (key, resumed[1][key], got[1][key])
    assert _lora_diff(_final_lora(alone), _final_lora(cp)) <= LORA_RTOL


@pytest.mark.heavy
def test_wan_step_on_2_groups_of_2_ulysses_ranks_equals_2_data_parallel_ranks(launch_ranks, monkeypatch, tmp_path):
    """(dp_shard 2) x (ulysses 2) on 4 ranks, FSDP2 over all 4: rollout batch c on group c, as on rank c of a
    2-rank data-parallel launch."""
    dp = _wan_run(launch_ranks, monkeypatch, tmp_path / "dp", 2, "prompts_per_iteration=2")
    cp = _wan_run(launch_ranks, monkeypatch, tmp_path / "cp", 4, "prompts_per_iteration=2",
                  "model.context_parallel.ulysses=2")  # fmt: skip
    _same_step(cp, dp)


def test_video_memory_rows_shrink_with_the_degree_and_the_doc_is_current():
    facts = vm.build_facts()  # meta-built Wan 2.1 14B and HunyuanVideo 1.5, parameter counts checked
    wan720 = facts[1]
    assert wan720.tokens == 75600 and wan720.blocks == 40 and wan720.hidden == 5120
    rows = {(r.mode, r.cp, r.checkpointing): r for r in vm.video_rows(wan720)}
    sbh = 75600 * 5120
    assert rows[("full", 1, True)].activations * vm.GiB == pytest.approx(40 * 2 * sbh + 34 * sbh)
    assert rows[("full", 4, False)].activations * 4 == pytest.approx(rows[("full", 1, False)].activations)
    assert rows[("full", 1, False)].params == rows[("full", 8, False)].params  # weights are sharded over all 8
    assert not rows[("full", 1, False)].fits and rows[("full", 8, True)].fits
    assert vm.main(["--check"]) == 0, "run python -m flowgrpo.scaling.video_memory"
