"""Tiny models trained under FSDP2 on the ranks `launch_ranks` starts (and the same runs in one process).

As a script (every rank): python tests/scaling/fsdp_ranks.py OUT_DIR
  1. for each model kind, clipped SGD steps on its share of each global batch under `shard_model`
     (with activation checkpointing for RECOMPUTE kinds); rank 0 writes the gathered weights, the
     gradient norms (and for LoRA on SD3 the adapters-off output) to OUT_DIR/sgd_<kind>.safetensors;
  2. loads OUT_DIR/from_one_<kind> (a DCP checkpoint the test saved in one process) into a sharded
     model + AdamW and writes what it holds to OUT_DIR/loaded_on_two_<kind>.safetensors;
  3. takes AdamW steps, saves OUT_DIR/from_two_<kind> with `save_sharded` and writes the full state
     it saved to OUT_DIR/saved_on_two_<kind>.safetensors.
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import torch

import flowgrpo  # noqa: F401  (torchvision import hook before diffusers / transformers)

SGD_KINDS = ("sd3_full", "sd3_lora", "qwen2_lora")
RECOMPUTE = ("sd3_full", "qwen2_lora")  # sharded with activation checkpointing (diffusers' and transformers' own)
CKPT_KINDS = ("sd3_full", "sd3_lora")
GLOBAL_BATCH = 4
SGD_STEPS = 3
SGD_LR = 0.5  # large, so the weights move far more than float32 rounding
ADAM_STEPS = 2
CLIP = 0.05  # below the tiny models' gradient norms, so clipping changes every step


@contextlib.contextmanager
def one_thread():
    """These models are tiny: with 2 threads on a busy 2-core machine a step waits on thread barriers
    (3 SGD steps of the tiny SD3: 2.5 s with 2 threads, 0.05 s with 1)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def build(kind: str, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """The same weights in every process: built from a fixed seed in float32, then cast."""
    torch.manual_seed(1234)
    if kind.startswith("sd3"):
        from diffusers import SD3Transformer2DModel

        model = SD3Transformer2DModel(
            sample_size=8, patch_size=2, in_channels=4, out_channels=4, num_layers=2,
            attention_head_dim=8, num_attention_heads=2, joint_attention_dim=16,
            caption_projection_dim=16, pooled_projection_dim=16, pos_embed_max_size=8,
        )  # fmt: skip
        if kind == "sd3_lora":
            from peft import LoraConfig

            model.add_adapter(
                LoraConfig(
                    r=4, lora_alpha=8, init_lora_weights="gaussian", target_modules=["to_q", "to_k", "to_v", "to_out.0"]
                )
            )
            with torch.no_grad():  # B = 0 at init would leave A without gradient in step 1
                for name, p in model.named_parameters():
                    if "lora_B" in name:
                        p.normal_(0, 0.02)
    elif kind == "qwen2_lora":
        from peft import LoraConfig, get_peft_model
        from transformers import Qwen2Config, Qwen2ForCausalLM

        cfg = Qwen2Config(
            vocab_size=64,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            max_position_embeddings=32,
        )
        model = get_peft_model(
            Qwen2ForCausalLM(cfg),
            LoraConfig(
                r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], init_lora_weights="gaussian"
            ),
        )
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.02)
    else:
        raise ValueError(kind)
    return model.to(dtype)


