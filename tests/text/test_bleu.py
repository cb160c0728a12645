"""Batched token-id sentence BLEU equals sacrebleu's sentence_bleu (tokenize='none', same smoothing) on the
same whitespace-token sequences, to 1e-6; edge cases; no leakage between sentences of a batch; the
registered `bleu` reward (whitespace and policy-token modes) and its use in the trainer."""

import logging
import random

import pytest
import sacrebleu
import torch

from flowgrpo.text import train_text
from flowgrpo.text.bleu import bleu_from_statistics, bleu_statistics, pad_ids, sentence_bleu_ids
from flowgrpo.text.config import RewardSpec
from flowgrpo.text.models import build_tiny_tokenizer
from flowgrpo.text.reward_functions import REWARDS, build_rewards

logging.getLogger("sacrebleu").setLevel(logging.ERROR)  # "enable effective_order" advice for the False cases

METHODS = ["exp", "floor", "add-k", "none"]


def _words(ids):
    return " ".join(f"w{i}" for i in ids)


def _sacre(hyp, refs, method, eff=True, value=None):
    return (
        sacrebleu.sentence_bleu(
            _words(hyp),
            [_words(r) for r in refs],
            smooth_method=method,
            smooth_value=value,
            tokenize="none",
            use_effective_order=eff,
        ).score
        / 100
    )


def _random_cases(seed, n):
    rng = random.Random(seed)
    cases = []
    for _ in range(n):
        vocab = rng.choice([2, 3, 5, 30])  # small vocabularies: many repeated n-grams
        hyp = [rng.randrange(vocab) for _ in range(rng.choice([0, 1, 2, 3, rng.randint(4, 25)]))]
        refs = [[rng.randrange(vocab) for _ in range(rng.randint(0, 25))] for _ in range(rng.randint(1, 4))]
        if rng.random() < 0.3:  # a reference that shares a span with the hypothesis
            refs[0] = refs[0][:3] + hyp[1 : rng.randint(1, 12)] + refs[0][3:]
        cases.append((hyp, refs))
    return cases


@pytest.mark.parametrize("eff", [True, False], ids=["effective_order", "full_order"])
@pytest.mark.parametrize("method", METHODS)
def test_equals_sacrebleu_on_random_cases(method, eff):
    cases = _random_cases(2 * METHODS.index(method) + eff, 300)
    ours = sentence_bleu_ids([h for h, _ in cases], [r for _, r in cases], smooth_method=method, effective_order=eff)
    ref = torch.tensor([_sacre(h, r, method, eff) for h, r in cases], dtype=torch.float64)
    assert ours.dtype == torch.float64 and ours.shape == (300,)
    assert (ref > 0).sum() > 20  # the cases are not all trivial zeros
    torch.testing.assert_close(ours, ref, atol=1e-6, rtol=0)


@pytest.mark.parametrize("method, value", [("floor", 0.3), ("add-k", 2), ("add-k", 0.5)])
def test_smoothing_values(method, value):
    cases = _random_cases(7, 150)
    ours = sentence_bleu_ids([h for h, _ in cases], [r for _, r in cases], smooth_method=method, smooth_value=value)
    ref = torch.tensor([_sacre(h, r, method, value=value) for h, r in cases], dtype=torch.float64)
    torch.testing.assert_close(ours, ref, atol=1e-6, rtol=0)


