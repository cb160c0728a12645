"""The memory table: counts from the real-size models built on the meta device, the arithmetic of one
row against a hand computation, the workloads against the shipped recipes, docs/scaling.md current."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from flowgrpo.scaling import memory as mem

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def facts() -> dict[str, mem.ModelFacts]:
    return {s.name: mem.model_facts(s) for s in mem.SPECS}


def test_models_are_built_at_full_size_on_meta_without_memory():
    model = mem.build_meta(mem.SPECS[0])
    assert {p.device.type for p in model.parameters()} == {"meta"}
    assert type(model).__name__ == "FluxTransformer2DModel"


def test_parameter_counts_are_the_published_sizes(facts):
    mem.check_counts(list(facts.values()))
    assert round(facts["FLUX.1-dev"].params / 1e9, 1) == 11.9
    assert round(facts["Qwen-Image"].params / 1e9, 1) == 20.4
    assert round(facts["Qwen2.5-7B"].params / 1e9, 2) == 7.62
    # SD3.5-Medium's "2.5 B" counts its fixed 384 x 384 x 1536 sin-cos position table, a buffer here.
    sd35 = facts["SD3.5-Medium"]
    assert sd35.buffers == 384 * 384 * 1536
    assert round((sd35.params + sd35.buffers) / 1e9, 2) == 2.47
    assert (
        facts["FLUX.1-dev"].blocks,
        facts["SD3.5-Medium"].blocks,
        facts["Qwen-Image"].blocks,
        facts["Qwen2.5-7B"].blocks,
    ) == (19 + 38, 24, 60, 28)


def test_a_wrong_config_is_caught():
    bad = mem.ModelFacts(
        "FLUX.1-dev",
        params=8_000_000_000,
        buffers=0,
        lora_params=0,
        blocks=1,
        largest_block=1,
        root_params=0,
        hidden=1,
        tokens=1,
        micro_batch=1,
        vocab=0,
    )
    with pytest.raises(AssertionError, match="FLUX.1-dev"):
        mem.check_counts([bad])


@pytest.mark.parametrize("kind", ["sd3", "qwen2"])
def test_lora_count_equals_peft_s(kind):
    """The analytic LoRA count (r (in + out) per targeted Linear) is what peft adds, on tiny models."""
    from peft import LoraConfig, get_peft_model

    if kind == "sd3":
        from diffusers import SD3Transformer2DModel

        model = SD3Transformer2DModel(
            sample_size=8,
            patch_size=2,
            in_channels=4,
            out_channels=4,
            num_layers=2,
            attention_head_dim=8,
            num_attention_heads=2,
            joint_attention_dim=16,
            caption_projection_dim=16,
            pooled_projection_dim=16,
            pos_embed_max_size=8,
            dual_attention_layers=(0,),
            qk_norm="rms_norm",
        )
        targets = mem.IMAGE_LORA_TARGETS
    else:
        from transformers import Qwen2Config, Qwen2ForCausalLM

        model = Qwen2ForCausalLM(
            Qwen2Config(
                vocab_size=64,
                hidden_size=16,
                intermediate_size=32,
                num_hidden_layers=2,
                num_attention_heads=2,
                num_key_value_heads=1,
            )
        )
        targets = mem.TEXT_LORA_TARGETS
    analytic = mem.lora_parameter_count(model, 4, targets)
    peft_model = get_peft_model(model, LoraConfig(r=4, target_modules=list(targets)))
    assert analytic == sum(p.numel() for n, p in peft_model.named_parameters() if "lora_" in n) > 0


def test_one_row_against_a_hand_computation(facts):
    """FLUX.1-dev, full fine-tune, ZeRO-2, 8 GPUs, worked out by hand:
    P = 11 901 408 320 parameters (the meta count), no buffers, 57 blocks, h = 24 x 128 = 3072,
    s = 2025 latent (720 px) + 512 T5 tokens, b = 1 (configs/t2i/real/_flux.yaml).
      parameters  4 P (fp32 module, replicated)        = 47 605 633 280 B = 44.3362 GiB
      gradients   4 P / 8 (fp32, partitioned)          =  5 950 704 160 B =  5.5420 GiB
      optimizer   12 P / 8 (fp32 master, m, v)         = 17 852 112 480 B = 16.6261 GiB
      activations (57 x 2 + 34) x 2537 x 1 x 3072      =  1 153 462 272 B =  1.0743 GiB
      total                                                                 67.5786 GiB = 72.56 GB -> does not
      fit (> 72 GB usable of 80): FSDP2 is the engine for this run"""
    assert facts["FLUX.1-dev"].params == 11_901_408_320
    row = mem.memory_row(facts["FLUX.1-dev"], "full", "ZeRO-2", 8)
    assert row.params == pytest.approx(44.3362, abs=1e-4)
    assert row.grads == pytest.approx(5.5420, abs=1e-4)
    assert row.optim == pytest.approx(16.6261, abs=1e-4)
    assert row.gathered == 0
    assert row.activations == pytest.approx(1.0743, abs=1e-4)
    assert row.total == pytest.approx(67.5786, abs=1e-3) and not row.fits


def test_the_wall_issue_14_names(facts):
    """An unsharded full fine-tune of FLUX.1-dev needs ~190 GB for weights, gradients and AdamW alone."""
    for engine, per_param in (("DDP", 16), ("ZeRO-2", 20)):  # ZeRO-2: DeepSpeed's fp32 master beside the fp32 module
        row = mem.memory_row(facts["FLUX.1-dev"], "full", engine, 1)
        assert (row.params + row.grads + row.optim) * mem.GiB == pytest.approx(per_param * 11_901_408_320)
        assert not row.fits
    assert mem.memory_row(facts["FLUX.1-dev"], "full", "FSDP2", 8).fits
    # Sharding divides the model state by the world size and leaves activations alone.
    one, many = (mem.memory_row(facts["Qwen-Image"], "full", "ZeRO-3", w) for w in (1, 64))
    assert one.optim == pytest.approx(64 * many.optim) and one.activations == many.activations


def test_workloads_are_the_shipped_recipes():
    from flowgrpo.text.config import TextLoraConfig
    from pipelines.adapters.flux import FluxAdapter
    from pipelines.adapters.qwenimage import QwenImageAdapter
    from pipelines.adapters.sd3 import SD3Adapter

    specs = {s.name: s for s in mem.SPECS}
    real = ROOT / "configs/t2i/real"
    flux, sd35 = (yaml.safe_load((real / name).read_text()) for name in ("_flux.yaml", "_sd35m.yaml"))
    flux_lora = yaml.safe_load((real / "dance_grpo_lora.yaml").read_text())
    assert specs["FLUX.1-dev"].micro_batch == flux["train"]["micro_batch_size"]
    assert specs["FLUX.1-dev"].lora_rank == flux_lora["model"]["lora"]["rank"]
    # The published FLUX LoRA runs (docs/recipes.md) train 4 of the family's 8 default targets over fp32 frozen
    # weights; the table's LoRA rows still model the 8 targets over bf16 weights (an upper bound on LoRA parameters).
    assert set(flux_lora["model"]["lora"]["target_modules"]) < set(mem.IMAGE_LORA_TARGETS)
    side = flux["sampler"]["height"] // 16  # VAE /8, then 2 x 2 patches
    assert flux["sampler"]["width"] == flux["sampler"]["height"]
    assert specs["FLUX.1-dev"].tokens == side * side + FluxAdapter.default_max_sequence_length
    assert specs["SD3.5-Medium"].micro_batch == sd35["train"]["micro_batch_size"]
    assert specs["SD3.5-Medium"].lora_rank == sd35["model"]["lora"]["rank"]
    assert sorted(specs["SD3.5-Medium"].lora_targets) == sorted(sd35["model"]["lora"]["target_modules"])
    assert sd35["sampler"]["height"] == sd35["sampler"]["width"] == 512  # 1024 latent tokens
    # the recipe's T5 length (Flow-GRPO's 128), not the adapter's default 256; its frozen transformer in fp32
    assert specs["SD3.5-Medium"].tokens == 1024 + 77 + sd35["model"]["options"]["max_sequence_length"]
    assert SD3Adapter.default_max_sequence_length != sd35["model"]["options"]["max_sequence_length"]
    assert (specs["SD3.5-Medium"].frozen_bytes, sd35["model"]["dtype"]) == (4, "float32")
    assert {s.frozen_bytes for n, s in specs.items() if n != "SD3.5-Medium"} == {2}
    for adapter in (FluxAdapter, SD3Adapter, QwenImageAdapter):
        assert tuple(adapter.lora_targets) == mem.IMAGE_LORA_TARGETS
    text = yaml.safe_load((ROOT / "configs/text/real/qwen2.5-1.5b_math_vllm.yaml").read_text())
    assert specs["Qwen2.5-7B"].micro_batch == text["train"]["micro_batch_size"]
    assert specs["Qwen2.5-7B"].tokens == 256 + text["generation"]["max_new_tokens"]
    assert (specs["Qwen2.5-7B"].lora_rank, mem.TEXT_LORA_TARGETS) == (
        TextLoraConfig().rank,
        tuple(TextLoraConfig().target_modules),
    )


def test_docs_table_is_current_and_markers_are_required(tmp_path):
    import importlib.util

    spec = importlib.util.spec_from_file_location("memory_table", ROOT / "scripts" / "memory_table.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.main(["--check"]) == 0, "docs/scaling.md is out of date: run python scripts/memory_table.py"
    with pytest.raises(ValueError, match="memory-table"):
        mem.replace_table("no markers here", "table")
    doc = tmp_path / "scaling.md"
    doc.write_text(f"intro\n{mem.TABLE_START}\nold\n{mem.TABLE_END}\nrest\n")
    assert script.main(["--doc", str(doc)]) == 0
    text = doc.read_text()
    assert text.startswith("intro\n") and text.endswith("rest\n")
    assert "#### FLUX.1-dev" in text and "old" not in text


def test_edit_models_count_their_reference_tokens(facts):
    """Kontext is FLUX.1-dev's transformer, Qwen-Image-Edit(-2509) Qwen-Image's; their sequence holds the reference
    image tokens (1024 px: 64 x 64 latent tokens per image) besides the generated ones and the text."""
    specs = {s.name: s for s in mem.SPECS}
    assert specs["FLUX.1-Kontext-dev"].config == specs["FLUX.1-dev"].config
    assert specs["Qwen-Image-Edit"].config == specs["Qwen-Image-Edit-2509"].config == specs["Qwen-Image"].config
    assert facts["FLUX.1-Kontext-dev"].params == facts["FLUX.1-dev"].params
    latent = 64 * 64
    assert facts["FLUX.1-Kontext-dev"].tokens == latent + latent + 512
    assert facts["Qwen-Image-Edit"].tokens == latent + latent + 37 * 37 + 256
    assert facts["Qwen-Image-Edit-2509"].tokens == latent + 3 * latent + 3 * 14 * 14 + 256
    rows = mem.memory_table([facts[n] for n in ("FLUX.1-Kontext-dev", "Qwen-Image-Edit", "Qwen-Image-Edit-2509")])
    assert {(r.model, r.mode) for r in rows if r.engine == "FSDP2"} == {
        (n, m) for n in ("FLUX.1-Kontext-dev", "Qwen-Image-Edit", "Qwen-Image-Edit-2509") for m in mem.MODES
    }
