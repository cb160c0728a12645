"""The inputs the text trainer hands to loss parts and estimators besides the log-probs (issue 31): each row's group
(REAL's exact group loss, whole groups per micro-batch), the vocabulary mean of the log-softmax (ROVER's next-state
term), each prompt's drift since its stored completion (SPO rho_type kl), and the stored completions' state. Each is
checked against a float64 re-derivation of the source's formula from what the trainer recorded."""

import math

import pytest
import torch

import flowgrpo.text.grpo as grpo
from flowgrpo.text import TextGRPOTrainer, train_text
from flowgrpo.text.drift import CompletionMemory
from flowgrpo.text.generation import Rollout
from flowgrpo.text.logprobs import micro_logprobs

SHORT = ["iterations=2", "checkpoint.every=0", "train.micro_batch_size=6"]


def _record(monkeypatch):
    """Every policy_loss call of the trainer: (inputs, normaliser, loss)."""
    calls = []
    real_loss = grpo.policy_loss

    def spy(inputs, config, norm):
        out = real_loss(inputs, config, norm)
        calls.append((inputs, norm, float(out.loss.detach())))
        return out

    monkeypatch.setattr(grpo, "policy_loss", spy)
    return calls


def _source_real(s, adv, tau):
    """Red-RL/REAL compute_policy_loss_real's sum over groups (float64 loop): s [n] per row, grouped by `adv`'s group."""
    pos = [x for x, a in zip(s, adv) if a > 0]
    neg = [x for x, a in zip(s, adv) if a < 0]
    if not (pos and neg):
        return 0.0
    return math.log(1 + sum(math.exp(-x / tau) for x in pos)) + math.log(1 + sum(math.exp(x / tau) for x in neg))


def test_real_loss_is_the_source_group_loss_also_after_the_policy_moved(tiny_config, monkeypatch):
    calls = _record(monkeypatch)
    train_text(tiny_config("recipe=real", "advantage.estimator.labels=mean", "train.inner_epochs=2", *SHORT))
    G, moved = 8, 0.0
    for inputs, norm, loss in calls:
        gi = inputs.group_index.tolist()
        assert all(gi.count(g) == G for g in set(gi)) or len(gi) == 1  # whole groups (1 row: a padding pass)
        if len(gi) == 1:
            continue
        m = inputs.mask.double()
        s = (((inputs.logp.double() - inputs.logp_old.double()) * m).sum(1) / m.sum(1)).detach()
        adv = inputs.advantages[:, 0].tolist()
        want = sum(
            _source_real(
                [s[i] for i in range(len(gi)) if gi[i] == g], [adv[i] for i in range(len(gi)) if gi[i] == g], 0.5
            )
            for g in set(gi)
        )
        assert loss * norm.num_seqs == pytest.approx(want, rel=1e-5, abs=1e-6)  # seq_mean_token_mean: / N
        moved = max(moved, float(s.abs().max()))
    assert moved > 1e-3  # the second inner epoch trained away from the rollout policy


def test_rover_next_state_term_reaches_the_loss(tiny_config, monkeypatch):
    calls = _record(monkeypatch)
    train_text(tiny_config("recipe=rover", "train.inner_epochs=2", "iterations=1", *SHORT[1:]))
    gaps = []
    for inputs, norm, loss in calls:
        if inputs.logp.shape[0] == 1:
            continue
        m = inputs.mask
        gap = torch.where(m, inputs.vocab_mean_logp.double() - inputs.vocab_mean_logp_old.double(), 0.0)
        target = inputs.advantages.double() + torch.nn.functional.pad(gap[:, 1:], (0, 1))
        q = (inputs.logp.double() - inputs.logp_old.double()).detach()
        # yuxiaooye/ROVER dp_actor.update_policy: (Q - target)^2, token mean (over the mini-batch), rover_t 1
        assert loss == pytest.approx(float(((q - target) ** 2)[m].sum()) / norm.num_tokens, rel=1e-5, abs=1e-7)
        gaps.append(float(gap.abs().max()))
    assert gaps[0] < 1e-5 and max(gaps) > 1e-4  # the first pass is on-policy (term 0), the second is not


