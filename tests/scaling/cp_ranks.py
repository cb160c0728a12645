"""A tiny Wan transformer under diffusers' context parallelism (Ulysses) and FSDP2, against the same model in one
process, on the ranks `launch_ranks` starts (gloo, CPU).

As a script (every rank): python tests/scaling/cp_ranks.py OUT_DIR [GROUPS]; on GPUs (nccl, one GPU per rank):
    PYTHONPATH=. torchrun --nproc_per_node 2 tests/scaling/cp_ranks.py OUT_DIR
GROUPS data-parallel groups (default 1) of world / GROUPS Ulysses ranks, one sample per group. Each rank first runs
the plain model on every group's sample (the one-process reference: same seed, inputs and losses), then the same
weights under `enable_context_parallel` + `shard_model` over the world on its group's sample
(`data_parallel_coords`), and compares its output and the gathered gradients of every parameter (LoRA and base)
with the reference's. Each rank writes OUT_DIR/cp_rank<R>.json.
"""

from __future__ import annotations

import copy
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

import flowgrpo  # noqa: F401  (torchvision import hook before diffusers)

FRAMES, SIDE = 2, 8  # latent frames and side: 2 x (8 / 2) x (8 / 2) = 32 tokens per sample


def tiny_wan() -> torch.nn.Module:
    from diffusers import WanTransformer3DModel
    from peft import LoraConfig

    torch.manual_seed(0)
    model = WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=4,
        text_dim=32, freq_dim=16, ffn_dim=32, num_layers=2, rope_max_seq_len=32,
    )  # fmt: skip
    model.add_adapter(LoraConfig(r=4, lora_alpha=4, target_modules=["to_q", "to_k", "to_v", "to_out.0"]))
    with torch.no_grad():  # peft starts B at 0: give it values so that A gets a gradient too
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    model.requires_grad_(True)  # LoRA and base weights: both gradients are compared
    return model.eval()


def loss_and_grads(model: torch.nn.Module, samples: list[tuple[dict, torch.Tensor]]):
    """Outputs of `samples` and the gradients of the sum of their losses (gathered when sharded)."""
    outs = []
    for inputs, weight in samples:
        out = model(**inputs, return_dict=False)[0]
        (out * weight).sum().backward()  # the same loss on every rank of a group: each sees the gathered output
        outs.append(out.detach())
    grads = {}
    for name, p in model.named_parameters():
        g = p.grad
        grads[name] = g.full_tensor() if hasattr(g, "full_tensor") else g
    return outs, grads


def main(out_dir: str, groups: int) -> int:
    from flowgrpo.scaling.context_parallel import (
        ContextParallelError,
        ContextParallelSettings,
        data_parallel_coords,
        enable_context_parallel,
    )
    from flowgrpo.scaling.sharding import ShardingConfig, shard_model

    torch.set_num_threads(1)
    cuda = torch.cuda.is_available()  # on GPUs (torchrun, the GPU check of docs/scaling.md): nccl, one GPU per rank
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    dist.init_process_group("cuda:nccl,cpu:gloo" if cuda else "gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    cp = ContextParallelSettings(ulysses=world // groups)  # `groups` data-parallel groups of world / groups ranks
    gen = torch.Generator().manual_seed(1)
    samples = [  # one sample per data-parallel group: latents, timestep, text, and the loss's weights
        (
            dict(
                hidden_states=torch.randn(1, 4, FRAMES, SIDE, SIDE, generator=gen).to(device),
                timestep=torch.tensor([300.0 + 400.0 * k]).to(device),
                encoder_hidden_states=torch.randn(1, 6, 32, generator=gen).to(device),
            ),
            torch.randn(1, 4, FRAMES, SIDE, SIDE, generator=gen).to(device),
        )
        for k in range(groups)
    ]

    plain = tiny_wan().to(device)
    cp_model = copy.deepcopy(plain)
    ref_outs, ref_grads = loss_and_grads(plain, samples)  # one process, the whole batch

    seen: list[int] = []  # the sequence length of the first block's output on this rank (split before the block)
    cp_model.blocks[0].register_forward_hook(lambda m, args, out: seen.append(out.shape[1]))
    enable_context_parallel(cp_model, cp)
    # FSDP2 as Distributed.shard applies it: one mesh over the whole world, gradients summed
    shard_model(cp_model, ShardingConfig(block_classes=("WanTransformerBlock",)))
    for m in cp_model.modules():
        if hasattr(m, "set_gradient_divide_factor"):
            m.set_gradient_divide_factor(1.0)  # as Distributed.shard: gradients summed over the ranks
            m.set_force_sum_reduction_for_comms(True)
    index, count = data_parallel_coords(rank, world, cp)
    assert count == groups
    (out,), grads = loss_and_grads(cp_model, [samples[index]])  # this group's sample only

    result = {
        "world": world,
        "data_index": index,
        "tokens_seen": seen[0],
        "tokens_full": FRAMES * (SIDE // 2) ** 2,
        "out_max_abs_diff": (out - ref_outs[index]).abs().max().item(),
        "out_scale": ref_outs[index].abs().max().item(),
        "grad_max_abs_diff": {n: (grads[n] - ref_grads[n]).abs().max().item() for n in ref_grads},
        "grad_scale": max(g.abs().max().item() for g in ref_grads.values()),
        "lora_params": sum(1 for n in ref_grads if "lora_" in n),
        "sharded": any(hasattr(p, "full_tensor") for p in cp_model.parameters()),
    }
    try:  # ring attention with the native (SDPA) backend, as on CPU
        enable_context_parallel(tiny_wan().to(device), ContextParallelSettings(ring=world))
        result["ring_error"] = ""
    except ContextParallelError as err:
        result["ring_error"] = str(err)
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    Path(out_dir, f"cp_rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 1))
