"""FSDP2 on 2 CPU ranks (gloo) against 1 process: same weights after training, and sharded checkpoints
that load across world sizes (2 -> 1 and 1 -> 2) bit for bit."""

from __future__ import annotations

from functools import partial

import pytest
import torch
from safetensors.torch import load_file

from flowgrpo.scaling.sharding import (
    ShardingError,
    load_sharded,
    save_sharded,
    shard_model,
)

from . import fsdp_ranks as fr

EPS32 = torch.finfo(torch.float32).eps


def _sgd_run(kind: str, dtype: torch.dtype) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    model = fr.build(kind, dtype)
    norms = fr.train(kind, model, torch.optim.SGD(fr.trainable(model), lr=fr.SGD_LR), fr.SGD_STEPS, dtype=dtype)
    return {k: v.detach() for k, v in model.state_dict().items()}, torch.tensor(norms, dtype=torch.float64)


def _within_float32_error(two: torch.Tensor, one: torch.Tensor, exact: torch.Tensor, what: str) -> float:
    """Both runs are float32 roundings of the same exact computation (they differ only in the order the
    batch's terms are summed), so each is within E of the exact (float64) result, where E is measured
    on the 1-process run; the two then differ by at most ~2E. We allow 4E (the 2-rank run's E may be
    larger than the 1-process one) plus 2 ulp of the value."""
    err = (one.double() - exact.double()).abs().max().item()
    tol = 4 * err + 2 * EPS32 * one.abs().max().item()
    diff = (two.double() - one.double()).abs().max().item()
    assert diff <= tol, f"{what}: 2 ranks vs 1 process differ by {diff:.3g} > {tol:.3g}"
    return tol


def _adam_checkpoint(kind: str, path) -> dict[str, torch.Tensor]:
    model = fr.build(kind)
    opt = torch.optim.AdamW(fr.trainable(model), lr=1e-3)
    fr.train(kind, model, opt, fr.ADAM_STEPS)
    lora = kind.endswith("lora")
    save_sharded(path, model, opt, trainable_only=lora)
    return fr.full_model_and_optim(model, opt, lora)


def _assert_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    assert sorted(got) == sorted(want), what
    bad = [k for k in want if not torch.equal(got[k], want[k])]
    assert not bad, f"{what}: {len(bad)} tensors differ, e.g. {bad[:3]}"


def _check_training(out, kind: str) -> None:
    """Weights after clipped SGD steps, and the clipped global gradient norms, within float32 error."""
    one, norms_one = _sgd_run(kind, torch.float32)
    exact, norms_exact = _sgd_run(kind, torch.float64)
    two = load_file(str(out / f"sgd_{kind}.safetensors"))
    norms_two = two.pop("_norms")
    reference = two.pop("_reference", None)
    start = {k: v.detach() for k, v in fr.build(kind).state_dict().items()}
    assert sorted(two) == sorted(one)
    moved = tol = 0.0
    for name, w1 in one.items():
        tol = max(tol, _within_float32_error(two[name], w1, exact[name], f"{kind} {name}"))
        moved = max(moved, (w1 - start[name]).abs().max().item())
    # The check has teeth: training moved the weights far beyond any tolerance used above.
    assert moved > 100 * tol, (kind, moved, tol)
    _within_float32_error(norms_two, norms_one, norms_exact, f"{kind} gradient norms")
    assert (norms_one > fr.CLIP).all(), "clipping was active at every step"
    if reference is not None:  # LoRA switched off on the sharded model = the untouched base model
        base = fr.build("sd3_full")
        with torch.no_grad():
            want = fr.loss_free_output(base, fr.batch("sd3", 0))
        torch.testing.assert_close(reference, want, rtol=1e-5, atol=1e-6)
        lora = fr.build(kind)
        with torch.no_grad():
            assert (fr.loss_free_output(lora, fr.batch("sd3", 0)) - want).abs().max() > 1e-3


def _check_two_to_one(out, kind: str) -> None:
    lora = kind.endswith("lora")
    model = fr.build(kind)
    opt = torch.optim.AdamW(fr.trainable(model), lr=1e-3)
    load_sharded(out / f"from_two_{kind}", model, opt, trainable_only=lora)
    _assert_equal(
        fr.full_model_and_optim(model, opt, lora),
        load_file(str(out / f"saved_on_two_{kind}.safetensors")),
        f"{kind}: 2 ranks -> 1",
    )
    assert opt.param_groups[0]["betas"] == (0.9, 0.999)  # param groups come back from JSON as they were
    assert not list(out.glob(f"from_two_{kind}/*.metadata")), "no pickled DCP metadata"


