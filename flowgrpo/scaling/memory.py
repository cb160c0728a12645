"""Per-rank GPU memory of a training step, from the real-size models built on the meta device.

No weights, no GPU, no hub: each model is built from its published config (written out below, with
the file it comes from) under `torch.device("meta")`, so parameter, buffer and block counts are the
library's own. Memory per rank, in bytes, for T trainable parameters, F frozen parameters + buffers,
W ranks (bf16 = 2 bytes, fp32 = 4):

    engine   parameters          gradients   optimizer             gathered (transient, bf16)
    DDP      2F + 4T             4T          8T    (m, v)          -
    FSDP2    (2F + 4T) / W       4T / W      8T / W (m, v)         2 (root + 2 largest blocks)
    ZeRO-2   2F + 4T             4T / W      12T / W (master,m,v)  -
    ZeRO-3   2F / W + 4T         4T / W      12T / W (master,m,v)  2 (2 largest blocks)

DDP and FSDP2 keep trained weights in fp32 (the fp32 parameter is the master copy; compute is bf16). The frozen
weights take 2 bytes unless a spec's recipe keeps them in fp32 (`frozen_bytes` 4: SD3.5-M's transformer).
flowgrpo's ZeRO (flowgrpo.scaling.zero) keeps the module as the recipe loads it (fp32 trained weights,
DeepSpeed's bf16 mode off), and DeepSpeed adds its fp32 master partition to the AdamW moments; under ZeRO-3
the frozen base is partitioned and the trained (LoRA) weights stay whole on every rank. A full fine-tune has
no frozen base: flowgrpo refuses it under ZeRO-3 (its rows show why: nothing shrinks) and shards it with FSDP2. FSDP2's root unit (embeddings, final layers) stays gathered between forwards (see
sharding.shard_model); blocks are gathered one ahead of use (prefetch), hence 2 blocks.

Activations (any engine, any W; data parallel does not split them), per the estimate of Korthikanti
et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models", eq. 2) with a fused
attention kernel (no s x s score matrix kept): a transformer block keeps ~34 s b h bytes of 16-bit
activations for micro-batch b, s tokens and width h. With block-level activation checkpointing
(fsdp2.yaml) only each block's input (2 s b h bytes) is kept, plus one block recomputed in backward:

    activations = L * 2 s b h + 34 s b h   (+ b s V * 4 for an LM's fp32 log-softmax over vocab V)
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch

from flowgrpo.scaling.published_configs import FLUX1_DEV_CONFIG, FLUX2_KLEIN_CONFIG, QWEN_IMAGE_CONFIG

GiB = 2**30
GPU_BYTES = 80e9  # an 80 GB H100 / A100
USABLE = 0.9  # kept for the CUDA context, communication buffers and allocator fragmentation
ENGINES = ("DDP", "FSDP2", "ZeRO-2", "ZeRO-3")
MODES = ("LoRA", "full")
WORLDS = (1, 8, 64)
IMAGE_LORA_TARGETS = ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out")
# Flow-GRPO's SD3.5 list (configs/t2i/real/_sd35m.yaml): `attn.` only, so the second attention gets no LoRA
SD35_LORA_TARGETS = tuple(f"attn.{t}" for t in IMAGE_LORA_TARGETS)
TEXT_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
# FLUX.2 [klein]: the double blocks' attention projections + the single blocks' fused QKV / MLP-in projection
FLUX2_LORA_TARGETS = (*IMAGE_LORA_TARGETS, "to_qkv_mlp_proj")
FLUX2_BLOCKS = ("Flux2TransformerBlock", "Flux2SingleTransformerBlock")


@dataclass(frozen=True)
class ModelSpec:
    """A published model config and the training workload of our recipe for it."""

    name: str
    library: str  # "diffusers" or "transformers"
    class_name: str
    config: dict[str, Any]
    source: str
    block_classes: tuple[str, ...]
    lora_rank: int
    lora_targets: tuple[str, ...]
    tokens: int  # sequence length one block sees (image + text tokens, or prompt + completion; an edit model's
    # reference-image tokens are in it: the denoiser attends over [generated; reference] latent tokens)
    micro_batch: int
    workload: str  # where tokens / micro_batch / rank come from
    vocab: int = 0  # > 0 for a causal LM (log-softmax over the vocabulary)
    frozen_bytes: int = 2  # bytes per frozen parameter / buffer: 2 (bf16 / fp16), 4 where the recipe keeps fp32


SPECS: tuple[ModelSpec, ...] = (
    ModelSpec(
        name="FLUX.1-dev",
        library="diffusers",
        class_name="FluxTransformer2DModel",
        config=FLUX1_DEV_CONFIG,
        source="https://huggingface.co/black-forest-labs/FLUX.1-dev/blob/main/transformer/config.json",
        block_classes=("FluxTransformerBlock", "FluxSingleTransformerBlock"),
        lora_rank=128,
        lora_targets=IMAGE_LORA_TARGETS,
        tokens=45 * 45 + 512,
        micro_batch=1,
        workload="configs/t2i/real/_flux.yaml (the published DanceGRPO / MixGRPO / BranchGRPO runs): 720 px "
        "(2025 latent tokens), T5 length 512, micro-batch 1, full fine-tune; LoRA rows: r128 of the "
        "<recipe>_lora.yaml variants",
    ),
    ModelSpec(
        name="SD3.5-Medium",
        library="diffusers",
        class_name="SD3Transformer2DModel",
        config=dict(
            sample_size=128,
            patch_size=2,
            in_channels=16,
            out_channels=16,
            num_layers=24,
            attention_head_dim=64,
            num_attention_heads=24,
            joint_attention_dim=4096,
            caption_projection_dim=1536,
            pooled_projection_dim=2048,
            pos_embed_max_size=384,
            dual_attention_layers=tuple(range(13)),
            qk_norm="rms_norm",
        ),
        source="https://huggingface.co/stabilityai/stable-diffusion-3.5-medium/blob/main/transformer/config.json",
        block_classes=("JointTransformerBlock",),
        lora_rank=32,
        lora_targets=SD35_LORA_TARGETS,
        tokens=32 * 32 + 77 + 128,
        micro_batch=16,
        frozen_bytes=4,
        workload="configs/t2i/real/_sd35m.yaml: 512 px (1024 latent tokens), CLIP 77 + T5 128 tokens, LoRA r32 "
        "on the `attn.` projections (Flow-GRPO's list), micro-batch 16; the frozen transformer in fp32 under fp16 "
        "autocast (Flow-GRPO's launch)",
    ),
    ModelSpec(
        name="Qwen-Image",
        library="diffusers",
        class_name="QwenImageTransformer2DModel",
        config=QWEN_IMAGE_CONFIG,
        source="https://huggingface.co/Qwen/Qwen-Image/blob/main/transformer/config.json",
        block_classes=("QwenImageTransformerBlock",),
        lora_rank=32,
        lora_targets=IMAGE_LORA_TARGETS,
        tokens=32 * 32 + 256,
        micro_batch=8,
        workload="no shipped recipe: 512 px (1024 latent tokens), LoRA r32, micro-batch 8, 256 prompt tokens",
    ),
    ModelSpec(
        name="FLUX.1-Kontext-dev",
        library="diffusers",
        class_name="FluxTransformer2DModel",
        config=FLUX1_DEV_CONFIG,  # FLUX.1-dev's 12 B transformer; the reference image enters as tokens
        source="https://huggingface.co/black-forest-labs/FLUX.1-Kontext-dev/blob/main/transformer/config.json",
        block_classes=("FluxTransformerBlock", "FluxSingleTransformerBlock"),
        lora_rank=64,
        lora_targets=IMAGE_LORA_TARGETS,
        tokens=64 * 64 + 64 * 64 + 512,
        micro_batch=1,
        workload="family flux_kontext at its published 1024 px (configs/t2i/real/kontext_edit.yaml trains at 512 px, "
        "fp32): 8704 tokens per block = "
        "4096 generated + 4096 reference-image latent tokens (the source image packed as the generated one) + 512 "
        "T5 tokens, LoRA r64 (the recipe's), micro-batch 1",
    ),
    ModelSpec(
        name="Qwen-Image-Edit",
        library="diffusers",
        class_name="QwenImageTransformer2DModel",
        config=QWEN_IMAGE_CONFIG,  # Qwen-Image's 20 B transformer
        source="https://huggingface.co/Qwen/Qwen-Image-Edit/blob/main/transformer/config.json",
        block_classes=("QwenImageTransformerBlock",),
        lora_rank=64,
        lora_targets=IMAGE_LORA_TARGETS,
        tokens=64 * 64 + 64 * 64 + 37 * 37 + 256,
        micro_batch=1,
        workload="family qwenimage_edit at its published 1024 px: 9817 tokens per block = "
        "4096 generated + 4096 reference-image latent tokens + the text stream: 1369 Qwen2.5-VL tokens of the "
        "source image (1024 px / 28 px per token = 37 x 37) + 256 prompt tokens, LoRA r64, micro-batch 1",
    ),
    ModelSpec(
        name="Qwen-Image-Edit-2509",
        library="diffusers",
        class_name="QwenImageTransformer2DModel",
        config=QWEN_IMAGE_CONFIG,
        source="https://huggingface.co/Qwen/Qwen-Image-Edit-2509/blob/main/transformer/config.json",
        block_classes=("QwenImageTransformerBlock",),
        lora_rank=64,
        lora_targets=IMAGE_LORA_TARGETS,
        tokens=64 * 64 + 3 * 64 * 64 + 3 * 14 * 14 + 256,
        micro_batch=1,
        workload="family qwenimage_edit_plus at 1024 px with 3 input images (configs/t2i/real/qwenimage_edit_plus.yaml: "
        "512 px), 17228 tokens "
        "per block = 4096 generated + 3 x 4096 reference latent tokens (each image at 1024 px, the pipeline's "
        "VAE_IMAGE_SIZE) + the text stream: 3 x 196 Qwen2.5-VL image tokens (384 px, CONDITION_IMAGE_SIZE) + 256 "
        "prompt tokens, LoRA r64 (the recipe's), micro-batch 1",
    ),
    ModelSpec(
        name="FLUX.2-klein-4B",
        library="diffusers",
        class_name="Flux2Transformer2DModel",
        config=FLUX2_KLEIN_CONFIG,
        source="https://huggingface.co/black-forest-labs/FLUX.2-klein-4B/blob/main/transformer/config.json",
        block_classes=FLUX2_BLOCKS,
        lora_rank=32,
        lora_targets=FLUX2_LORA_TARGETS,
        tokens=32 * 32 + 512,
        micro_batch=8,
        workload="no shipped real recipe (configs/t2i/tiny/flux2_klein.yaml is the tiny one): 512 px (1024 latent "
        "tokens), the pipeline's 512 padded Qwen3 tokens, LoRA r32 on pipelines.adapters.flux2's targets, micro-batch 8",
    ),
    ModelSpec(
        name="FLUX.2-klein-9B",
        library="diffusers",
        class_name="Flux2Transformer2DModel",
        config={
            **FLUX2_KLEIN_CONFIG,
            "num_layers": 8,
            "num_single_layers": 24,
            "num_attention_heads": 32,
            "joint_attention_dim": 12288,
        },  # fmt: skip
        source="https://huggingface.co/black-forest-labs/FLUX.2-klein-9B/blob/main/transformer/config.json",
        block_classes=FLUX2_BLOCKS,
        lora_rank=32,
        lora_targets=FLUX2_LORA_TARGETS,
        tokens=32 * 32 + 512,
        micro_batch=8,
        workload="as FLUX.2-klein-4B: 512 px, 512 text tokens, LoRA r32, micro-batch 8 (no shipped real recipe)",
    ),
    ModelSpec(
        name="Z-Image-Turbo",
        library="diffusers",
        class_name="ZImageTransformer2DModel",
        config=dict(
            all_patch_size=(2,),
            all_f_patch_size=(1,),
            in_channels=16,
            dim=3840,
            n_layers=30,
            n_refiner_layers=2,
            n_heads=30,
            n_kv_heads=30,
            norm_eps=1e-5,
            qk_norm=True,
            cap_feat_dim=2560,
            rope_theta=256.0,
            t_scale=1000.0,
            axes_dims=(32, 48, 48),
            axes_lens=(1536, 512, 512),
        ),
        source="https://huggingface.co/Tongyi-MAI/Z-Image-Turbo/blob/main/transformer/config.json",
        block_classes=("ZImageTransformerBlock",),  # 30 main + 2 noise-refiner + 2 caption-refiner blocks
        lora_rank=32,
        lora_targets=("to_q", "to_k", "to_v", "to_out.0"),
        tokens=32 * 32 + 256,
        micro_batch=8,
        workload="no shipped real recipe (configs/t2i/tiny/zimage_turbo.yaml is the tiny one): 512 px (1024 latent "
        "tokens), up to 256 caption tokens (real tokens only), LoRA r32 on the attention projections, micro-batch 8",
    ),
    ModelSpec(
        name="Qwen2.5-7B",
        library="transformers",
        class_name="Qwen2ForCausalLM",
        config=dict(
            vocab_size=152064,
            hidden_size=3584,
            intermediate_size=18944,
            num_hidden_layers=28,
            num_attention_heads=28,
            num_key_value_heads=4,
            max_position_embeddings=131072,
            rope_theta=1000000.0,
            rms_norm_eps=1e-6,
            tie_word_embeddings=False,
        ),
        source="https://huggingface.co/Qwen/Qwen2.5-7B/blob/main/config.json",
        block_classes=("Qwen2DecoderLayer",),
        lora_rank=8,
        lora_targets=TEXT_LORA_TARGETS,
        tokens=256 + 1024,
        micro_batch=4,
        vocab=152064,
        workload="configs/text/real/qwen2.5-1.5b_math_vllm.yaml scaled to 7B: 256 prompt + 1024 completion "
        "tokens, micro-batch 4; LoRA r8 on q/k/v/o (flowgrpo.text.config.TextLoraConfig defaults)",
    ),
)


def build_meta(spec: ModelSpec) -> torch.nn.Module:
    """The real-size model with every tensor on the meta device (no memory, no init cost)."""
    import flowgrpo  # noqa: F401  (torchvision import hook before diffusers / transformers)

    if spec.library == "diffusers":
        import diffusers

        cls = getattr(diffusers, spec.class_name)
        with torch.device("meta"):
            return cls(**spec.config)
    import transformers

    cls = getattr(transformers, spec.class_name)
    config_cls = getattr(transformers, spec.class_name.replace("ForCausalLM", "Config"))
    with torch.device("meta"):
        return cls(config_cls(**spec.config))


def _matches(name: str, targets: tuple[str, ...]) -> bool:
    # peft's rule for a list of target names: the module's qualified name is the target or ends in ".target".
    return any(name == t or name.endswith("." + t) for t in targets)


def lora_parameter_count(model: torch.nn.Module, rank: int, targets: tuple[str, ...]) -> int:
    """Parameters peft's LoRA adds: r (in + out) per targeted nn.Linear (A: r x in, B: out x r)."""
    return sum(
        rank * (m.in_features + m.out_features)
        for name, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and _matches(name, targets)
    )


