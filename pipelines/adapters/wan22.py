"""Wan 2.2 text-to-video: TI2V-5B (one transformer, per-token timesteps, the Wan 2.2 VAE) and T2V-A14B (two
experts split at `boundary_ratio`), over diffusers' WanPipeline. Everything else (UMT5 prompts, CFG, the UniPC
grid, 5-D latents, decode to frames) is Wan 2.1's (`wan.WanAdapter`).

What WanPipeline (diffusers 0.42, pipelines/wan/pipeline_wan.py) does differently, and where it lives here:

- A14B: step t (the scheduler's integer timestep, 1000 sigma) runs `transformer` (the high-noise expert) when
  t >= boundary_ratio * 1000 (0.875 for T2V) and `transformer_2` (low noise) below, each with its own guidance:
  guidance_scale for the high expert, guidance_scale_2 (default: the same) for the low one. `model_output` routes
  every row by its own sigma, so a re-scored batch that mixes steps of both experts still matches the rollout.
- TI2V-5B: `expand_timesteps=True`: the transformer takes one timestep per video token ([B, F h w / 4]); for
  text-to-video every token is at t (no conditioning frame). Its VAE (z_dim 48, 16x spatial incl. a 2x2 patchify,
  4x temporal) is read from its config like Wan 2.1's. Image-to-video (the first latent frame clean): family
  "wan2.2_i2v" (`wan22_i2v.Wan22I2VAdapter`).

Which expert trains (`train_experts`, A14B only): the published Wan 2.2 A14B RL runs train the high-noise expert.
- Flow-Factory, examples/grpo/full/wan22/t2v.yaml@5f6cda1a3e6be3c971643beb8d1e92e7be4a9638: full fine-tune,
  `target_components: 'transformer'` (the high-noise expert), SDE steps drawn from [1, 2] of 10.
- Flow-Factory, examples/grpo/lora/wan22/t2v.yaml@5f6cda1a3e6be3c971643beb8d1e92e7be4a9638: LoRA r64 / alpha 128
  on `['transformer', 'transformer_2']`, but its SDE (= trained) steps [1, 2, 3] of 10 at shift 3 all lie above the
  0.875 boundary, so only the high-noise expert ever gets a gradient; guidance 4.0 / 3.0.
- miles_diffusion, scripts/run_diffusion_grpo_wan22_pickscore_low_memory_17gpu.py@99d2bf2063461966634bb3d9f31044e6
  f919a9f9: LoRA r64 / alpha 128, "Only `transformer` is trained", `--update-weight-target-module transformer`,
  SDE candidates 1, 2.
- verl-omni (verl-project/verl-omni examples/dancegrpo_trainer/wan22/) trains only TI2V-5B; DanceGRPO has no Wan
  2.2 recipe. Default here: ("high",). The trained expert is the adapter's `denoiser` (LoRA, full fine-tune,
  saving, sharding all act on it); the other one stays frozen: no gradient, not in the optimizer, not saved.
  `train_experts: [high, low]` trains both (their LoRAs / weights are one `WanExperts` module).
- Trained steps: only steps run by a trained expert can carry a gradient; `restrict_plan(plan, schedule)` turns
  the other steps' `trained` off (they are still sampled as the plan says, SDE included).

Saved LoRA: diffusers' Wan loader reads one expert per file (keys `transformer.*`); the low-noise expert's file is
loaded with `WanPipeline.load_lora_weights(folder, load_into_transformer_2=True)`. One trained expert: its file is
in `path`; both: the high-noise expert's in `path`, the low-noise expert's in `path/transformer_2`.
"""

from __future__ import annotations

import contextlib
import copy
import os
from dataclasses import replace
from typing import Any, Iterator, Sequence

import torch
from torch import Tensor

from .base import Adapter
from .embeds import PromptEmbeds
from .export import write_lora
from .wan import _COMMON, WanAdapter

EXPERTS = {"high": "transformer", "low": "transformer_2"}  # expert -> WanPipeline component
DEFAULT_TRAIN_EXPERTS = ("high",)  # the published runs' choice (module docstring)

