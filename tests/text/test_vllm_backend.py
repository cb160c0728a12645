"""The vLLM generation backend against a fake `vllm` module (vLLM itself needs CUDA and is not installed here).

The fake `LLM` samples from the tiny Qwen2 with its own loop and answers with objects shaped like vLLM's
(RequestOutput.outputs: CompletionOutput with token_ids, logprobs [{token: Logprob}], finish_reason): the
stop token is kept in token_ids, a completion stops at max_tokens or at max_model_len, and the engine's
model is reachable where vLLM V1 keeps it in-process.
"""

import copy
import os
import sys
import types
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from flowgrpo.text.config import GenerationConfig, TextLoraConfig, TinyModelConfig, VLLMConfig
from flowgrpo.text.models import apply_lora, build_tiny_model, build_tiny_tokenizer
from flowgrpo.text.vllm_backend import VLLMGenerator, _engine_model

PROMPTS = [[72, 105, 33], [65, 66], [49, 50, 51, 52, 53]]
INDEX = [10, 11, 12]
G = 4
ROOT = Path(__file__).resolve().parents[2]


class Logprob:
    def __init__(self, logprob):
        self.logprob = logprob


class CompletionOutput:
    def __init__(self, index, token_ids, logprobs, finish_reason):
        self.index, self.token_ids, self.logprobs, self.finish_reason = index, token_ids, logprobs, finish_reason


class RequestOutput:
    def __init__(self, prompt_token_ids, outputs):
        self.prompt_token_ids, self.outputs = prompt_token_ids, outputs


class SamplingParams:
    def __init__(self, **kwargs):
        self.kwargs = kwargs
        self.__dict__.update(kwargs)


class FakeEngineModel:
    def __init__(self, events):
        self.events, self.loaded = events, []

    def load_weights(self, weights):
        # copies, as vLLM's loader does: the policy is unmerged right after
        self.loaded.append([(name, t.detach().clone()) for name, t in weights])
        self.events.append("load_weights")


class FakeLLM:
    eos_bias = 4.0  # makes EOS likely, so both stopped and cut completions occur
    logprob_offset = 0.0  # added to the reported log-probs (an engine that disagrees with the trainer)
    drop_one = False  # answer G - 1 completions per prompt

    def __init__(self, **kwargs):
        self.kwargs, self.events, self.calls, self.results = kwargs, [], [], None
        self.tok = build_tiny_tokenizer()
        self.model = build_tiny_model(TinyModelConfig(), len(self.tok), self.tok.eos_token_id).eval()
        self.engine_model = FakeEngineModel(self.events)
        worker = SimpleNamespace(model_runner=SimpleNamespace(model=self.engine_model))
        self.llm_engine = SimpleNamespace(model_executor=SimpleNamespace(driver_worker=SimpleNamespace(worker=worker)))
        type(self).instances.append(self)

    def wake_up(self):
        self.events.append("wake_up")

    def sleep(self, level):
        self.events.append(f"sleep{level}")

    def reset_prefix_cache(self):
        self.events.append("reset_prefix_cache")

    @torch.no_grad()
    def generate(self, prompts, sampling_params, use_tqdm=True):
        self.events.append("generate")
        self.calls.append((prompts, sampling_params, use_tqdm))
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        assert len(params) == len(prompts)
        self.results = []
        for prompt, sp in zip(prompts, params):
            ids = list(prompt["prompt_token_ids"])
            budget = min(sp.max_tokens, self.kwargs["max_model_len"] - len(ids))  # vLLM stops at max_model_len
            outs = [self._sample(ids, sp, j, budget) for j in range(sp.n - int(self.drop_one))]
            self.results.append(RequestOutput(ids, outs))
        return self.results

    def _sample(self, prompt, sp, j, budget):
        seed = (1000 * len(self.calls) if sp.seed is None else sp.seed) + j
        g = torch.Generator().manual_seed(seed)
        seq, tokens, logprobs = list(prompt), [], []
        eos = self.tok.eos_token_id
        for _ in range(budget):
            logits = self.model(torch.tensor([seq])).logits[0, -1].float() / sp.temperature
            logits[eos] += self.eos_bias
            logp = torch.log_softmax(logits, -1)
            tok = int(torch.multinomial(logp.exp(), 1, generator=g))
            decoy = (tok + 1) % logp.shape[0]  # another entry in the dict: the parse must pick the sampled one
            logprobs.append({decoy: Logprob(-99.0), tok: Logprob(float(logp[tok]) + self.logprob_offset)})
            tokens.append(tok)
            seq.append(tok)
            if tok in sp.stop_token_ids:
                return CompletionOutput(j, tokens, logprobs, "stop")  # the stop token stays in token_ids
        return CompletionOutput(j, tokens, logprobs, "length")