@dataclass(frozen=True)
class ModelFacts:
    """What the memory arithmetic needs from a built model."""

    name: str
    params: int
    buffers: int  # e.g. SD3's fixed sin-cos position table: frozen, but stored on the GPU
    lora_params: int
    blocks: int
    largest_block: int  # parameters of the largest FSDP unit
    root_params: int  # parameters outside the blocks (FSDP2's root unit)
    hidden: int
    tokens: int
    micro_batch: int
    vocab: int
    frozen_bytes: int = 2


def model_facts(spec: ModelSpec, model: torch.nn.Module | None = None) -> ModelFacts:
    model = build_meta(spec) if model is None else model
    blocks = [m for m in model.modules() if type(m).__name__ in spec.block_classes]
    if not blocks:
        raise ValueError(f"{spec.name}: no module of classes {spec.block_classes}")
    sizes = [sum(p.numel() for p in b.parameters()) for b in blocks]
    params = sum(p.numel() for p in model.parameters())
    cfg = spec.config
    hidden = cfg.get("hidden_size") or cfg.get("dim") or cfg["num_attention_heads"] * cfg["attention_head_dim"]
    return ModelFacts(
        name=spec.name,
        params=params,
        buffers=sum(b.numel() for b in model.buffers()),
        lora_params=lora_parameter_count(model, spec.lora_rank, spec.lora_targets),
        blocks=len(blocks),
        largest_block=max(sizes),
        root_params=params - sum(sizes),
        hidden=hidden,
        tokens=spec.tokens,
        micro_batch=spec.micro_batch,
        vocab=spec.vocab,
        frozen_bytes=spec.frozen_bytes,
    )