# The published configs, as specs (diffusers scripts/convert_wan_to_diffusers.py@58eb52c0803ea9af3abec60841c2a093bd
# f1f951: get_transformer_config("Wan2.2-TI2V-5B" / "Wan2.2-T2V-A14B"), vae22_diffusers_config, and the pipelines it
# writes: T2V-A14B boundary_ratio 0.875, TI2V-5B expand_timesteps=True, UniPC flow_shift 5.0 (TI2V) / 3.0 (A14B)).
WAN22_SPECS: dict[str, dict[str, Any]] = {
    "wan2.2-ti2v-5b": {**_COMMON, "in_channels": 48, "out_channels": 48, "num_attention_heads": 24,
                       "attention_head_dim": 128, "ffn_dim": 14336, "num_layers": 30},
    # each of the two experts (transformer = high noise, transformer_2 = low noise): Wan 2.1 14B's architecture
    "wan2.2-t2v-a14b": {**_COMMON, "num_attention_heads": 40, "attention_head_dim": 128, "ffn_dim": 13824,
                        "num_layers": 40},
}  # fmt: skip
WAN22_VAE_SPEC: dict[str, Any] = {
    "base_dim": 160,
    "decoder_base_dim": 256,
    "z_dim": 48,
    "is_residual": True,
    "in_channels": 12,
    "out_channels": 12,
    "patch_size": 2,
    "scale_factor_temporal": 4,
    "scale_factor_spatial": 16,
    "clip_output": False,
}  # + its 48 latents_mean / latents_std, read from the checkpoint's config
WAN22_PIPELINE_SPECS: dict[str, dict[str, Any]] = {
    "wan2.2-ti2v-5b": {"expand_timesteps": True, "flow_shift": 5.0},
    "wan2.2-t2v-a14b": {"boundary_ratio": 0.875, "flow_shift": 3.0},
}


