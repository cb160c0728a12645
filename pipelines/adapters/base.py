"""The adapter contract: what the sampler and the trainer may ask of a text-to-image model.

An adapter wraps the family's real diffusers pipeline (`self.pipe`) and adds only what RL needs:
prompt embeddings cached per string, the denoiser output for a batch of states with classifier-free
guidance in one batched forward, decoding, and LoRA (train, disable for the reference, save / load in
the format `pipeline.load_lora_weights` reads). diffusers is imported lazily, inside methods.

Families implement `_encode` (texts -> rows), `_forward` (one denoiser call) and `_tiny_pipeline`.
"""

from __future__ import annotations

import abc
import contextlib
import importlib
import os
import re
from collections import OrderedDict
from typing import Any, ClassVar, Iterator, Optional, Sequence

import torch
from torch import Tensor

from .embeds import PromptEmbeds, real_tokens, stack_rows
from .export import write_lora, write_model_folder

CFG_MODES = ("full", "detach_uncond", "none")
LORA_INITS = ("gaussian", "default")
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


class Adapter(abc.ABC):
    """One model family over its diffusers pipeline. See the module docstring."""

    family: ClassVar[str]
    prediction: ClassVar[str] = "velocity"
    pipeline_class: ClassVar[str]  # attribute of `diffusers`, imported lazily
    # the `diffusers.loaders` LoRA loader mixin whose `save_lora_weights` writes the LoRA file, for a pipeline
    # class that has none (HunyuanVideo15Pipeline in diffusers 0.42); None: the pipeline class's own
    lora_writer: ClassVar[str | None] = None
    denoiser_name: ClassVar[str] = "transformer"  # pipeline component that LoRA attaches to
    lora_targets: ClassVar[tuple[str, ...]]
    default_max_sequence_length: ClassVar[int] = 256
    options: ClassVar[tuple[str, ...]] = ("max_sequence_length", "prompt_cache_size")  # constructor kw
    tiny_max_sequence_length: ClassVar[int] = 16  # = the tiny tokenizers' length
    # New prompts are encoded one at a time: text encoders' pooled outputs change in the last bits with
    # the batch they are encoded in, and a prompt's embedding must not depend on which prompts came
    # before it (exact resume; the same rollout whatever the cache held). Each prompt is encoded once.
    encode_batch_size: ClassVar[int] = 1
    block_names: ClassVar[tuple[str, ...]] = ("transformer_blocks",)  # the denoiser's repeated blocks (compile)
    latent_ndim: ClassVar[int] = 4  # [B, C, h, w]; video families: 5 ([B, C, F, h, w], latent_shape gives (C, F, h, w))
    # Speed switches (pipelines.speed.apply_speed sets them): autocast dtype of denoiser forwards, CFG in
    # one batched forward or two, VAE decode chunk size (None: all images at once).
    autocast_dtype: torch.dtype | None = None
    cfg_forward: str = "batched"
    decode_batch_size: int | None = None

    def __init__(self, pipe: Any, *, max_sequence_length: int | None = None, prompt_cache_size: int = 256):
        self.pipe = pipe
        self.max_sequence_length = max_sequence_length or self.default_max_sequence_length
        self.prompt_cache_size = prompt_cache_size
        self._cache: OrderedDict[str, dict[str, Tensor]] = OrderedDict()
        # encode_prompts results while the cache keeps the same rows (a rollout and its update ask for the
        # same batch several times); emptied whenever a row is encoded, evicted or moved
        self._stacked: dict[tuple[tuple[str, ...], str], PromptEmbeds] = {}
        for module in pipe.components.values():
            if isinstance(module, torch.nn.Module):
                module.requires_grad_(False)  # only LoRA parameters are ever trained
                module.eval()

    # ---- components ----------------------------------------------------------------------------

    @property
    def denoiser(self) -> torch.nn.Module:
        return getattr(self.pipe, self.denoiser_name)

    @property
    def vae(self) -> torch.nn.Module:
        return self.pipe.vae

    @property
    def scheduler_config(self) -> dict[str, Any]:
        return {k: v for k, v in self.pipe.scheduler.config.items() if not k.startswith("_")}

    @property
    def device(self) -> torch.device:
        return _first_parameter(self.denoiser).device

    @property
    def dtype(self) -> torch.dtype:
        return _first_parameter(self.denoiser).dtype

    @property
    def vae_scale_factor(self) -> int:
        return self.vae_scale_of(self.vae.config)

    def to(self, device: Any) -> "Adapter":
        """Move every component (dtype is chosen at construction: a cast here would also cast LoRA)."""
        self.pipe.to(device)
        self._cache.clear()  # cached rows live on the old device
        self._stacked.clear()
        return self

    def latent_shape(self, height: int, width: int) -> tuple[int, int, int]:
        """Unpacked latent (C, h, w) for an image of height x width pixels."""
        problem = self.multiple_problem(height, width, self.denoiser.config, self.vae.config)
        if problem:
            raise ValueError(problem)
        return (self._latent_channels(), height // self.vae_scale_factor, width // self.vae_scale_factor)

    def check_resolution(self, height: int, width: int) -> None:
        """ValueError when the denoiser cannot take height x width (a multiple, or its positional-embedding
        maximum: a tiny test model stops at 128 px)."""
        problem = self.resolution_problem(height, width, self.denoiser.config, self.vae.config)
        if problem:
            raise ValueError(problem)

    def image_seq_len(self, height: int, width: int) -> int:
        """Image tokens the denoiser sees (FLUX / Qwen-Image schedules shift with this)."""
        _, h, w = self.latent_shape(height, width)
        return (h // self._patch_size()) * (w // self._patch_size())

    def _latent_channels(self) -> int:
        return self.vae.config.latent_channels

    def flow_grid(self, num_steps: int, height: int, width: int, shift: float | None) -> Any:
        """The sigma grid (a FlowSchedule) of the family's own pipeline where the sampler's "scheduler" grid would
        differ from it (FLUX.2's step-dependent mu, Z-Image's uniform spacing); None: the sampler's default."""
        return None

    def _patch_size(self) -> int:
        return self.patch_of(self.denoiser.config)

    # ---- geometry from the components' configs alone (checked before any weight loads) --------------

    @classmethod
    def vae_scale_of(cls, vae_config: Any) -> int:
        """Pixels per latent cell, from the VAE's config."""
        return 2 ** (len(vae_config["block_out_channels"]) - 1)

    @classmethod
    def patch_of(cls, denoiser_config: Any) -> int:
        """Latent cells per image token side, from the denoiser's config."""
        return 1

    @classmethod
    def multiple_problem(cls, height: int, width: int, denoiser_config: Any, vae_config: Any) -> Optional[str]:
        mult = cls.vae_scale_of(vae_config) * cls.patch_of(denoiser_config)
        if height % mult or width % mult:
            return f"{cls.family}: height and width must be multiples of {mult}, got {height}x{width}"
        return None

    @classmethod
    def resolution_problem(cls, height: int, width: int, denoiser_config: Any, vae_config: Any) -> Optional[str]:
        """Why the denoiser cannot take height x width (None: it can)."""
        if problem := cls.multiple_problem(height, width, denoiser_config, vae_config):
            return problem
        scale, patch = cls.vae_scale_of(vae_config), cls.patch_of(denoiser_config)
        largest = denoiser_config.get("pos_embed_max_size")
        if largest and max(height, width) // scale // patch > largest:
            return (
                f"{cls.family}: {height}x{width} px is larger than this model takes ({largest * patch * scale} px a "
                "side); set a smaller height / width"
            )
        return None

    @classmethod
    def pretrained_configs(cls, source: str | os.PathLike, **kw: Any) -> tuple[dict[str, Any], dict[str, Any]]:
        """The denoiser's and the VAE's config.json of a pipeline folder or hub id (no weights are read); `kw`:
        from_pretrained's revision / cache_dir / token / local_files_only."""
        from diffusers import ConfigMixin

        class ComponentConfig(ConfigMixin):  # diffusers' config.json reader (a folder or the hub), no model class
            config_name = "config.json"

        keep = {k: kw[k] for k in ("revision", "cache_dir", "token", "local_files_only") if k in kw}
        source = os.fspath(source)
        return (
            dict(ComponentConfig.load_config(source, subfolder=cls.denoiser_name, **keep)),
            dict(ComponentConfig.load_config(source, subfolder="vae", **keep)),
        )

    # ---- prompts -------------------------------------------------------------------------------

    @torch.no_grad()
    def encode_prompts(self, prompts: Sequence[str], negative_prompt: str = "") -> PromptEmbeds:
        """Embeddings for `prompts` (+ `negative_prompt` as the uncond branch), encoded once per string."""
        if isinstance(prompts, str):
            raise TypeError("prompts must be a list of strings, not a single string")
        wanted = list(dict.fromkeys([*prompts, negative_prompt]))
        key = (tuple(prompts), negative_prompt)
        missing = [p for p in wanted if p not in self._cache]
        if not missing and key in self._stacked:
            for p in wanted:
                self._cache.move_to_end(p)
            return self._stacked[key]
        if missing or len(self._stacked) >= 16:
            self._stacked.clear()
        for start in range(0, len(missing), self.encode_batch_size):
            chunk = missing[start : start + self.encode_batch_size]
            rows = self._encode(chunk)
            for i, p in enumerate(chunk):
                self._cache[p] = real_tokens(rows, i)  # masked streams: real tokens only; `stack_rows` pads per batch
        for p in wanted:
            self._cache.move_to_end(p)
        cond = stack_rows([self._cache[p] for p in prompts])
        uncond = stack_rows([self._cache[negative_prompt]] * len(prompts))
        while len(self._cache) > max(self.prompt_cache_size, len(wanted)):
            self._cache.popitem(last=False)
            self._stacked.clear()
        embeds = PromptEmbeds.from_rows(cond, uncond)
        if not torch.is_inference_mode_enabled():  # inference tensors could not be reused with grad
            self._stacked[key] = embeds
        return embeds

    @abc.abstractmethod
    def _encode(self, texts: list[str]) -> dict[str, Tensor]:
        """One encoder pass: {"embeds": [N, L, D], optional "pooled": [N, D], "mask": [N, L], and a second token
        stream "embeds2" [N, L2, D2] with "mask2" [N, L2]}."""

    # ---- denoiser ------------------------------------------------------------------------------

    def model_output(
        self,
        latents: Tensor,
        sigma: Tensor | float,
        embeds: PromptEmbeds,
        guidance_scale: float,
        cfg_mode: str = "full",
    ) -> Tensor:
        """Denoiser output (velocity or epsilon) for latents [B, C, h, w], float32, same shape.

        `sigma` is the flow time in [0, 1] (velocity families) or the DDIM timestep (epsilon).
        "full": uncond + w * (cond - uncond) from one batched forward; "detach_uncond": the same value
        with the uncond branch detached, so gradients reach the policy only through cond (Flow-GRPO
        training); "none": cond only, where `guidance_scale` is used only by a guidance embedding (FLUX dev).
        """
        if cfg_mode not in CFG_MODES:
            raise ValueError(f"cfg_mode must be one of {CFG_MODES}, got '{cfg_mode}'")
        if latents.dim() != self.latent_ndim:  # 5 for video families: [B, C, F, h, w]
            raise ValueError(f"latents must be {self.latent_ndim}-D [B, C, (F,) h, w], got {tuple(latents.shape)}")
        b = latents.shape[0]
        if len(embeds) != b:
            raise ValueError(f"embeds have {len(embeds)} rows but latents have {b}")
        sigma = torch.as_tensor(sigma, dtype=torch.float32, device=latents.device).reshape(-1).expand(b)
        x = latents.to(self.dtype)
        with self._precision(x):
            if cfg_mode == "none":
                return self._forward(x, sigma, embeds.conditional(), guidance_scale).float()
            if self.cfg_forward == "split":  # two forwards; the uncond one keeps no activations when detached
                with torch.set_grad_enabled(torch.is_grad_enabled() and cfg_mode != "detach_uncond"):
                    uncond = self._forward(x, sigma, embeds.unconditional(), None).float()
                cond = self._forward(x, sigma, embeds.conditional(), None).float()
            else:
                out = self._forward(torch.cat([x, x]), torch.cat([sigma, sigma]), embeds.cfg_pair(), None).float()
                uncond, cond = out.chunk(2)
        if cfg_mode == "detach_uncond":
            uncond = uncond.detach()
        return self._combine(uncond, cond, guidance_scale)

    def _precision(self, x: Tensor) -> contextlib.AbstractContextManager:
        """Autocast of denoiser forwards when `autocast_dtype` is set (weights keep their own dtype)."""
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=x.device.type, dtype=self.autocast_dtype)

    def _combine(self, uncond: Tensor, cond: Tensor, w: float) -> Tensor:
        return uncond + w * (cond - uncond)

    @abc.abstractmethod
    def _forward(self, x: Tensor, sigma: Tensor, text: dict[str, Tensor | None], guidance: float | None) -> Tensor:
        """One denoiser call on [N, C, h, w] in the model dtype; `guidance` is None in the CFG modes."""

    # ---- images --------------------------------------------------------------------------------

    def decode(self, latents: Tensor, prompts: Sequence[str] | None = None) -> Tensor:
        """Images [B, 3, H, W] float32 in [0, 1]; latents are un-scaled / un-shifted as the VAE expects.
        With `decode_batch_size`, decoded in chunks of that many (same images, lower peak memory). `prompts` (one per
        row): what a family whose output also holds its prompt's input decodes with (wan2.2_i2v: the first frame);
        the others ignore them."""
        n = self.decode_batch_size
        if n is not None and latents.shape[0] > n:
            return torch.cat([self._decode(chunk) for chunk in latents.split(n)])
        return self._decode(latents)

    def _decode(self, latents: Tensor) -> Tensor:
        cfg = self.vae.config
        z = latents.to(self.vae.dtype) / cfg.scaling_factor + (getattr(cfg, "shift_factor", None) or 0.0)
        image = self.vae.decode(z, return_dict=False)[0]
        return (image.float() / 2 + 0.5).clamp(0, 1)

    # ---- LoRA ----------------------------------------------------------------------------------

    def add_lora(
        self,
        rank: int = 32,
        alpha: float | None = None,
        target_modules: Sequence[str] | None = None,
        init: str = "gaussian",
        adapter_name: str = "default",
        dtype: torch.dtype = torch.float32,
    ) -> list[torch.nn.Parameter]:
        """Attach a LoRA adapter to the denoiser; returns its (only) trainable parameters.

        Both inits start with B = 0, so the LoRA model starts exactly at the base model. "gaussian"
        (A ~ N(0, 1/r), as Flow-GRPO) or "default" (peft's Kaiming-uniform A). alpha defaults to rank.
        LoRA weights are kept in `dtype` (float32) even on a bf16 base so small updates are not lost.
        """
        from peft import LoraConfig

        if init not in LORA_INITS:
            raise ValueError(f"init must be one of {LORA_INITS}, got '{init}'")
        config = LoraConfig(
            r=rank,
            lora_alpha=rank if alpha is None else alpha,
            target_modules=list(target_modules or self.lora_targets),
            init_lora_weights="gaussian" if init == "gaussian" else True,
        )
        self.denoiser.add_adapter(config, adapter_name=adapter_name)
        return self._lora_trainable(adapter_name, dtype)

    def _lora_trainable(self, adapter_name: str, dtype: torch.dtype | None) -> list[torch.nn.Parameter]:
        params = []
        for name, p in self.denoiser.named_parameters():
            mine = f".{adapter_name}." in name and ".lora_" in name
            if mine and dtype is not None:
                p.data = p.data.to(dtype)
            p.requires_grad_(mine)
            if mine:
                params.append(p)
        if not params:
            raise ValueError(f"adapter '{adapter_name}' matched no module of the {self.family} denoiser")
        return params

    def lora_parameters(self, adapter_name: str = "default") -> list[torch.nn.Parameter]:
        return [p for n, p in self.denoiser.named_parameters() if f".{adapter_name}." in n and ".lora_" in n]

    @contextlib.contextmanager
    def reference(self) -> Iterator["Adapter"]:
        """The base model (all LoRA adapters off) for the KL reference, without a second model copy."""
        if not getattr(self.denoiser, "peft_config", None):
            yield self  # no adapter: the denoiser already is the base model
            return
        # peft's disable/enable also rewrite requires_grad of the LoRA weights; restore ours after.
        flags = [(p, p.requires_grad) for p in self.denoiser.parameters()]
        self.denoiser.disable_adapters()
        try:
            yield self
        finally:
            self.denoiser.enable_adapters()
            for p, flag in flags:
                p.requires_grad_(flag)

    def save_lora(
        self, path: str | os.PathLike, adapter_name: str = "default", state: dict[str, Tensor] | None = None
    ) -> str:
        """Write `path/pytorch_lora_weights.safetensors` (+ LoraConfig as metadata, so alpha survives) with diffusers'
        writer (`lora_writer`) for `<Pipeline>.load_lora_weights(path)`. `state`: the weights gathered from a sharded
        run."""
        if adapter_name not in getattr(self.denoiser, "peft_config", {}):
            raise ValueError(f"no LoRA adapter '{adapter_name}' on the {self.family} denoiser")
        return write_lora(self._lora_writer(), self.denoiser, path, adapter_name, self.denoiser_name, state)

    def save_denoiser(self, path: str | os.PathLike, state: dict[str, Tensor] | None = None) -> str:
        """A fully fine-tuned denoiser as a diffusers model folder (config.json + safetensors shards) for
        `<Model>.from_pretrained(path)`. `state`: the weights gathered from a sharded run (default: the live model's)."""
        return write_model_folder(self.denoiser, path, state)

    def load_lora(
        self, path: str | os.PathLike, adapter_name: str = "default", dtype: torch.dtype = torch.float32
    ) -> list[torch.nn.Parameter]:
        """Load a diffusers-format LoRA (a folder or a .safetensors file) as `adapter_name`, replacing
        an adapter of that name; returns its parameters, trainable."""
        path = os.fspath(path)
        if not os.path.exists(path):
            raise FileNotFoundError(f"LoRA weights not found: '{path}'")
        kw: dict[str, Any] = {"use_safetensors": True}  # no pickle: never fall back to .bin
        if os.path.isfile(path):
            path, kw["weight_name"] = os.path.split(path)
        if adapter_name in getattr(self.denoiser, "peft_config", {}):
            self.denoiser.delete_adapters(adapter_name)
        self.denoiser.load_lora_adapter(path, prefix=self.denoiser_name, adapter_name=adapter_name, **kw)
        self.denoiser.set_adapter(adapter_name)
        return self._lora_trainable(adapter_name, dtype)

    # ---- construction --------------------------------------------------------------------------

    @classmethod
    def _pipeline_cls(cls) -> Any:
        return getattr(importlib.import_module("diffusers"), cls.pipeline_class)

    @classmethod
    def _lora_writer(cls) -> Any:
        """The class whose `save_lora_weights` writes this family's LoRA file: `lora_writer` or the pipeline class."""
        if cls.lora_writer is None:
            return cls._pipeline_cls()
        return getattr(importlib.import_module("diffusers.loaders"), cls.lora_writer)

    @classmethod
    def from_pretrained(
        cls, path_or_hub_id: str | os.PathLike, dtype: torch.dtype = torch.float32, device: Any = "cpu", **kw: Any
    ) -> "Adapter":
        """Load a diffusers pipeline folder (or hub id) of this family. Adapter options (`options`:
        max_sequence_length, prompt_cache_size, family extras) are split off; other kw go to the
        pipeline's from_pretrained (variant, text_encoder_3=None, ...)."""
        source = os.fspath(path_or_hub_id)
        local = os.path.exists(source)
        if not local and not _HUB_ID.match(source):
            raise FileNotFoundError(f"{cls.family} weights not found: '{source}' does not exist (nor is it a hub id)")
        if local and not os.path.isfile(os.path.join(source, "model_index.json")):  # also: a single file
            raise FileNotFoundError(f"'{source}' has no model_index.json: expected a diffusers pipeline folder")
        own = {k: kw.pop(k) for k in cls.options if k in kw}
        try:
            pipe = cls._pipeline_cls().from_pretrained(source, **{_dtype_kwarg(): dtype, **cls._load_kwargs(), **kw})
        except OSError as err:
            if local:
                raise
            offline = os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False")
            raise FileNotFoundError(
                f"'{source}' is not a local folder and could not be loaded as a hub id"
                + (" (HF_HUB_OFFLINE is set)" if offline else "")
                + f": {err}"
            ) from err
        return cls(pipe.to(device), **own)

    @classmethod
    def _load_kwargs(cls) -> dict[str, Any]:
        return {}

    @classmethod
    def tiny(cls, seed: int = 0, dtype: torch.dtype = torch.float32, device: Any = "cpu", **kw: Any) -> "Adapter":
        """Same architecture classes with tiny random weights (seeded) and offline tokenizers."""
        own = {k: kw.pop(k) for k in cls.options if k in kw}
        own.setdefault("max_sequence_length", cls.tiny_max_sequence_length)
        with torch.random.fork_rng(devices=[]):  # seeded weights without disturbing the caller's RNG
            torch.manual_seed(seed)
            pipe = cls._tiny_pipeline(**kw)
        pipe.to(device)
        if dtype != torch.float32:  # tiny weights are built in float32
            pipe.to(dtype=dtype)
        return cls(pipe, **own)

    @classmethod
    @abc.abstractmethod
    def _tiny_pipeline(cls, **kw: Any) -> Any:
        """The family's diffusers pipeline built from tiny configs (seeded by the caller)."""


def _dtype_kwarg() -> str:
    # diffusers renamed from_pretrained's `torch_dtype` to `dtype` (0.42 warns on the old name).
    import diffusers.utils.deprecation_utils as dep

    return "dtype" if hasattr(dep, "_TORCH_DTYPE_DEPRECATION_MESSAGE") else "torch_dtype"


def _first_parameter(module: torch.nn.Module) -> Tensor:
    """`next(module.parameters())` without its generators (~1 us instead of ~30 us: read at every forward)."""
    todo = [module]
    while todo:
        m = todo.pop(0)
        for p in m._parameters.values():
            if p is not None:
                return p
        todo[:0] = [c for c in m._modules.values() if c is not None]
    raise ValueError(f"{type(module).__name__} has no parameters")