def fake_vllm(**attrs):
    mod = types.ModuleType("vllm")
    mod.LLM = type("LLM", (FakeLLM,), {"instances": [], **attrs})
    mod.SamplingParams = SamplingParams
    return mod


@pytest.fixture
def tiny():
    tok = build_tiny_tokenizer()
    return tok, build_tiny_model(TinyModelConfig(), len(tok), tok.eos_token_id).eval()


def make(monkeypatch, tok, model, fake_attrs=None, max_prompt_len=5, vllm=None, **gen):
    monkeypatch.setitem(sys.modules, "vllm", fake_vllm(**(fake_attrs or {})))
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "unset")  # restored (removed) after the test
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING")
    cfg = GenerationConfig(backend="vllm", max_new_tokens=6, vllm=vllm or VLLMConfig(), **gen)
    gen = VLLMGenerator(model, tok, cfg, G, "some/model", max_prompt_len)
    return gen, gen.llm


def test_rollout_layout(monkeypatch, tiny):
    tok, model = tiny
    pad = tok.pad_token_id
    assert pad == tok.eos_token_id  # the hard case: padding looks like an EOS
    # max_model_len 9 cuts the 5-token prompt's completions at 4 tokens, short of the 6 of the others
    gen, llm = make(monkeypatch, tok, model, vllm=VLLMConfig(max_model_len=9))
    r = gen.generate(PROMPTS, INDEX, seed=7)
    samples = [s for out in llm.results for s in out.outputs]
    N, Tc = len(PROMPTS) * G, max(len(s.token_ids) for s in samples)
    assert r.num_sequences == N and r.group_size == G and r.completion_ids.shape == (N, Tc)
    assert r.prompt_index.tolist() == [i for i in INDEX for _ in range(G)]
    for row in range(N):
        p = PROMPTS[row // G]
        Lp = r.prompt_ids.shape[1]
        assert r.prompt_ids[row, Lp - len(p) :].tolist() == p and (r.prompt_ids[row, : Lp - len(p)] == pad).all()
        assert r.prompt_mask[row].tolist() == [0] * (Lp - len(p)) + [1] * len(p)
        s = samples[row]
        L = len(s.token_ids)
        stopped = s.token_ids[-1] == tok.eos_token_id
        assert stopped == (s.finish_reason == "stop")
        assert r.completion_ids[row, :L].tolist() == s.token_ids
        assert (r.completion_ids[row, L:] == pad).all()
        # the mask covers the completion up to and including its first EOS, nothing after
        assert r.completion_mask[row].tolist() == [True] * L + [False] * (Tc - L)
        assert bool(r.truncated[row]) == (not stopped)
        want = torch.tensor([s.logprobs[t][x].logprob for t, x in enumerate(s.token_ids)])
        assert torch.allclose(r.rollout_logp[row, :L], want) and (r.rollout_logp[row, L:] == 0).all()
    assert r.rollout_logp.dtype == torch.float32 and (r.rollout_logp[r.completion_mask] > -99).all()
    lengths = r.lengths
    assert (~r.truncated).any(), "no completion stopped on EOS: pick another seed"
    assert (r.truncated & (lengths == 6)).any(), "no completion cut at max_tokens: pick another seed"
    assert (r.truncated & (lengths == 4)).any(), "no completion cut at max_model_len: pick another seed"
    assert (~r.truncated & (lengths < Tc)).any()


def test_sampling_params_and_engine_args(monkeypatch, tiny):
    tok, model = tiny
    gen, llm = make(monkeypatch, tok, model, temperature=0.7, top_p=0.9, top_k=0)
    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    kw = llm.kwargs
    assert kw["logprobs_mode"] == "processed_logprobs" and kw["model"] == "some/model"
    assert kw["max_model_len"] == 5 + 6  # max_prompt_len + max_new_tokens
    assert kw["gpu_memory_utilization"] == 0.3 and kw["tensor_parallel_size"] == 1 and kw["dtype"] == "auto"
    assert kw["enable_prefix_caching"] is True and kw["enable_sleep_mode"] is False and kw["enforce_eager"] is False
    assert gen.settings["sampling/backend_vllm"] == 1 and gen.settings["sampling/top_p"] == 0.9
    gen.generate(PROMPTS, INDEX, seed=123)
    prompts, params, use_tqdm = llm.calls[-1]
    assert prompts == [{"prompt_token_ids": p} for p in PROMPTS] and use_tqdm is False
    assert len(params) == len(PROMPTS)
    for i, sp in enumerate(params):
        assert sp.kwargs == dict(
            n=G,
            temperature=0.7,
            top_p=0.9,
            top_k=-1,
            min_p=0.0,
            repetition_penalty=1.0,
            max_tokens=6,
            logprobs=0,
            seed=123 + i * G,
            stop_token_ids=[tok.eos_token_id],
        )
    # every sample of the call has its own stream (vLLM seeds the j-th sample with seed + j)
    streams = [sp.seed + j for sp in params for j in range(G)]
    assert len(set(streams)) == len(streams)
    r = gen.generate(PROMPTS[:2], INDEX[:2], group_size=2)
    assert [sp.seed for sp in llm.calls[-1][1]] == [None, None] and llm.calls[-1][1][0].n == 2
    assert r.num_sequences == 4 and r.prompt_index.tolist() == [10, 10, 11, 11]

    gen, llm = make(
        monkeypatch, tok, model, vllm=VLLMConfig(max_model_len=64), top_k=5, min_p=0.1, repetition_penalty=1.2
    )
    gen.generate(PROMPTS[:1], INDEX[:1])
    sp = llm.calls[-1][1][0]
    assert (sp.top_k, sp.min_p, sp.repetition_penalty) == (5, 0.1, 1.2) and llm.kwargs["max_model_len"] == 64


def test_wrong_number_of_completions(monkeypatch, tiny):
    gen, _ = make(monkeypatch, *tiny, fake_attrs={"drop_one": True})
    with pytest.raises(ValueError, match="3 completions for prompt 0, expected 4"):
        gen.generate(PROMPTS, INDEX)


def lora_policy(model):
    policy = apply_lora(model, TextLoraConfig(enabled=True))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return policy.eval()


def test_sync_weights_lora(monkeypatch, tiny):
    tok, model = tiny
    plain_names = list(build_tiny_model(TinyModelConfig(), len(tok), tok.eos_token_id).state_dict())
    policy = lora_policy(model)
    gen, llm = make(monkeypatch, tok, policy)
    x = torch.tensor([PROMPTS[0] + PROMPTS[2]])
    with torch.no_grad():
        before = policy(x).logits
    merged = copy.deepcopy(policy).merge_and_unload().state_dict()
    q = "model.layers.0.self_attn.q_proj.weight"
    base_q = policy.base_model.model.model.layers[0].self_attn.q_proj.base_layer.weight.detach().clone()
    assert not torch.allclose(merged[q], base_q)  # the adapter does change the weights

    gen.sync_weights()
    assert len(llm.engine_model.loaded) == 1
    loaded = llm.engine_model.loaded[0]
    assert [name for name, _ in loaded] == plain_names
    for name, t in loaded:
        torch.testing.assert_close(t, merged[name], rtol=0, atol=1e-6)
    assert llm.events == ["load_weights", "reset_prefix_cache"]
    # the policy is unmerged again: same forward, same base weights
    q_proj = policy.base_model.model.model.layers[0].self_attn.q_proj
    assert not q_proj.merged
    torch.testing.assert_close(q_proj.base_layer.weight, base_q, rtol=0, atol=1e-6)
    with torch.no_grad():
        torch.testing.assert_close(policy(x).logits, before, rtol=0, atol=1e-5)


def test_sync_weights_plain_model(monkeypatch, tiny):
    tok, model = tiny
    gen, llm = make(monkeypatch, tok, model)
    gen.sync_weights()
    state = model.state_dict()
    loaded = llm.engine_model.loaded[0]
    assert [name for name, _ in loaded] == list(state)
    assert all(torch.equal(t, state[name]) for name, t in loaded)


def test_engine_model_paths():
    model = object()
    v1 = SimpleNamespace(
        llm_engine=SimpleNamespace(
            model_executor=SimpleNamespace(
                driver_worker=SimpleNamespace(worker=SimpleNamespace(model_runner=SimpleNamespace(model=model)))
            )
        )
    )
    v0 = SimpleNamespace(
        llm_engine=SimpleNamespace(
            model_executor=SimpleNamespace(driver_worker=SimpleNamespace(model_runner=SimpleNamespace(model=model)))
        )
    )
    assert _engine_model(v1) is model and _engine_model(v0) is model
    with pytest.raises(RuntimeError, match="driver_worker.worker.model_runner.model.*driver_worker.model_runner"):
        _engine_model(SimpleNamespace(llm_engine=SimpleNamespace()))


def test_sleep_mode(monkeypatch, tiny):
    gen, llm = make(monkeypatch, *tiny, vllm=VLLMConfig(enable_sleep_mode=True))
    gen.generate(PROMPTS[:1], INDEX[:1])
    gen.sync_weights()  # the weights are written into an awake engine
    gen.generate(PROMPTS[:1], INDEX[:1])
    gen.generate(PROMPTS[:1], INDEX[:1])
    assert llm.events == [
        "generate",
        "sleep1",
        "wake_up",
        "load_weights",
        "reset_prefix_cache",
        "generate",
        "sleep1",
        "wake_up",
        "generate",
        "sleep1",
    ]


def test_missing_vllm(monkeypatch, tiny):
    monkeypatch.setitem(sys.modules, "vllm", None)
    with pytest.raises(ImportError, match=r"\.\[vllm\]"):
        VLLMGenerator(tiny[1], tiny[0], GenerationConfig(backend="vllm"), 8, "some/model", 8)


def test_tensor_parallel_refused(monkeypatch, tiny):
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        make(monkeypatch, *tiny, vllm=VLLMConfig(tensor_parallel_size=2))


def test_engine_logprob_offset_reaches_rollout(monkeypatch, tiny):
    """An engine whose log-probs are the true ones + 0.25: rollout_logp carries the offset, so the trainer's
    rollout-vs-training correction sees it."""
    tok, model = tiny
    gen, _ = make(monkeypatch, tok, model, fake_attrs={"eos_bias": 0.0, "logprob_offset": 0.25}, temperature=0.8)
    r = gen.generate(PROMPTS, INDEX, seed=3)
    with torch.no_grad():
        for row in range(r.num_sequences):
            p, L = PROMPTS[row // G], int(r.lengths[row])
            seq = torch.tensor([p + r.completion_ids[row, :L].tolist()])
            logits = model(seq).logits[0, len(p) - 1 : len(p) - 1 + L].float() / 0.8
            true = torch.log_softmax(logits, -1).gather(1, seq[0, len(p) :].unsqueeze(1)).squeeze(1)
            torch.testing.assert_close(r.rollout_logp[row, :L], true + 0.25, rtol=0, atol=1e-4)


class SyncedEngineModel(FakeEngineModel):
    """An engine model that really takes the weights it is given: the fake then samples from the policy."""

    def __init__(self, events, policy_copy):
        super().__init__(events)
        self.policy_copy = policy_copy

    def load_weights(self, weights):
        super().load_weights(weights)
        self.policy_copy.load_state_dict(dict(self.loaded[-1]), strict=True)


def test_trainer_on_the_vllm_backend_learns_and_corrects_the_engine_mismatch(monkeypatch, tmp_path):
    """The whole trainer with `generation.backend: vllm` (the fake engine, synced after every update):
    the engine's log-probs are off by +0.3, the trainer measures that and weights the tokens by
    exp(-0.3); the policy still learns the pattern task, and the engine ends with the policy's weights."""
    from flowgrpo.text import TextGRPOTrainer, load_text_config

    tok = build_tiny_tokenizer()
    folder = tmp_path / "tiny_model"
    build_tiny_model(TinyModelConfig(), len(tok), tok.eos_token_id).save_pretrained(folder)
    tok.save_pretrained(folder)

    class Synced(FakeLLM):
        eos_bias, logprob_offset, instances = 0.0, 0.3, []

        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.engine_model = SyncedEngineModel(self.events, self.model)
            worker = SimpleNamespace(model_runner=SimpleNamespace(model=self.engine_model))
            self.llm_engine = SimpleNamespace(
                model_executor=SimpleNamespace(driver_worker=SimpleNamespace(worker=worker))
            )

    mod = fake_vllm()
    mod.LLM = Synced
    monkeypatch.setitem(sys.modules, "vllm", mod)
    cfg = load_text_config(
        ROOT / "configs/text/tiny_pattern.yaml",
        [
            f"output_dir={tmp_path / 'run'}",
            "progress=false",
            "num_threads=1",
            "iterations=12",
            "checkpoint.every=0",
            f"model.name_or_path={folder}",
            "generation.backend=vllm",
            "generation.max_new_tokens=16",
        ],
    )
    trainer = TextGRPOTrainer(cfg)
    history = trainer.train()
    engine = Synced.instances[-1]
    assert engine.kwargs["logprobs_mode"] == "processed_logprobs"
    assert engine.events.count("load_weights") == 1 + 12  # at start, then after every step's updates
    for r in history:
        assert r["mismatch/logp_diff_mean"] == pytest.approx(0.3, abs=1e-4)
        assert r["mismatch/token_ratio_mean"] == pytest.approx(torch.exp(torch.tensor(-0.3)).item(), abs=1e-4)
        assert r["mismatch/weight_mean"] == pytest.approx(r["mismatch/token_ratio_mean"], abs=1e-6)
        assert r["check/first_pass_ratio_dev"] < 1e-4  # the training passes themselves stay on-policy
    rewards = [r["reward_mean"] for r in history]
    assert sum(rewards[-3:]) / 3 > 0.2 > sum(rewards[:3]) / 3, rewards
    # the engine samples from exactly the trained weights
    final = dict(engine.engine_model.loaded[-1])
    policy_state = trainer.model.state_dict()
    assert final.keys() == policy_state.keys()
    for name, tensor in final.items():
        assert torch.equal(policy_state[name], tensor), name


def test_sync_weights_from_a_sharded_lora_policy(monkeypatch, tiny, tmp_path):
    """FSDP2 (a process group of one, gloo): the engine gets whole, merged, plain tensors, the same as from
    the unsharded policy, and the sharded policy is unmerged again."""
    import torch.distributed as dist

    from flowgrpo.scaling.sharding import shard_model

    tok, model = tiny
    policy = lora_policy(model)
    merged = copy.deepcopy(policy).merge_and_unload().state_dict()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        shard_model(policy)
        q_proj = policy.base_model.model.model.layers[0].self_attn.q_proj
        assert type(q_proj.base_layer.weight).__name__ == "DTensor"
        base_q = q_proj.base_layer.weight.full_tensor().clone()
        gen, llm = make(monkeypatch, tok, policy)
        gen.sync_weights()
        loaded = llm.engine_model.loaded[-1]
        assert [name for name, _ in loaded] == list(merged)
        for name, t in loaded:
            assert type(t) is torch.Tensor, name
            torch.testing.assert_close(t, merged[name], rtol=0, atol=1e-6)
        assert not q_proj.merged
        torch.testing.assert_close(q_proj.base_layer.weight.full_tensor(), base_q, rtol=0, atol=1e-6)
    finally:
        dist.destroy_process_group()