def batch(kind: str, step: int, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Global batch number `step` (rows are split over ranks)."""
    g = torch.Generator().manual_seed(100 + step)
    n = GLOBAL_BATCH
    if kind.startswith("sd3"):
        return {
            "x": torch.randn(n, 4, 8, 8, generator=g),
            "t": torch.rand(n, generator=g) * 1000,
            "text": torch.randn(n, 5, 16, generator=g),
            "pooled": torch.randn(n, 16, generator=g),
            "target": torch.randn(n, 4, 8, 8, generator=g),
        }
    return {"ids": torch.randint(0, 64, (n, 12), generator=g)}


def loss(kind: str, model: torch.nn.Module, b: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    if kind.startswith("sd3"):
        out = model(
            hidden_states=b["x"].to(dtype),
            timestep=b["t"].to(dtype),
            encoder_hidden_states=b["text"].to(dtype),
            pooled_projections=b["pooled"].to(dtype),
            return_dict=False,
        )[0]
        return (out - b["target"].to(dtype)).pow(2).mean()
    return model(input_ids=b["ids"], labels=b["ids"]).loss


def rows(b: dict[str, torch.Tensor], rank: int, world: int) -> dict[str, torch.Tensor]:
    per = GLOBAL_BATCH // world
    return {k: v[rank * per : (rank + 1) * per] for k, v in b.items()}


def trainable(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def train(
    kind: str,
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    steps: int,
    first: int = 0,
    rank: int = 0,
    world: int = 1,
    dtype: torch.dtype = torch.float32,
) -> list[float]:
    """Optimizer steps with the global gradient norm clipped to CLIP (active: the norms are larger);
    returns the norms before clipping."""
    from flowgrpo.scaling.sharding import clip_grad_norm

    norms = []
    for step in range(first, first + steps):
        loss(kind, model, rows(batch(kind, step), rank, world), dtype).backward()
        norms.append(clip_grad_norm(trainable(model), CLIP))
        opt.step()
        opt.zero_grad()
    return norms


def reference_output(model: torch.nn.Module) -> torch.Tensor:
    """The base model's output with every LoRA adapter switched off (the KL reference), on batch 0."""
    model.disable_adapters()
    try:
        with torch.no_grad():
            return loss_free_output(model, batch("sd3", 0))
    finally:
        model.enable_adapters()


def loss_free_output(model: torch.nn.Module, b: dict[str, torch.Tensor]) -> torch.Tensor:
    return model(
        hidden_states=b["x"],
        timestep=b["t"],
        encoder_hidden_states=b["text"],
        pooled_projections=b["pooled"],
        return_dict=False,
    )[0]


def full_model_and_optim(model: torch.nn.Module, opt: torch.optim.Optimizer, trainable_only: bool) -> dict:
    """Everything a checkpoint holds, gathered (rank 0 gets it), keyed as save_sharded keys it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=trainable_only)
    msd, osd = get_state_dict(model, opt, options=options)
    out = {f"model.{k}": v for k, v in msd.items()}
    for fqn, state in osd.get("state", {}).items():
        out.update({f"optim.{fqn}.{k}": v for k, v in state.items()})
    return {k: v.detach().clone().contiguous() for k, v in out.items()}


def main(out: Path) -> None:
    import torch.distributed as dist
    from safetensors.torch import save_file

    from flowgrpo.scaling.sharding import (
        ShardingConfig,
        full_state,
        load_sharded,
        save_sharded_atomic,
        shard_model,
    )

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    for kind in SGD_KINDS:
        model = build(kind)
        shard_model(model, ShardingConfig(activation_checkpointing=kind in RECOMPUTE))
        norms = train(kind, model, torch.optim.SGD(trainable(model), lr=SGD_LR), SGD_STEPS, rank=rank, world=world)
        weights = full_state(model)
        extra = {"norms": torch.tensor(norms, dtype=torch.float64)}
        if kind == "sd3_lora":
            extra["reference"] = reference_output(model)
        if rank == 0:
            save_file(
                {**{k: v.contiguous() for k, v in weights.items()}, **{f"_{k}": v for k, v in extra.items()}},
                str(out / f"sgd_{kind}.safetensors"),
            )
    # fsdp2.yaml's precision: blocks compute in bf16, master weights and the gradient mean stay fp32.
    model = build("sd3_full")
    shard_model(model, ShardingConfig(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    seen: dict[str, torch.dtype] = {}
    model.transformer_blocks[0].attn.to_q.register_forward_pre_hook(
        lambda mod, args: seen.setdefault("compute", mod.weight.dtype) and None
    )
    norms = train("sd3_full", model, torch.optim.SGD(trainable(model), lr=SGD_LR), SGD_STEPS, rank=rank, world=world)
    if rank == 0:
        save_file(
            {
                "norms": torch.tensor(norms, dtype=torch.float64),
                "compute_is_bf16": torch.tensor(seen["compute"] == torch.bfloat16),
                "master_is_fp32": torch.tensor(model.transformer_blocks[0].attn.to_q.weight.dtype == torch.float32),
            },
            str(out / "bf16_sd3_full.safetensors"),
        )
    for kind in CKPT_KINDS:
        lora = kind.endswith("lora")
        model = build(kind)
        shard_model(model)
        opt = torch.optim.AdamW(trainable(model), lr=1e-3)
        load_sharded(out / f"from_one_{kind}", model, opt, trainable_only=lora)
        held = full_model_and_optim(model, opt, lora)
        if rank == 0:
            save_file(held, str(out / f"loaded_on_two_{kind}.safetensors"))
        train(kind, model, opt, ADAM_STEPS, first=10, rank=rank, world=world)
        save_sharded_atomic(out / f"from_two_{kind}", model, opt, trainable_only=lora)
        held = full_model_and_optim(model, opt, lora)
        if rank == 0:
            save_file(held, str(out / f"saved_on_two_{kind}.safetensors"))
    dist.destroy_process_group()


if __name__ == "__main__":
    with one_thread():
        main(Path(sys.argv[1]))
