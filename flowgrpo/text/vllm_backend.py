"""Generation backend on a colocated vLLM engine (`generation.backend: vllm`; CUDA, `pip install -e '.[vllm]'`).

The engine runs in the training process on the training GPU. It loads the architecture and the initial
weights from `model_path`; `sync_weights` then copies the policy's current weights (LoRA merged) into it
after every optimizer update, so it always samples from the policy being trained.

Log-probs: the engine is built with `logprobs_mode="processed_logprobs"`, so the log-prob it reports for
a sampled token is taken after temperature scaling and after top-k / top-p / min-p filtering. The
trainer re-scores the full temperature-scaled distribution (as TRL does), so with top_p < 1, top_k > 0 or
min_p set the two differ by design: the filtered distribution is renormalised over fewer tokens, which
biases the rollout-vs-training weights (the bias discussed in TRL issue #6789), not an engine error.
"""

from __future__ import annotations

import contextlib
import os
from typing import Iterator, Optional, Sequence

import torch

from ..checkpoint import is_shard
from .config import GenerationConfig
from .generation import Rollout, completion_mask, eos_token_ids, finalize, left_pad, sampling_settings
from .models import is_peft

MISSING_VLLM = (
    "generation.backend vllm needs the vllm package and a CUDA GPU: pip install -e '.[vllm]' "
    "(or set generation.backend: transformers)"
)
V1_PATH = "llm.llm_engine.model_executor.driver_worker.worker.model_runner.model"
V0_PATH = "llm.llm_engine.model_executor.driver_worker.model_runner.model"


def _engine_model(llm):
    """The engine's torch model, reachable only when the engine runs in this process."""
    executor = getattr(getattr(llm, "llm_engine", None), "model_executor", None)
    driver = getattr(executor, "driver_worker", None)
    for owner in (getattr(driver, "worker", None), driver):  # V1 in-process, then V0
        model = getattr(getattr(owner, "model_runner", None), "model", None)
        if model is not None:
            return model
    raise RuntimeError(
        f"cannot reach the vLLM engine's model (tried {V1_PATH} and {V0_PATH}); the weight sync "
        "needs the engine in this process: VLLM_ENABLE_V1_MULTIPROCESSING=0, tensor_parallel_size 1"
    )


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    """A sharded (FSDP2) tensor gathered from every rank; a plain one as it is."""
    return tensor.full_tensor() if is_shard(tensor) else tensor  # type: ignore[attr-defined]


def _plain_weights(state: dict[str, torch.Tensor], adapter: str) -> Iterator[tuple[str, torch.Tensor]]:
    """A (merged) peft state dict under the plain model's names: no LoRA factors, no peft wrappers."""
    for name, tensor in state.items():
        if ".lora_" in name or ".original_module." in name:
            continue
        name = name.removeprefix("base_model.model.").replace(".base_layer.", ".")
        yield name.replace(f".modules_to_save.{adapter}.", "."), _whole(tensor)


@contextlib.contextmanager
def merged_weights(model) -> Iterator[Iterator[tuple[str, torch.Tensor]]]:
    """The policy's weights under the plain model's names, LoRA merged (peft's merge, undone on exit). A sharded
    policy's are gathered one tensor at a time as they are read: every rank must read them all, in order."""
    peft = is_peft(model)
    if peft:
        model.merge_adapter()
    try:
        state = model.state_dict()
        yield _plain_weights(state, model.active_adapter) if peft else ((k, _whole(v)) for k, v in state.items())
    finally:
        if peft:
            model.unmerge_adapter()