class PerRankGiB:
    """A table row's total GiB per rank and whether it fits the GPU (rows carry params, grads, optim, gathered and
    activations in GiB)."""

    params: float
    grads: float
    optim: float
    gathered: float
    activations: float

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optim + self.gathered + self.activations

    @property
    def fits(self) -> bool:
        return self.total * GiB <= USABLE * GPU_BYTES


@dataclass(frozen=True)
class MemoryRow(PerRankGiB):
    """One line of the table: GiB per rank."""

    model: str
    mode: str
    engine: str
    world: int
    params: float
    grads: float
    optim: float
    gathered: float
    activations: float


def activation_bytes(f: ModelFacts) -> float:
    sbh = f.tokens * f.micro_batch * f.hidden
    logits = f.micro_batch * f.tokens * f.vocab * 4
    return f.blocks * 2 * sbh + 34 * sbh + logits


def memory_row(f: ModelFacts, mode: str, engine: str, world: int) -> MemoryRow:
    """The formulas of the module docstring, for one (model, mode, engine, world size)."""
    if mode not in MODES or engine not in ENGINES or world < 1:
        raise ValueError(f"no row for mode={mode!r} engine={engine!r} world={world}")
    trained = f.lora_params if mode == "LoRA" else f.params
    frozen = ((f.params if mode == "LoRA" else 0) + f.buffers) * f.frozen_bytes / 2  # in bf16-equivalents: 2F
    w = world
    if engine == "DDP":
        params, grads, optim, gathered = 2 * frozen + 4 * trained, 4 * trained, 8 * trained, 0
    elif engine == "FSDP2":
        params, grads, optim = (2 * frozen + 4 * trained) / w, 4 * trained / w, 8 * trained / w
        gathered = 2 * (f.root_params + 2 * f.largest_block)
    elif engine == "ZeRO-2":
        params, grads, optim, gathered = 2 * frozen + 4 * trained, 4 * trained / w, 12 * trained / w, 0
    else:  # ZeRO-3
        params, grads, optim = 2 * frozen / w + 4 * trained, 4 * trained / w, 12 * trained / w
        gathered = 2 * 2 * f.largest_block
    return MemoryRow(
        f.name, mode, engine, world, params / GiB, grads / GiB, optim / GiB, gathered / GiB, activation_bytes(f) / GiB
    )


