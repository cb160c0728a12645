"""Per-rank GPU memory of a video model's training step, with and without context parallelism and gradient
checkpointing: python -m flowgrpo.scaling.video_memory [--check]

The same estimator as the image table (flowgrpo.scaling.memory: models built at full size on the meta device from
their published configs, FSDP2's parameter / gradient / optimizer / gathered terms), with the video token count
and the two switches that matter for long sequences. Activations, after Korthikanti et al. 2022 (~34 s b h bytes
of 16-bit activations per block with a fused attention kernel, s tokens, micro-batch b, width h), with a
context-parallel degree c (each rank holds s / c tokens of every block between the all-to-alls):

    checkpointing on:  (L * 2 s b h + 34 s b h) / c     (each block's input kept, one block recomputed)
    checkpointing off:  L * 34 s b h / c

Estimates, not measurements: the constant 34 is the GPT block's (attention + 4h MLP); a Wan block adds a
cross-attention over 512 text tokens, HunyuanVideo 1.5's blocks carry the text stream. Ulysses' all-to-all
buffers (q, k, v of one block) are transient and not counted. `--check` exits 1 if docs/scaling.md is stale.
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .memory import (
    PerRankGiB,
    IMAGE_LORA_TARGETS,
    GiB,
    ModelFacts,
    ModelSpec,
    build_meta,
    memory_row,
    model_facts,
)

WORLD = 8  # one node: FSDP2 shards the weights over all 8 ranks whatever the context-parallel degree
CP_DEGREES = (1, 2, 4, 8)
MODES = ("LoRA", "full")

# Wan-AI/Wan2.1-T2V-14B-Diffusers transformer/config.json (also pipelines.adapters.wan.WAN_SPECS)
WAN21_14B_CONFIG: dict[str, Any] = dict(
    patch_size=(1, 2, 2), in_channels=16, out_channels=16, text_dim=4096, freq_dim=256, cross_attn_norm=True,
    qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024, num_attention_heads=40,
    attention_head_dim=128, ffn_dim=13824, num_layers=40,
)  # fmt: skip
# HunyuanVideo-1.5 transformer (diffusers' HunyuanVideo15Transformer3DModel defaults = the published 480p / 720p
# config: hidden 2048 = 16 heads x 128, 54 double-stream blocks, patch 1, 32 latent channels + condition = 65 in)
HUNYUAN15_CONFIG: dict[str, Any] = dict(
    in_channels=65, out_channels=32, num_attention_heads=16, attention_head_dim=128, num_layers=54,
    num_refiner_layers=2, mlp_ratio=4.0, patch_size=1, patch_size_t=1, qk_norm="rms_norm", text_embed_dim=3584,
    text_embed_2_dim=1472, image_embed_dim=1152, rope_theta=256.0, rope_axes_dim=(16, 56, 56),
)  # fmt: skip
WAN_SOURCE = "https://huggingface.co/Wan-AI/Wan2.1-T2V-14B-Diffusers/blob/main/transformer/config.json"
HUNYUAN_SOURCE = "https://huggingface.co/tencent/HunyuanVideo-1.5"
EXPECTED = {"Wan2.1-T2V-14B": 14.3e9, "HunyuanVideo-1.5": 8.3e9}  # published sizes (model cards)


def latent_tokens(frames: int, height: int, width: int, t_down: int, s_down: int, patch: int) -> int:
    """Video tokens per sample: the VAE keeps the first frame and compresses the rest t_down x in time, s_down x
    in space; the transformer patchifies patch x patch in space (1 in time for both models here)."""
    return ((frames - 1) // t_down + 1) * (height // s_down // patch) * (width // s_down // patch)


@dataclass(frozen=True)
class VideoWorkload:
    spec: ModelSpec
    label: str  # resolution and frames
    video_tokens: int
    text_tokens: int  # in the block's sequence (HunyuanVideo 1.5's joint stream); 0 for Wan (cross-attention)


def _wan(label: str, height: int, width: int) -> VideoWorkload:
    video = latent_tokens(81, height, width, 4, 8, 2)
    spec = ModelSpec(
        name="Wan2.1-T2V-14B", library="diffusers", class_name="WanTransformer3DModel", config=WAN21_14B_CONFIG,
        source=WAN_SOURCE, block_classes=("WanTransformerBlock",), lora_rank=32,
        lora_targets=("to_q", "to_k", "to_v", "to_out.0"), tokens=video, micro_batch=1,
        workload=f"{label}: {video} video tokens per block (21 latent frames x {height // 16} x {width // 16}); "
        "512 T5 tokens by cross-attention; LoRA r32 on the self- and cross-attention projections (pipelines."
        "adapters.wan's targets), micro-batch 1",
    )  # fmt: skip
    return VideoWorkload(spec, label, video, 0)


def _hunyuan(label: str, height: int, width: int) -> VideoWorkload:
    video, text = latent_tokens(121, height, width, 4, 16, 1), 1000 + 256
    spec = ModelSpec(
        name="HunyuanVideo-1.5", library="diffusers", class_name="HunyuanVideo15Transformer3DModel",
        config=HUNYUAN15_CONFIG, source=HUNYUAN_SOURCE, block_classes=("HunyuanVideo15TransformerBlock",),
        lora_rank=32, lora_targets=IMAGE_LORA_TARGETS, tokens=video + text, micro_batch=1,
        workload=f"{label}: {video + text} tokens per block = {video} video (31 latent frames x {height // 16} x "
        f"{width // 16}, VAE 16x) + {text} text (1000 Qwen2.5-VL + 256 ByT5, the pipeline's padded lengths); "
        "LoRA r32 on the attention projections, micro-batch 1",
    )  # fmt: skip
    return VideoWorkload(spec, label, video, text)


WORKLOADS: tuple[VideoWorkload, ...] = (
    _wan("480 x 832, 81 frames", 480, 832),
    _wan("720 x 1280, 81 frames", 720, 1280),
    _hunyuan("480 x 848, 121 frames", 480, 848),
    _hunyuan("720 x 1280, 121 frames", 720, 1280),
)


@dataclass(frozen=True)
class VideoRow(PerRankGiB):
    mode: str
    cp: int
    checkpointing: bool
    params: float
    grads: float
    optim: float
    gathered: float
    activations: float
    splits: bool  # the sequence divides by the degree (diffusers' equal partition)


def video_activation_bytes(f: ModelFacts, cp: int, checkpointing: bool) -> float:
    sbh = f.tokens * f.micro_batch * f.hidden
    kept = f.blocks * 2 * sbh + 34 * sbh if checkpointing else f.blocks * 34 * sbh
    return kept / cp


def video_rows(f: ModelFacts, world: int = WORLD) -> list[VideoRow]:
    rows = []
    for mode in MODES:
        base = memory_row(f, mode, "FSDP2", world)  # weights, gradients, moments: sharded over all ranks
        for cp in CP_DEGREES:
            for ckpt in (True, False):
                act = video_activation_bytes(f, cp, ckpt) / GiB
                rows.append(
                    VideoRow(
                        mode, cp, ckpt, base.params, base.grads, base.optim, base.gathered, act, f.tokens % cp == 0
                    )
                )
    return rows


def render(workloads: tuple[VideoWorkload, ...], facts: list[ModelFacts]) -> str:
    out = [
        "| model | parameters (meta-built) | LoRA parameters | blocks | hidden | workload |",
        "|---|---|---|---|---|---|",
    ]
    for w, f in zip(workloads, facts):
        out.append(
            f"| [{f.name}]({w.spec.source}) | {f.params / 1e9:.2f} B | {f.lora_params / 1e6:.1f} M "
            f"(r{w.spec.lora_rank}) | {f.blocks} | {f.hidden} | {w.spec.workload} |"
        )
    out += [
        "",
        f'GiB per rank, FSDP2 over {WORLD} GPUs, estimates (not measured). "CP": ulysses x ring ranks per sample. '
        '"fits": total <= 90 % of 80 GB.',
        "",
    ]
    for w, f in zip(workloads, facts):
        out += [
            f"#### {f.name}, {w.label}",
            "",
            "| mode | CP | checkpointing | params | grads | optimizer | gathered | activations | total | fits 80 GB |",
            "|---|---:|---|---:|---:|---:|---:|---:|---:|---|",
        ]
        for r in video_rows(f):
            fits = ("yes" if r.fits else "no") if r.splits else f"n/a ({f.tokens} tokens / {r.cp})"
            out.append(
                f"| {r.mode} | {r.cp} | {'on' if r.checkpointing else 'off'} | {r.params:.1f} | {r.grads:.1f} | "
                f"{r.optim:.1f} | {r.gathered:.1f} | {r.activations:.1f} | {r.total:.1f} | {fits} |"
            )
        out.append("")
    return "\n".join(out)


_BUILT: dict[str, Any] = {}  # one meta model per architecture and process (no memory; building one takes seconds)


def build_facts(workloads: tuple[VideoWorkload, ...] = WORKLOADS) -> list[ModelFacts]:
    facts = []
    for w in workloads:
        if w.spec.name not in _BUILT:
            _BUILT[w.spec.name] = build_meta(w.spec)
        facts.append(model_facts(w.spec, _BUILT[w.spec.name]))
    for f in facts:
        want = EXPECTED[f.name]
        if abs(f.params - want) > 0.02 * want:
            raise AssertionError(f"{f.name}: {f.params / 1e9:.3f} B parameters, expected ~{want / 1e9:.1f} B")
    return facts


START, END = "<!-- video-memory-table:start -->", "<!-- video-memory-table:end -->"
DOC = Path(__file__).resolve().parents[2] / "docs" / "scaling.md"


def replace_block(doc: str, table: str) -> str:
    pattern = re.compile(re.escape(START) + ".*?" + re.escape(END), re.DOTALL)
    if not pattern.search(doc):
        raise ValueError(f"the document has no {START} ... {END} block")
    return pattern.sub(lambda _: f"{START}\n{table}\n{END}", doc)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/scaling.md is out of date")
    parser.add_argument("--doc", type=Path, default=DOC)
    args = parser.parse_args(argv)
    new = replace_block(args.doc.read_text(), render(WORKLOADS, build_facts()))
    if args.check:
        if new != args.doc.read_text():
            print(f"{args.doc} is out of date: run python -m flowgrpo.scaling.video_memory", file=sys.stderr)
            return 1
        return 0
    args.doc.write_text(new)
    print(f"wrote the video memory table of {args.doc}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