def _check_bf16(out) -> None:
    """fsdp2.yaml's precision on 2 ranks: blocks saw bf16 weights while the optimizer's weights stayed
    fp32; the gradient norms follow the fp32 run to bf16 precision (8 mantissa bits: 2^-8 = 0.4 % per
    rounding; we allow 3 %, a few roundings through the 2-block model)."""
    got = load_file(str(out / "bf16_sd3_full.safetensors"))
    assert bool(got["compute_is_bf16"]) and bool(got["master_is_fp32"])
    _, fp32_norms = _sgd_run("sd3_full", torch.float32)
    torch.testing.assert_close(got["norms"], fp32_norms, rtol=0.03, atol=0)
    assert not torch.equal(got["norms"], fp32_norms)  # bf16 compute did happen


def test_fsdp2_on_two_ranks_matches_one_process(launch_ranks, tmp_path):
    """One 2-rank launch (its imports cost most of the time) feeds every check: training under
    fully_shard (full fine-tune and LoRA, a diffusers and a transformers model) and sharded
    checkpoints loaded across world sizes, 1 -> 2 and 2 -> 1, bit for bit."""
    with fr.one_thread():
        expected = {kind: _adam_checkpoint(kind, tmp_path / f"from_one_{kind}") for kind in fr.CKPT_KINDS}
        launch_ranks("../tests/scaling/fsdp_ranks.py", [str(tmp_path)], world=2, timeout=300)
        for kind in fr.SGD_KINDS:
            _check_training(tmp_path, kind)
        for kind in fr.CKPT_KINDS:
            _assert_equal(
                load_file(str(tmp_path / f"loaded_on_two_{kind}.safetensors")), expected[kind], f"{kind}: 1 -> 2 ranks"
            )
            _check_two_to_one(tmp_path, kind)
    _check_bf16(tmp_path)
    model = fr.build("sd3_full")  # a LoRA-only checkpoint lacks the full model's weights
    with pytest.raises(ShardingError, match="lacks"):
        load_sharded(tmp_path / "from_two_sd3_lora", model)
    with pytest.raises(ShardingError, match="no sharded checkpoint"):
        load_sharded(tmp_path / "nowhere", model)


def test_shard_model_needs_blocks_and_a_process_group(tmp_path):
    import torch.distributed as dist

    with pytest.raises(ShardingError, match="torch.distributed"):
        shard_model(fr.build("sd3_full"))
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        with pytest.raises(ShardingError, match="no module of Sequential.*JointTransformerBlock"):
            shard_model(torch.nn.Sequential(torch.nn.Linear(2, 2)))
        model = fr.build("sd3_full")
        blocks = shard_model(model)
        assert blocks == ["transformer_blocks.0", "transformer_blocks.1"]
        assert type(model.transformer_blocks[0].attn.to_q.weight).__name__ == "DTensor"
    finally:
        dist.destroy_process_group()


def test_atomic_save_replaces_a_stale_temporary_folder_and_the_target(tmp_path):
    from flowgrpo.scaling.sharding import save_sharded_atomic

    target = tmp_path / "step_00000003" / "sharded"
    stale = target.with_name(".tmp-sharded")
    stale.mkdir(parents=True)
    (stale / "junk.safetensors").write_bytes(b"half-written")  # left by a crashed save
    model = fr.build("qwen2_lora")
    opt = torch.optim.AdamW(fr.trainable(model), lr=1e-3)
    with fr.one_thread():
        fr.train("qwen2_lora", model, opt, 1)
        assert save_sharded_atomic(target, model, opt, trainable_only=True) == target
        fr.train("qwen2_lora", model, opt, 1, first=1)
        save_sharded_atomic(target, model, opt, trainable_only=True)  # a second save replaces the first
    assert not stale.exists() and not (target / "junk.safetensors").exists()
    fresh = fr.build("qwen2_lora")
    fresh_opt = torch.optim.AdamW(fr.trainable(fresh), lr=1e-3)
    load_sharded(target, fresh, fresh_opt, trainable_only=True)
    _assert_equal(
        fr.full_model_and_optim(fresh, fresh_opt, True),
        fr.full_model_and_optim(model, opt, True),
        "atomic save, reloaded",
    )


@pytest.mark.parametrize("kind", ["qwen2_lora", "sd3_full"])
def test_activation_checkpointing_recomputes_eval_mode_blocks_under_fsdp2(tmp_path, kind, saved_for_backward):
    """The trainers' policies run in eval mode; under fully_shard the blocks become FSDP<Block> classes.
    Neither may switch recomputation off (transformers used to recompute only in training mode)."""
    import torch.distributed as dist

    from flowgrpo.scaling.sharding import ShardingConfig

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        saved = {}
        for recompute in (False, True):
            model = fr.build(kind).eval()
            shard_model(model, ShardingConfig(activation_checkpointing=recompute))
            saved[recompute], _ = saved_for_backward(partial(fr.loss, kind, model, fr.batch(kind, 0), torch.float32))
        assert saved[True] < saved[False] / 2, saved
    finally:
        dist.destroy_process_group()
