"""The shared-prompt forward (each distinct prompt once, its KV cache repeated for its completions) gives the
plain forward's log-probs, entropies and gradients: Qwen2 and Llama, LoRA, ragged prompts, early EOS,
shuffled rows; the trainer turns it on only when it agrees."""

import pytest
import torch

from flowgrpo.text import train_text
from flowgrpo.text.config import GenerationConfig, TextLoraConfig, TinyModelConfig
from flowgrpo.text.generation import TransformersGenerator
from flowgrpo.text.logprobs import micro_logprobs, sampler_deviation, shared_prompt_deviation
from flowgrpo.text.models import apply_lora, build_tiny_model, build_tiny_tokenizer


def _llama(tok):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(
        LlamaConfig(
            vocab_size=len(tok),
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=64,
            max_position_embeddings=128,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.eos_token_id,
            bos_token_id=None,
        )
    )


def _rollout(model, tok, eos_bias=0.0):
    if eos_bias:  # make end-of-sequence likely, so completions have different lengths
        with torch.no_grad():
            model.lm_head.weight[tok.eos_token_id] += eos_bias
    gen = TransformersGenerator(model, tok, GenerationConfig(max_new_tokens=10, batch_size=64), group_size=4)
    prompts = [tok(t)["input_ids"] for t in ("ab", "hello there, friend", "x", "abc def")]
    return gen.generate(prompts, [0, 1, 2, 3])


@pytest.mark.parametrize("family", ["qwen2", "llama", "qwen2_lora"])
def test_shared_prompt_forward_equals_plain_forward_and_grads(family):
    tok = build_tiny_tokenizer()
    model = _llama(tok) if family == "llama" else build_tiny_model(TinyModelConfig(), len(tok), tok.eos_token_id)
    model.eval()
    r = _rollout(model, tok, eos_bias=3.0)
    assert len(set(r.lengths.tolist())) > 1  # ragged completions
    if family.endswith("lora"):
        model = apply_lora(model, TextLoraConfig(enabled=True, rank=4))
        with torch.no_grad():  # a non-zero adapter, so its gradients are not trivially zero
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    p.normal_(0, 0.1)
    rows = torch.randperm(r.num_sequences)[:11]  # shuffled, some groups split
    mask = r.completion_mask[rows]
    grads, outs = [], []
    for shared in (False, True):
        model.zero_grad(set_to_none=True)
        scored = micro_logprobs(model, r, rows, 0.7, with_entropy=True, shared_prompt=shared)
        logp, ent = scored.logp, scored.entropy
        (logp * mask).sum().backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.requires_grad]))
        outs.append((logp.detach(), ent.detach()))
    (lp0, e0), (lp1, e1) = outs
    assert lp0.shape == lp1.shape == mask.shape
    torch.testing.assert_close(lp1[mask], lp0[mask], atol=2e-5, rtol=0)
    torch.testing.assert_close(e1[mask], e0[mask], atol=2e-5, rtol=0)
    width = int(mask.sum(1).max())
    assert torch.all(lp1[:, width:] == 0) and torch.all(lp0[:, width:] == 0)  # beyond the micro-batch's width
    torch.testing.assert_close(grads[1], grads[0], atol=1e-4, rtol=1e-4)
    assert grads[0].abs().max() > 0
    assert shared_prompt_deviation(model, r, rows, 0.7) < 2e-5


def test_rows_without_shared_prompts_take_the_plain_path(monkeypatch):
    import flowgrpo.text.logprobs as lp_mod

    tok = build_tiny_tokenizer()
    model = build_tiny_model(TinyModelConfig(), len(tok), tok.eos_token_id).eval()
    r = _rollout(model, tok)
    called = []
    real = lp_mod._shared_prompt_logits
    monkeypatch.setattr(lp_mod, "_shared_prompt_logits", lambda *a: called.append(1) or real(*a))
    micro_logprobs(model, r, torch.tensor([0, 4, 8, 12]), 1.0, shared_prompt=True)  # four different prompts
    assert not called
    micro_logprobs(model, r, torch.tensor([0, 1, 8]), 1.0, shared_prompt=True)
    assert called == [1]