@pytest.mark.parametrize("max_n", [1, 2, 3, 5])
def test_other_orders(max_n):
    cases = _random_cases(11, 100)
    ours = sentence_bleu_ids([h for h, _ in cases], [r for _, r in cases], max_n=max_n)
    metric = sacrebleu.BLEU(tokenize="none", smooth_method="exp", effective_order=True, max_ngram_order=max_n)
    ref = torch.tensor(
        [metric.sentence_score(_words(h), [_words(x) for x in r]).score / 100 for h, r in cases], dtype=torch.float64
    )
    torch.testing.assert_close(ours, ref, atol=1e-6, rtol=0)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize(
    "hyp, refs",
    [
        ([], [[1, 2, 3]]),  # empty hypothesis
        ([], [[]]),  # empty hypothesis and reference
        ([1], [[1]]),  # shorter than every order but 1
        ([1, 2], [[1, 2, 3, 4]]),  # shorter than n, brevity penalty
        ([1, 2, 3], [[1, 2, 3]]),
        ([1, 2, 3, 4], [[1, 2, 3, 4]]),  # identical: 1
        ([5, 6, 7, 8], [[1, 2, 3, 4]]),  # nothing in common: 0
        ([1, 1, 1, 1, 1], [[1, 2]]),  # clipping
        ([1, 2, 3, 4, 5, 6], [[1, 2, 3], [1, 2, 3, 4, 5, 6, 7, 8], [9]]),  # several references
        ([1, 2, 3, 4], [[1, 2], [1, 2, 3, 4, 5, 6]]),  # equally close references: the shorter one counts
        ([1, 2, 3], [[]]),  # empty reference
    ],
)
def test_edge_cases(method, hyp, refs):
    ours = sentence_bleu_ids([hyp], [refs], smooth_method=method)
    assert float(ours[0]) == pytest.approx(_sacre(hyp, refs, method), abs=1e-9)


def test_statistics_by_hand():
    # hypothesis "a a a a b" against "a b" and "a a c": unigram a counts at most 2 (second reference)
    hyp_ids, hyp_len = pad_ids([[0, 0, 0, 0, 1]])
    refs = torch.tensor([[[0, 1, 9], [0, 0, 2]]])
    correct, total, hl, rl = bleu_statistics(hyp_ids, hyp_len, refs, torch.tensor([[2, 3]]), max_n=4)
    assert correct.tolist() == [[3, 2, 0, 0]]  # a x2 + b x1; (a a) x1 + (a b) x1
    assert total.tolist() == [[5, 4, 3, 2]]
    assert hl.tolist() == [5] and rl.tolist() == [3]
    score = bleu_from_statistics(correct, total, hl, rl, smooth_method="exp")
    manual = 1.0 * ((3 / 5) * (2 / 4) * (1 / (2 * 3)) * (1 / (4 * 2))) ** 0.25
    assert float(score[0]) == pytest.approx(manual, rel=1e-12)


def test_batch_equals_one_at_a_time_no_leak_between_sentences():
    """Sentence i's n-grams never count as matches for sentence j (the key holds the sentence)."""
    cases = _random_cases(3, 60)
    hyps, refs = [h for h, _ in cases], [r for _, r in cases]
    batch = sentence_bleu_ids(hyps, refs)
    single = torch.cat([sentence_bleu_ids([h], [r]) for h, r in cases])
    assert torch.equal(batch, single)
    # a reference that matches ANOTHER sentence's hypothesis exactly gives no credit here
    out = sentence_bleu_ids([[1, 2, 3, 4], [5, 6, 7, 8]], [[[5, 6, 7, 8]], [[1, 2, 3, 4]]])
    assert out.tolist() == [0.0, 0.0]


def test_missing_reference_is_an_error():
    with pytest.raises(ValueError, match="at least one reference"):
        bleu_statistics(*pad_ids([[1, 2]]), torch.zeros((1, 1, 2), dtype=torch.long), torch.tensor([[-1]]))
    with pytest.raises(ValueError, match="smooth_method"):
        sentence_bleu_ids([[1]], [[1]], smooth_method="exponential")


def test_large_token_ids_and_padding_value_do_not_matter():
    """Vocabulary-sized ids (no vocabulary hashing) and the id 0 used as padding are plain tokens."""
    hyp = [[0, 0, 151_000, 0], [7]]
    refs = [[[0, 151_000, 0]], [[7, 0, 0]]]
    ours = sentence_bleu_ids(hyp, refs)
    ref = [_sacre(h, r, "exp") for h, r in zip(hyp, refs)]
    assert ours.tolist() == pytest.approx(ref, abs=1e-9)