class VLLMGenerator:
    """Samples G completions per prompt with vLLM; same interface as `TransformersGenerator`.

    Always records the sampler's log-prob of every token (`Rollout.rollout_logp`).
    """

    def __init__(self, model, tokenizer, cfg: GenerationConfig, group_size: int, model_path: str, max_prompt_len: int):
        try:
            import vllm
        except ImportError as err:
            raise ImportError(MISSING_VLLM) from err
        if cfg.vllm.tensor_parallel_size != 1:
            # the in-process weight sync reaches the driver worker only: other ranks would keep old weights
            raise ValueError("generation.vllm.tensor_parallel_size: only 1 is supported (colocated weight sync)")
        self.model, self.cfg, self.group_size, self.vllm = model, cfg, group_size, vllm
        self.pad_id = tokenizer.pad_token_id
        self.eos_ids = eos_token_ids(model, tokenizer)
        # the engine (and its model) in this process, not in a worker process: sync_weights writes into it
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        v = cfg.vllm
        self.llm = vllm.LLM(
            model=model_path,
            tensor_parallel_size=v.tensor_parallel_size,
            gpu_memory_utilization=v.gpu_memory_utilization,
            max_model_len=v.max_model_len or max_prompt_len + cfg.max_new_tokens,
            dtype=v.dtype,
            enable_prefix_caching=v.enable_prefix_caching,
            enable_sleep_mode=v.enable_sleep_mode,
            enforce_eager=v.enforce_eager,
            logprobs_mode="processed_logprobs",
        )
        self.asleep = False

    @property
    def settings(self) -> dict[str, float]:
        return {**sampling_settings(self.cfg, self.group_size), "sampling/backend_vllm": 1}

    def _wake(self) -> None:
        if self.asleep and hasattr(self.llm, "wake_up"):
            self.llm.wake_up()
        self.asleep = False

    def _sleep(self) -> None:
        # level 1: weights to CPU, KV cache dropped; the policy's update then has that GPU memory
        if self.cfg.vllm.enable_sleep_mode and hasattr(self.llm, "sleep"):
            self.llm.sleep(level=1)
            self.asleep = True

    @torch.no_grad()
    def sync_weights(self) -> None:
        """Load the policy's current weights (LoRA merged) into the engine."""
        self._wake()  # a sleeping engine's weights are offloaded: write them once it is awake
        target = _engine_model(self.llm)
        with merged_weights(self.model) as weights:  # load_weights copies them: the policy unmerges right after
            target.load_weights(weights=weights)
        if hasattr(self.llm, "reset_prefix_cache"):
            self.llm.reset_prefix_cache()  # cached KV blocks were computed with the old weights

    def _params(self, G: int, seed: Optional[int], index: int):
        c = self.cfg
        return self.vllm.SamplingParams(
            n=G,
            temperature=c.temperature,
            top_p=c.top_p,
            top_k=c.top_k if c.top_k > 0 else -1,
            min_p=c.min_p or 0.0,
            repetition_penalty=c.repetition_penalty or 1.0,
            max_tokens=c.max_new_tokens,
            logprobs=0,  # the sampled token's log-prob only
            # vLLM gives the j-th sample seed + j: prompts are spaced by G so that no two samples of a
            # call share a random stream (the same seed for all would correlate the prompts' samples)
            seed=None if seed is None else seed + index * G,
            stop_token_ids=list(self.eos_ids),
        )

    @torch.no_grad()
    def generate(
        self,
        prompt_ids: Sequence[Sequence[int]],
        prompt_index: Sequence[int],
        group_size: Optional[int] = None,
        seed: Optional[int] = None,
    ) -> Rollout:
        G = group_size or self.group_size
        self._wake()
        try:
            outputs = self.llm.generate(
                [{"prompt_token_ids": list(ids)} for ids in prompt_ids],
                [self._params(G, seed, i) for i in range(len(prompt_ids))],
                use_tqdm=False,
            )
        finally:
            self._sleep()
        if len(outputs) != len(prompt_ids):
            raise ValueError(f"vLLM returned {len(outputs)} results for {len(prompt_ids)} prompts")
        samples = []
        for i, out in enumerate(outputs):
            if len(out.outputs) != G:
                raise ValueError(f"vLLM returned {len(out.outputs)} completions for prompt {i}, expected {G}")
            samples.extend(out.outputs)
        width = max(1, max(len(s.token_ids) for s in samples))
        # -1 (never an EOS id) fills the rows first, so padding cannot pass for an EOS when pad_id is one;
        # finalize turns everything outside the mask into pad_id
        tokens = torch.full((len(samples), width), -1, dtype=torch.long)
        lengths = torch.tensor([len(s.token_ids) for s in samples])
        logp = torch.zeros((len(samples), width), dtype=torch.float32)
        for r, s in enumerate(samples):
            ids = list(s.token_ids)
            if s.logprobs is None or len(s.logprobs) != len(ids):
                raise ValueError("vLLM returned no log-prob for some sampled tokens (logprobs=0 was asked for)")
            tokens[r, : len(ids)] = torch.as_tensor(ids, dtype=torch.long)
            logp[r, : len(ids)] = torch.as_tensor([s.logprobs[t][tok].logprob for t, tok in enumerate(ids)])
        # vLLM keeps the stop token in token_ids, so the mask includes the EOS as on the transformers
        # path; a completion cut at max_tokens (or max_model_len) has no EOS: truncated
        cmask, truncated = completion_mask(tokens, self.eos_ids)
        # a row cut short of the width (max_model_len reached) has no EOS: its mask stops at its length
        cmask &= torch.arange(width).unsqueeze(0) < lengths.unsqueeze(1)
        ids, mask = left_pad(prompt_ids, self.pad_id)
        index = torch.as_tensor(list(prompt_index), dtype=torch.long)
        rollout = Rollout(
            ids.repeat_interleave(G, 0),
            mask.repeat_interleave(G, 0),
            tokens,
            cmask,
            truncated,
            index.repeat_interleave(G),
            G,
            logp,
        )
        return finalize(rollout, self.pad_id)