def test_trainer_uses_it_only_when_it_agrees(tiny_config, monkeypatch):
    on = train_text(tiny_config("iterations=2", "checkpoint.every=0", name="auto"))
    assert [r["train/shared_prompt"] for r in on] == [1, 1]
    off = train_text(tiny_config("iterations=2", "checkpoint.every=0", "train.shared_prompt=false", name="off"))
    assert [r["train/shared_prompt"] for r in off] == [0, 0] and "check/shared_prompt_deviation" not in off[0]
    # same samples and nearly the same updates whichever forward is used
    assert on[0]["reward_mean"] == off[0]["reward_mean"]
    assert on[1]["grad_norm"] == pytest.approx(off[1]["grad_norm"], rel=1e-3)

    import flowgrpo.text.grpo as grpo_mod

    monkeypatch.setattr(grpo_mod, "shared_prompt_deviation", lambda *a, **k: 1e-3)  # e.g. a bf16 model
    disagree = train_text(tiny_config("iterations=1", "checkpoint.every=0", name="disagree"))
    assert disagree[0]["train/shared_prompt"] == 0 and disagree[0]["check/shared_prompt_deviation"] == 1e-3


def test_config_values(tiny_config):
    assert tiny_config().train.shared_prompt == "auto"
    assert tiny_config("train.shared_prompt=true").train.shared_prompt is True
    assert tiny_config("train.shared_prompt=false").train.shared_prompt is False
    with pytest.raises(Exception, match="shared_prompt"):
        tiny_config("train.shared_prompt=sometimes")


def test_bf16_shared_path_is_within_the_sampler_gap():
    tok = build_tiny_tokenizer()
    tiny = TinyModelConfig(hidden_size=256, num_layers=4, intermediate_size=512)
    model = build_tiny_model(tiny, len(tok), tok.eos_token_id).to(torch.bfloat16).eval()
    gen = TransformersGenerator(
        model, tok, GenerationConfig(max_new_tokens=32, batch_size=64, rollout_logprobs=True), group_size=8
    )
    prompts = [tok(t)["input_ids"] for t in ("ab", "hello there, friend", "x", "abc def")]
    r = gen.generate(prompts, [0, 1, 2, 3], seed=0)
    rows = torch.arange(r.num_sequences)
    # bf16: the plain forward is far from the sampler that drew the tokens (beyond the fp32 bound, 1e-5), and the
    # shared forward no further from the plain one than that (measured: 4.8e-3 and 7.5e-3), so `auto` may take it
    gap = sampler_deviation(model, r, rows, 1.0)
    assert gap is not None and gap > 1e-5
    assert shared_prompt_deviation(model, r, rows, 1.0) <= gap
    r.rollout_logp = None
    assert sampler_deviation(model, r, rows, 1.0) is None


@pytest.mark.parametrize(
    "deviation,floor,on",
    [(1e-3, 5e-3, 1), (1e-3, 1e-4, 0), (1e-6, 0.0, 1), (1e-3, None, 0)],
    ids=["within-the-sampler-gap", "beyond-it", "fp32-agreement", "no-sampler-log-probs"],
)
def test_trainer_allows_the_shared_path_as_far_as_the_sampler_is(tiny_config, monkeypatch, deviation, floor, on):
    import flowgrpo.text.grpo as grpo_mod

    monkeypatch.setattr(grpo_mod, "shared_prompt_deviation", lambda *a, **k: deviation)
    monkeypatch.setattr(grpo_mod, "sampler_deviation", lambda *a, **k: floor)
    record = train_text(tiny_config("iterations=1", "checkpoint.every=0", "generation.rollout_logprobs=true"))[0]
    assert record["train/shared_prompt"] == on and record["check/shared_prompt_deviation"] == deviation
    assert record.get("check/shared_prompt_floor") == floor