# --- the reward ----------------------------------------------------------------------------------


def _call(reward, completions, ids=None, **columns):
    return reward.fn(
        prompts=["p"] * len(completions),
        completions=completions,
        completion_ids=ids or [[1]] * len(completions),
        trainer_state={},
        **columns,
    )


def test_whitespace_reward_equals_sacrebleu_on_text():
    rng = random.Random(5)
    words = "the cat sat on a mat . dog ran".split()
    comps = [" ".join(rng.choice(words) for _ in range(rng.randint(0, 12))) for _ in range(80)]
    refs = [
        [" ".join(rng.choice(words) for _ in range(rng.randint(1, 12))) for _ in range(rng.randint(1, 3))]
        for _ in range(80)
    ]
    for method in METHODS:
        (r,) = build_rewards(
            [RewardSpec.model_validate({"name": "bleu", "tokenize": "whitespace", "smooth_method": method})]
        )
        got = _call(r, comps, reference=refs)
        want = [
            sacrebleu.sentence_bleu(c, rs, smooth_method=method, tokenize="none").score / 100
            for c, rs in zip(comps, refs)
        ]
        assert got == pytest.approx(want, abs=1e-6), method


def test_reward_columns_none_lowercase_and_conversational():
    (r,) = build_rewards([RewardSpec.model_validate({"name": "bleu", "tokenize": "whitespace", "lowercase": True})])
    assert r.columns == ("reference",)
    got = _call(
        r,
        ["The Cat sat", [{"role": "assistant", "content": "a b c d"}], "x"],
        reference=["the cat sat", ["q", "a b c d"], None],
    )
    assert got == [pytest.approx(1.0), pytest.approx(1.0), None]
    (s,) = build_rewards([RewardSpec.model_validate({"name": "bleu", "tokenize": "whitespace", "column": "gold"})])
    assert s.columns == ("gold",) and _call(s, ["The Cat"], gold=["the cat"]) == [0.0]  # case matters by default


def test_policy_token_reward_uses_completion_ids_and_drops_eos():
    tok = build_tiny_tokenizer()
    (r,) = build_rewards([RewardSpec(name="bleu")], context={"tokenizer": tok, "eos_token_ids": [256], "device": "cpu"})
    ids = tok("hello world", add_special_tokens=False)["input_ids"]
    got = _call(
        r,
        ["ignored", "ignored", "ignored"],
        ids=[ids + [256], ids[:5] + [256], [256]],
        reference=["hello world", "hello world", "hello world"],
    )
    assert got[0] == pytest.approx(1.0) and got[2] == 0.0
    want = sentence_bleu_ids([ids[:5]], [[ids]])[0]
    assert got[1] == pytest.approx(float(want)) and 0 < got[1] < 1
    with pytest.raises(ValueError, match="needs the policy's tokenizer"):
        build_rewards([RewardSpec(name="bleu")])
    with pytest.raises(ValueError, match="smooth_method"):
        build_rewards(
            [RewardSpec.model_validate({"name": "bleu", "smooth_method": "add1"})], context={"tokenizer": tok}
        )


def test_bleu_in_the_registry_and_trainer(tiny_config):
    assert {"bleu", "semantic_similarity"} <= set(REWARDS.names())
    history = train_text(
        tiny_config("iterations=2", "checkpoint.every=0", "data.task={name: echo, rows: 8}", "rewards=[{name: bleu}]")
    )
    values = [h["rewards/bleu/mean"] for h in history]
    assert all(0.0 <= v <= 1.0 for v in values)
    assert history[0]["rewards/bleu/error_count"] == 0 and history[0]["rewards/bleu/none_count"] == 0
