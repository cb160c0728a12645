"""Rollout-vs-training mismatch: the recorded sampler log-probs, the importance weights of every mode, and
their effect on the trainer."""

import math

import pytest
import torch

from flowgrpo.text import train_text
from flowgrpo.text.config import GenerationConfig, RolloutCorrectionConfig, TinyModelConfig
from flowgrpo.text.generation import SampledLogprobRecorder, TransformersGenerator
from flowgrpo.text.logprobs import micro_logprobs
from flowgrpo.text.models import build_tiny_model, build_tiny_tokenizer
from flowgrpo.text.rollout_correction import correction_weights, mismatch_metrics

# 2 completions of 3 tokens; row 1 has 2 real tokens. log w = old - rollout
OLD = torch.tensor([[-1.0, -2.0, -0.5], [-1.0, -1.0, 0.0]])
ROLL = torch.tensor([[-1.0, -3.0, -0.2], [-0.9, -0.8, 0.0]])
MASK = torch.tensor([[True, True, True], [True, True, False]])
LOG_W = (OLD - ROLL) * MASK  # [[0, 1, -0.3], [-0.1, -0.2, 0]]


def weights(mode, **kw):
    """(weights, metrics) of a mode on the batch above."""
    correction = correction_weights(OLD, ROLL, MASK, RolloutCorrectionConfig(mode=mode, **kw))
    return correction.weights, correction.metrics


def test_token_truncate_clips_each_token_weight():
    w, m = weights("token_truncate", clip_max=2.0)
    expected = LOG_W.exp().clamp(max=2.0) * MASK
    torch.testing.assert_close(w, expected)
    assert w[0, 1] == 2.0 and m["mismatch/token_clipped_frac"] == pytest.approx(1 / 5)
    w, _ = weights("token_truncate", clip_min=0.8, clip_max=2.0)
    assert w[0, 2] == pytest.approx(0.8)  # exp(-0.3) = 0.74 raised to the floor


def test_token_mask_drops_tokens_outside_the_bounds():
    w, m = weights("token_mask", clip_min=0.8, clip_max=2.0)
    expected = torch.tensor([[1.0, 0.0, 0.0], [1.0, 1.0, 0.0]])  # e^1 > 2 and e^-0.3 < 0.8 leave
    torch.testing.assert_close(w, expected)
    assert m["mismatch/token_masked_frac"] == pytest.approx(2 / 5)


def test_sequence_modes_use_the_product_over_the_completion():
    seq = LOG_W.sum(1).exp()  # e^0.7 = 2.01, e^-0.3 = 0.74
    w, m = weights("sequence_truncate", clip_max=2.5)
    torch.testing.assert_close(w, seq.unsqueeze(1) * MASK)
    w, m = weights("sequence_mask", clip_max=2.0)
    torch.testing.assert_close(w, torch.tensor([[0.0, 0.0, 0.0], [1.0, 1.0, 0.0]]))
    assert m["mismatch/sequence_masked_frac"] == 0.5


def test_none_only_measures():
    w, m = weights("none")
    assert torch.equal(w, torch.ones_like(w)) and m == {}
    metrics = mismatch_metrics(OLD, ROLL, MASK)
    assert metrics["mismatch/logp_diff_max"] == pytest.approx(1.0)
    assert metrics["mismatch/logp_diff_mean"] == pytest.approx((1 + 0.3 + 0.1 + 0.2) / 5)
    d = LOG_W[MASK]
    assert metrics["mismatch/kl"] == pytest.approx(float((d.exp() - 1 - d).mean()))


def test_bad_bounds_are_refused():
    with pytest.raises(ValueError, match="clip_min"):
        RolloutCorrectionConfig(clip_min=3.0, clip_max=2.0)


@pytest.mark.parametrize("settings", [dict(temperature=1.0), dict(temperature=0.7, top_k=20)])
def test_recorded_sampler_logprobs_equal_the_training_forward(settings):
    """transformers generate with a KV cache and left padding, recorded one step late by the logits
    processor, against the trainer's re-scoring: the same numbers to float rounding (fp32)."""
    tok = build_tiny_tokenizer()
    model = build_tiny_model(TinyModelConfig(), len(tok), tok.eos_token_id).eval()
    cfg = GenerationConfig(max_new_tokens=12, rollout_logprobs=True, **settings)
    rollout = TransformersGenerator(model, tok, cfg, group_size=3).generate(
        [[72, 105], [65, 66, 67, 68]], [0, 1], seed=5
    )
    assert rollout.rollout_logp is not None and rollout.rollout_logp.shape == rollout.completion_ids.shape
    with torch.no_grad():
        logp = micro_logprobs(model, rollout, torch.arange(rollout.num_sequences), cfg.temperature).logp
    m = rollout.completion_mask
    torch.testing.assert_close(rollout.rollout_logp[m], logp[m], atol=1e-5, rtol=0)
    assert bool((rollout.rollout_logp[~m] == 0).all())
    assert float(rollout.rollout_logp[m].min()) < -1  # real log-probs, not zeros


def test_recorder_without_steps_gives_an_empty_matrix():
    assert SampledLogprobRecorder(1.0).finish(torch.zeros(2, 0, dtype=torch.long)).shape == (2, 0)


def _shift_recorded(monkeypatch, shift):
    real = SampledLogprobRecorder.finish
    monkeypatch.setattr(SampledLogprobRecorder, "finish", lambda self, tokens: real(self, tokens) + shift)


def test_trainer_measures_no_mismatch_when_the_sampler_is_the_policy(tiny_config):
    history = train_text(tiny_config("iterations=2", "checkpoint.every=0", "generation.rollout_logprobs=true"))
    for r in history:
        assert r["mismatch/logp_diff_max"] < 1e-4 and r["mismatch/weight_mean"] == pytest.approx(1.0, abs=1e-4)


def test_trainer_applies_the_weights(tiny_config, monkeypatch):
    """A sampler that under-reports every log-prob by 1: w = e > clip_max 2 on every token. Truncation
    weights every token by 2 (the loss doubles against the uncorrected run of the same batch); masking
    removes every token, so nothing is trained."""
    _shift_recorded(monkeypatch, -1.0)
    common = ["iterations=1", "checkpoint.every=0", "generation.rollout_logprobs=true", "train.inner_epochs=1"]
    plain = train_text(tiny_config(*common, "rollout_correction.mode=none", name="none"))[0]
    assert plain["mismatch/token_ratio_mean"] == pytest.approx(math.e, rel=1e-4)
    truncated = train_text(tiny_config(*common, "rollout_correction.mode=token_truncate", name="tis"))[0]
    assert truncated["mismatch/token_clipped_frac"] == 1.0 and truncated["mismatch/weight_mean"] == 2.0
    assert plain["backward_passes"] > 0 and truncated["backward_passes"] == plain["backward_passes"]
    assert truncated["loss/policy"] == pytest.approx(2 * plain["loss/policy"], rel=1e-4)
    masked = train_text(tiny_config(*common, "rollout_correction.mode=token_mask", name="mask"))[0]
    assert masked["mismatch/token_masked_frac"] == 1.0 and masked["backward_passes"] == 0
