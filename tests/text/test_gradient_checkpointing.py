"""Gradient checkpointing of the text policy (`train.gradient_checkpointing`, and FSDP2's activation checkpointing,
which calls the same function): the policy runs in eval mode, where transformers' own checkpointing used to keep
every activation. Now each decoder layer recomputes in backward: far fewer saved activations, the same
log-probs and gradients to the last bit, dropout still off, and the trainer's records unchanged."""

import pytest
import torch

from flowgrpo.config import ConfigError
from flowgrpo.scaling.sharding import enable_activation_checkpointing
from flowgrpo.text import TextGRPOTrainer
from flowgrpo.text.config import TextLoraConfig, TinyModelConfig
from flowgrpo.text.logprobs import micro_logprobs
from flowgrpo.text.models import apply_lora, build_tiny_model, build_tiny_tokenizer

from test_shared_prompt import _llama, _rollout  # tests/text is on sys.path (rootdir import mode)


def _policy(family: str, tok):
    model = _llama(tok) if family == "llama" else build_tiny_model(TinyModelConfig(), len(tok), tok.eos_token_id)
    if family.endswith("lora"):
        model = apply_lora(model, TextLoraConfig(enabled=True, rank=4))
        with torch.no_grad():  # a non-zero adapter, so its gradients are not trivially zero
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    p.normal_(0, 0.1, generator=torch.Generator().manual_seed(1))
    return model.eval()  # as load_policy returns it


def _saved_bytes_and_grads(measure, model, rollout, rows):
    """Bytes autograd saves for backward in one training forward, the log-probs, and the gradients."""
    model.zero_grad(set_to_none=True)
    saved, logp = measure(lambda: micro_logprobs(model, rollout, rows, temperature=1.0).logp)
    (logp * rollout.completion_mask[rows]).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return saved, logp.detach(), grads


@pytest.mark.parametrize("family", ["qwen2", "qwen2_lora", "llama"])
def test_an_eval_mode_policy_recomputes_with_the_same_bits(family, saved_for_backward):
    tok = build_tiny_tokenizer()
    model = _policy(family, tok)
    rollout = _rollout(model, tok, eos_bias=3.0)
    rows = torch.arange(rollout.num_sequences)
    kept, logp, grads = _saved_bytes_and_grads(saved_for_backward, model, rollout, rows)
    enable_activation_checkpointing(model)
    recomputed, logp_ckpt, grads_ckpt = _saved_bytes_and_grads(saved_for_backward, model, rollout, rows)
    assert recomputed < kept / 3, (recomputed, kept)  # measured: 111 -> 10 MB on a 2-layer, 256-wide Qwen2
    assert torch.equal(logp_ckpt, logp)
    assert grads_ckpt.keys() == grads.keys() and len(grads) > 0
    for name, g in grads.items():
        assert torch.equal(grads_ckpt[name], g), name
    # only the checkpointed layers are marked as training; their attention (dropout) stays in eval mode
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    assert not base.training and not base.model.layers[0].self_attn.training


def test_dropout_stays_off_in_the_recomputed_layers(saved_for_backward):
    tok = build_tiny_tokenizer()
    model = _policy("qwen2", tok)
    rollout = _rollout(model, tok)
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.5  # what a model trained with dropout would carry
    enable_activation_checkpointing(model)
    rows = torch.arange(rollout.num_sequences)
    with torch.no_grad():
        sampled = micro_logprobs(model, rollout, rows, temperature=1.0).logp
    _, trained, _ = _saved_bytes_and_grads(saved_for_backward, model, rollout, rows)
    assert torch.equal(trained, sampled)  # the first training pass re-scores the rollout: ratio 1


def _count_grad_forwards(trainer):
    """Calls of the first decoder layer's MLP with grad on: one per training forward, two when recomputed."""
    mlp = trainer.model.model.layers[0].mlp
    calls, forward = [0], mlp.forward

    def counted(*args, **kwargs):
        calls[0] += torch.is_grad_enabled()
        return forward(*args, **kwargs)

    mlp.forward = counted
    return calls


def test_trainer_records_are_unchanged_by_checkpointing(tiny_config):
    common = ("iterations=2", "checkpoint.every=0", "train.micro_batch_size=4")
    plain = TextGRPOTrainer(tiny_config(*common, "train.shared_prompt=false", name="plain"))
    ckpt = TextGRPOTrainer(tiny_config(*common, "train.gradient_checkpointing=true", name="ckpt"))
    counts = [_count_grad_forwards(plain), _count_grad_forwards(ckpt)]
    records = [plain.train(), ckpt.train()]
    assert counts[0][0] > 0 and counts[1][0] == 2 * counts[0][0], counts
    assert [r["train/shared_prompt"] for r in records[1]] == [0, 0]
    keys = ("reward_mean", "loss/total", "grad_norm", "ratio/mean", "entropy/mean", "check/first_pass_ratio_dev")
    for a, b in zip(*records):
        for key in keys:
            assert a[key] == b[key], key
    for p, q in zip(plain.model.parameters(), ckpt.model.parameters()):
        assert torch.equal(p, q)


def test_shared_prompt_true_is_refused_with_checkpointing(tiny_config):
    assert tiny_config().train.gradient_checkpointing is False
    with pytest.raises(ConfigError, match="shared_prompt true cannot run with train.gradient_checkpointing"):
        tiny_config("train.gradient_checkpointing=true", "train.shared_prompt=true")


def test_a_model_whose_layers_cannot_recompute_in_eval_mode_is_refused(tiny_config, monkeypatch):
    import transformers.modeling_layers

    from flowgrpo.scaling.sharding import ShardingError

    monkeypatch.setattr(transformers.modeling_layers, "GradientCheckpointingLayer", type("Other", (), {}))
    tok = build_tiny_tokenizer()
    with pytest.raises(ShardingError, match="no transformers GradientCheckpointingLayer"):
        enable_activation_checkpointing(_policy("qwen2", tok))
    with pytest.raises(ConfigError, match="train.gradient_checkpointing: .*policy runs in eval mode"):
        TextGRPOTrainer(tiny_config("train.gradient_checkpointing=true"))