class Wan22Adapter(WanAdapter):
    family = "wan2.2"
    options = (*WanAdapter.options, "train_experts", "guidance_scale_2")

    def __init__(
        self,
        pipe: Any,
        *,
        train_experts: Sequence[str] | None = None,
        guidance_scale_2: float | None = None,
        **kw: Any,
    ):
        self.two_experts = getattr(pipe, "transformer_2", None) is not None
        experts = tuple(train_experts) if train_experts is not None else DEFAULT_TRAIN_EXPERTS
        if isinstance(train_experts, str) or not experts or any(e not in EXPERTS for e in experts):
            raise ValueError(f"wan2.2: train_experts must be a list of {sorted(EXPERTS)}, got {train_experts!r}")
        if len(set(experts)) != len(experts):
            raise ValueError(f"wan2.2: train_experts names an expert twice: {list(experts)}")
        if not self.two_experts and (train_experts is not None or guidance_scale_2 is not None):
            raise ValueError(
                "wan2.2: train_experts / guidance_scale_2 are for two-expert pipelines (A14B); this one has one transformer"
            )
        self.train_experts = tuple(e for e in EXPERTS if e in experts)  # high first
        # the trained expert is the denoiser (LoRA, full fine-tune, saving, sharding act on it alone); both trained:
        # a WanExperts module holding the two, kept on the pipeline as `experts` (a reference copy can swap it)
        if len(experts) == 2:
            pipe.experts = WanExperts(pipe.transformer, pipe.transformer_2)
            self.denoiser_name = "experts"
        else:
            self.denoiser_name = EXPERTS[experts[0]]
        self.guidance_scale_2 = guidance_scale_2
        self._active = "transformer"  # the expert _forward calls (model_output sets it per group of rows)
        super().__init__(pipe, **kw)
        n = pipe.scheduler.config.get("num_train_timesteps", 1000)
        self.boundary_timestep = pipe.config.boundary_ratio * n if self.two_experts else None

    @classmethod
    def _check_pipeline(cls, pipe: Any) -> None:
        two, ratio = getattr(pipe, "transformer_2", None) is not None, pipe.config.get("boundary_ratio")
        if two != (ratio is not None):
            raise ValueError(f"wan2.2: transformer_2 and boundary_ratio go together, got boundary_ratio={ratio}")
        if not two and not pipe.config.get("expand_timesteps"):
            raise ValueError("wan2.2: neither two experts nor expand_timesteps: a Wan 2.1 pipeline (family 'wan')")
        if two and pipe.config.get("expand_timesteps"):
            raise ValueError("wan2.2: two experts with expand_timesteps is no published Wan 2.2 pipeline")

    # ---- experts -------------------------------------------------------------------------------

    def expert_of(self, sigma: Tensor) -> Tensor:
        """True where the high-noise expert runs: the pipeline's t >= boundary_ratio * 1000 (t = 1000 sigma, as
        the transformer sees it); a step of a float32 grid that rounds to just below the boundary still counts."""
        t = sigma.float() * self.pipe.scheduler.config.num_train_timesteps
        if self.boundary_timestep is None:
            return torch.ones_like(t, dtype=torch.bool)
        return t >= self.boundary_timestep - 1e-3

    def step_experts(self, schedule: Any) -> list[str]:
        """The expert of each step of a sampler grid (a FlowSchedule): "high" / "low" (one transformer: "high")."""
        times = schedule.sigmas[:-1] if schedule.model_sigmas is None else schedule.model_sigmas
        return ["high" if h else "low" for h in self.expert_of(times).tolist()]

    def restrict_plan(self, plan: Any, schedule: Any) -> Any:
        """`plan` with only the trained experts' steps trained (the others are sampled as planned, not trained);
        a ValueError when none of its trained steps is left."""
        if not self.two_experts:
            return plan
        experts = self.step_experts(schedule)
        steps = tuple(s if experts[i] in self.train_experts else replace(s, trained=False)
                      for i, s in enumerate(plan.steps))  # fmt: skip
        if plan.trained_steps and not any(s.trained for s in steps):
            mine = [i for i, e in enumerate(experts) if e in self.train_experts]
            raise ValueError(
                f"wan2.2: plan '{plan.name}' trains steps {plan.trained_steps}, but the trained expert(s) "
                f"{list(self.train_experts)} run steps {mine} of this grid; move the plan's window onto them"
            )
        return replace(plan, steps=steps)

    def model_output(
        self, latents: Tensor, sigma: Tensor | float, embeds: PromptEmbeds, guidance_scale: float,
        cfg_mode: str = "full",
    ) -> Tensor:  # fmt: skip
        """WanAdapter's output, each row through the expert of its own sigma, with that expert's guidance scale."""
        if not self.two_experts:
            return self._through("transformer", latents, sigma, embeds, guidance_scale, cfg_mode)
        b = latents.shape[0]
        s = torch.as_tensor(sigma, dtype=torch.float32, device=latents.device).reshape(-1).expand(b)
        high = self.expert_of(s)
        w2 = guidance_scale if self.guidance_scale_2 is None else self.guidance_scale_2
        if bool(high.all()):
            return self._through("transformer", latents, s, embeds, guidance_scale, cfg_mode)
        if not bool(high.any()):
            return self._through("transformer_2", latents, s, embeds, w2, cfg_mode)
        if len(embeds) != b:  # the base class says so too; checked here before the rows are split
            raise ValueError(f"embeds have {len(embeds)} rows but latents have {b}")
        out = torch.empty(latents.shape, dtype=torch.float32, device=latents.device)
        for rows, name, w in ((high, "transformer", guidance_scale), (~high, "transformer_2", w2)):
            idx = rows.nonzero().squeeze(1)
            out[idx] = self._through(name, latents[idx], s[idx], embeds.index(idx), w, cfg_mode)
        return out

    def _through(self, name: str, latents: Tensor, sigma: Any, embeds: PromptEmbeds, w: float, mode: str) -> Tensor:
        self._active = name
        try:
            return Adapter.model_output(self, latents, sigma, embeds, w, mode)
        finally:
            self._active = "transformer"

    def _forward(self, x: Tensor, sigma: Tensor, text: dict[str, Tensor | None], guidance: float | None) -> Tensor:
        # through the denoiser module when both experts train, so that a swapped-in reference copy is the one used
        model = getattr(self.denoiser if self.denoiser_name == "experts" else self.pipe, self._active)
        t = sigma * self.pipe.scheduler.config.num_train_timesteps
        if self.pipe.config.get("expand_timesteps"):  # TI2V: one timestep per video token, all at t (text-to-video)
            pt, ph, pw = model.config.patch_size
            f, h, w = x.shape[2:]
            t = t[:, None].expand(-1, (f // pt) * (h // ph) * (w // pw))
        return model(hidden_states=x, timestep=t, encoder_hidden_states=text["embeds"], return_dict=False)[0]

    # ---- LoRA: diffusers' Wan loader keeps one expert per file ---------------------------------

    def _each_expert(self) -> list[str]:
        return list(EXPERTS.values()) if self.denoiser_name == "experts" else [self.denoiser_name]

    @contextlib.contextmanager
    def _as_denoiser(self, name: str) -> Iterator[None]:
        """One expert as `denoiser` for the base class's single-module code (save / load)."""
        kept = self.denoiser_name
        self.denoiser_name = name
        try:
            yield
        finally:
            self.denoiser_name = kept

    @staticmethod
    def _expert_folder(path: Any, name: str, both: bool) -> str:
        return os.path.join(os.fspath(path), name) if both and name == "transformer_2" else os.fspath(path)

    def save_lora(self, path: Any, adapter_name: str = "default", state: dict[str, Tensor] | None = None) -> str:
        """Each trained expert's LoRA under the `transformer.*` keys diffusers' Wan saver writes (it has no
        transformer_2 argument): the low-noise expert's file (`path`, or `path/transformer_2` when both train)
        loads with `load_lora_weights(folder, load_into_transformer_2=True)`. `state`: gathered from a sharded run."""
        both = self.denoiser_name == "experts"
        for name in self._each_expert():
            sub = state if state is None or not both else _sub_state(state, name)
            with self._as_denoiser(name):
                if adapter_name not in getattr(self.denoiser, "peft_config", {}):
                    raise ValueError(f"no LoRA adapter '{adapter_name}' on the {self.family} {name}")
                folder = self._expert_folder(path, name, both)
                write_lora(self._lora_writer(), self.denoiser, folder, adapter_name, "transformer", sub)
        return os.fspath(path)

    def load_lora(
        self, path: Any, adapter_name: str = "default", dtype: torch.dtype = torch.float32
    ) -> list[torch.nn.Parameter]:
        """What `save_lora` wrote (`transformer.*` keys), into the trained expert(s)."""
        both = self.denoiser_name == "experts"
        for name in self._each_expert():
            folder = self._expert_folder(path, name, both)
            if not os.path.exists(folder):
                raise FileNotFoundError(f"LoRA weights not found: '{folder}'")
            kw: dict[str, Any] = {"use_safetensors": True}
            if os.path.isfile(folder):
                folder, kw["weight_name"] = os.path.split(folder)
            with self._as_denoiser(name):
                if adapter_name in getattr(self.denoiser, "peft_config", {}):
                    self.denoiser.delete_adapters(adapter_name)
                self.denoiser.load_lora_adapter(folder, prefix="transformer", adapter_name=adapter_name, **kw)
                self.denoiser.set_adapter(adapter_name)
        return self._lora_trainable(adapter_name, dtype)

    def save_denoiser(self, path: Any, state: dict[str, Tensor] | None = None) -> str:
        """A full fine-tune: the trained expert's model folder (both: `path/transformer`, `path/transformer_2`)."""
        if self.denoiser_name != "experts":
            return super().save_denoiser(path, state)
        for name in self._each_expert():
            with self._as_denoiser(name):
                super().save_denoiser(os.path.join(path, name), None if state is None else _sub_state(state, name))
        return os.fspath(path)

    # ---- construction --------------------------------------------------------------------------

    @classmethod
    def _tiny_pipeline(
        cls, variant: str = "a14b", scheduler: str = "unipc", flow_shift: float = 3.0, boundary_ratio: float = 0.875
    ) -> Any:  # type: ignore[override]
        """Wan 2.2 at test size. `variant`: "a14b" (two 2-block experts, the Wan 2.1 tiny VAE, `boundary_ratio`)
        or "ti2v" (one transformer, expand_timesteps, a residual patchified VAE like Wan 2.2's: 8 latent
        channels, 2x patch x 4x down = 8x spatial, 2x temporal). `scheduler`: "unipc" or "euler"."""
        from diffusers import AutoencoderKLWan, WanPipeline, WanTransformer3DModel

        if variant not in ("a14b", "ti2v"):
            raise ValueError(f"wan2.2: tiny variant must be 'a14b' or 'ti2v', got '{variant}'")
        base = WanAdapter._tiny_pipeline(scheduler=scheduler, flow_shift=flow_shift)
        parts = {k: base.components[k] for k in ("tokenizer", "text_encoder", "scheduler")}

        def expert(channels: int) -> Any:
            return WanTransformer3DModel(
                patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=8, in_channels=channels,
                out_channels=channels, text_dim=32, freq_dim=16, ffn_dim=32, num_layers=2, rope_max_seq_len=32,
            )  # fmt: skip

        if variant == "a14b":
            return WanPipeline(
                **parts, vae=base.vae, transformer=base.transformer, transformer_2=expert(4),
                boundary_ratio=boundary_ratio,
            )  # fmt: skip
        z = 8
        vae = AutoencoderKLWan(
            base_dim=4, z_dim=z, dim_mult=[1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True],
            is_residual=True, in_channels=12, out_channels=12, patch_size=2, scale_factor_temporal=2,
            scale_factor_spatial=8, latents_mean=[0.1 * (i % 3) for i in range(z)],
            latents_std=[1.0 + 0.1 * i for i in range(z)],
        )  # fmt: skip
        return WanPipeline(**parts, vae=vae, transformer=expert(z), expand_timesteps=True)


def _sub_state(state: dict[str, Tensor], name: str) -> dict[str, Tensor]:
    """The entries of one expert in a WanExperts state dict, without the `<name>.` prefix."""
    return {k[len(name) + 1 :]: v for k, v in state.items() if k.startswith(name + ".")}


class WanExperts(torch.nn.Module):
    """Both A14B experts as the one trained module (train_experts [high, low]): its parameters, state dict and the
    LoRA / checkpointing / attention calls the trainer makes on a denoiser reach both. Rows go through an expert
    (`Wan22Adapter.model_output`), never through this module."""

    def __init__(self, transformer: torch.nn.Module, transformer_2: torch.nn.Module):
        super().__init__()
        self.transformer, self.transformer_2 = transformer, transformer_2

    def _experts(self) -> tuple[Any, Any]:
        return self.transformer, self.transformer_2

    @property
    def config(self) -> Any:  # geometry: the two experts share one architecture
        return self.transformer.config

    @property
    def blocks(self) -> torch.nn.ModuleList:  # block_names ("blocks"): both experts' blocks, for compile
        return torch.nn.ModuleList([*self.transformer.blocks, *self.transformer_2.blocks])

    @property
    def peft_config(self) -> dict:
        return getattr(self.transformer, "peft_config", {})

    def add_adapter(self, config: Any, adapter_name: str = "default") -> None:
        for m in self._experts():
            m.add_adapter(copy.deepcopy(config), adapter_name=adapter_name)

    def load_lora_adapter(self, *a: Any, **kw: Any) -> None:
        raise RuntimeError("wan2.2: load each expert's LoRA file into that expert (Wan22Adapter.load_lora)")

    def forward(self, *a: Any, **kw: Any) -> Any:
        raise RuntimeError("wan2.2: rows go through one expert (Wan22Adapter.model_output), not through both")

    def _each(self, method: str, *a: Any) -> None:
        for m in self._experts():
            getattr(m, method)(*a)

    def disable_adapters(self) -> None:
        self._each("disable_adapters")

    def enable_adapters(self) -> None:
        self._each("enable_adapters")

    def set_adapter(self, name: Any) -> None:
        self._each("set_adapter", name)

    def delete_adapters(self, name: Any) -> None:
        self._each("delete_adapters", name)

    def enable_gradient_checkpointing(self) -> None:
        self._each("enable_gradient_checkpointing")

    def disable_gradient_checkpointing(self) -> None:
        self._each("disable_gradient_checkpointing")

    def set_attention_backend(self, backend: str) -> None:
        self._each("set_attention_backend", backend)