def memory_table(facts: list[ModelFacts]) -> list[MemoryRow]:
    return [memory_row(f, mode, engine, w) for f in facts for mode in MODES for engine in ENGINES for w in WORLDS]


def render_markdown(specs: tuple[ModelSpec, ...], facts: list[ModelFacts], rows: list[MemoryRow]) -> str:
    out = [
        "| model | parameters (meta-built) | buffers | LoRA parameters | blocks | hidden | workload |",
        "|---|---|---|---|---|---|---|",
    ]
    for s, f in zip(specs, facts):
        out.append(
            f"| [{f.name}]({s.source}) | {f.params / 1e9:.2f} B | {f.buffers / 1e6:.0f} M | "
            f"{f.lora_params / 1e6:.1f} M (r{s.lora_rank}) | {f.blocks} | {f.hidden} | {s.workload} |"
        )
    out += ["", 'GiB per rank. "fits": total <= 90 % of 80 GB.', ""]
    for f in facts:
        out += [
            f"#### {f.name}",
            "",
            "| mode | engine | GPUs | params | grads | optimizer | gathered | activations | total | fits 80 GB |",
            "|---|---|---|---:|---:|---:|---:|---:|---:|---|",
        ]
        for r in (r for r in rows if r.model == f.name):
            out.append(
                f"| {r.mode} | {r.engine} | {r.world} | {r.params:.1f} | {r.grads:.1f} | {r.optim:.1f} | "
                f"{r.gathered:.1f} | {r.activations:.1f} | {r.total:.1f} | {'yes' if r.fits else 'no'} |"
            )
        out.append("")
    return "\n".join(out)