def test_vocab_mean_is_the_mean_log_softmax_at_the_sampling_temperature(tiny_config):
    trainer = TextGRPOTrainer(tiny_config("iterations=1"))
    model, T = trainer.model, 0.7
    prompt = torch.tensor([[0, 5, 6], [7, 8, 9]])
    completion = torch.tensor([[10, 11, 12, 13], [14, 15, 0, 0]])
    cmask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]], dtype=torch.bool)
    rollout = Rollout(prompt, torch.tensor([[0, 1, 1], [1, 1, 1]]), completion, cmask,
                      torch.zeros(2, dtype=torch.bool), torch.tensor([0, 1]), 1)  # fmt: skip
    with torch.no_grad():
        got = micro_logprobs(model, rollout, torch.arange(2), T, with_vocab_mean=True)
        for i in range(2):
            ids = torch.cat([prompt[i][rollout.prompt_mask[i].bool()], completion[i][cmask[i]]])
            logits = model(input_ids=ids.unsqueeze(0)).logits[0].double() / T
            start = int(rollout.prompt_mask[i].sum()) - 1
            want = torch.log_softmax(logits, -1)[start : start + int(cmask[i].sum())].mean(-1)
            torch.testing.assert_close(got.vocab_mean[i, : int(cmask[i].sum())].double(), want, rtol=0, atol=1e-5)
    assert got.vocab_mean.requires_grad is False


def test_spo_kl_drift_is_the_sources_and_its_state_round_trips(tiny_config, monkeypatch):
    """2 prompts, 2 per step: from step 2 each prompt is seen again; D = the token mean of |stored - current| on its
    stored completion, re-derived here with a plain float64 forward of the current policy."""
    checked, original = [], CompletionMemory.drift
    trainers = []

    def spy(self, rollout, score):
        before = dict(self.items)
        model = trainers[0].model
        out = original(self, rollout, score)
        G = rollout.group_size
        for p in range(rollout.num_sequences // G):
            row = int(rollout.prompt_index[p * G])
            if row not in before:
                assert out[p] == 0.0
                continue
            tokens, stored = before[row]
            pm = rollout.prompt_mask[p * G].bool()
            ids = torch.cat([rollout.prompt_ids[p * G][pm], tokens])
            with torch.no_grad():
                logits = model(input_ids=ids.unsqueeze(0)).logits[0].double()  # temperature 1
            lp = torch.log_softmax(logits, -1)[int(pm.sum()) - 1 : -1].gather(1, tokens.unsqueeze(1))[:, 0]
            assert float(out[p]) == pytest.approx(float((stored.double() - lp).abs().mean()), abs=2e-6)
            checked.append(float(out[p]))
        return out

    monkeypatch.setattr(CompletionMemory, "drift", spy)
    cfg = tiny_config("recipe=spo", "advantage.estimator.rho_type=kl", "data.task.rows=2", "train.inner_epochs=1",
                      "iterations=3", "checkpoint.every=0")  # fmt: skip
    trainer = TextGRPOTrainer(cfg)
    trainers.append(trainer)
    history = trainer.train()
    assert len(checked) == 4 and min(checked) > 0  # steps 2 and 3, both prompts: the policy moved
    rho = [r["spo/rho"] for r in history]
    assert rho[0] == 0.96 and all(r < 0.96 for r in rho[1:])
    assert all(r["optimizer_steps"] == 1 and math.isfinite(r["loss/total"]) for r in history)  # it trains
    from flowgrpo.checkpoint.parts import CheckpointParts

    parts = CheckpointParts()
    trainer.method.checkpoint_parts(parts)
    fresh = CompletionMemory()
    fresh.load_state_dict(parts.tensors["spo_completions"])
    assert fresh.items.keys() == trainer.method.memory.items.keys() == {0, 1}
    for row, (tok, lp) in trainer.method.memory.items.items():
        assert torch.equal(fresh.items[row][0], tok) and torch.equal(fresh.items[row][1], lp)