def check_counts(facts: list[ModelFacts]) -> None:
    """The meta-built models have the published sizes (guards the config dicts above)."""
    expected = {"FLUX.1-dev": 11.9e9, "SD3.5-Medium": 2.24e9, "Qwen-Image": 20.4e9, "Qwen2.5-7B": 7.62e9,
                "FLUX.1-Kontext-dev": 11.9e9, "Qwen-Image-Edit": 20.4e9, "Qwen-Image-Edit-2509": 20.4e9,
                "FLUX.2-klein-4B": 3.88e9, "FLUX.2-klein-9B": 9.08e9, "Z-Image-Turbo": 6.15e9}  # fmt: skip
    for f in facts:
        want = expected[f.name]
        if abs(f.params - want) > 0.01 * want:
            raise AssertionError(f"{f.name}: {f.params / 1e9:.3f} B parameters, expected ~{want / 1e9:.2f} B")


TABLE_START, TABLE_END = "<!-- memory-table:start -->", "<!-- memory-table:end -->"


def replace_table(doc: str, table: str) -> str:
    """Put `table` between the markers of docs/scaling.md, leaving the hand-written text alone."""
    pattern = re.compile(re.escape(TABLE_START) + ".*?" + re.escape(TABLE_END), re.DOTALL)
    if not pattern.search(doc):
        raise ValueError(f"the document has no {TABLE_START} ... {TABLE_END} block")
    return pattern.sub(lambda _: f"{TABLE_START}\n{table}\n{TABLE_END}", doc)
