"""Pieces of the text trainer: tokenizer, data, generation, log-probs, dynamic sampling, micro-batching, CLI."""

import json
import math
from pathlib import Path

import pytest
import torch

from flowgrpo.config import ConfigError
from flowgrpo.core import LossConfig
from flowgrpo.text import TextGRPOTrainer, load_text_config, train_text
from flowgrpo.text.config import TextDataConfig, GenerationConfig, TinyModelConfig
from flowgrpo.run import PromptSampler
from flowgrpo.text.data import load_prompts
from flowgrpo.text.generation import Rollout, TransformersGenerator, completion_mask
from flowgrpo.text.logprobs import batch_logprobs, micro_logprobs
from flowgrpo.text.models import build_tiny_model, build_tiny_tokenizer

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny():
    tok = build_tiny_tokenizer()
    model = build_tiny_model(TinyModelConfig(), len(tok), tok.eos_token_id).eval()
    return tok, model


def test_byte_tokenizer_round_trips_any_text(tiny):
    tok, _ = tiny
    text = "héllo wörld 12 + 3 = \\boxed{15} ✓"
    ids = tok(text)["input_ids"]
    assert len(ids) == len(text.encode()) and tok.decode(ids) == text
    assert tok.eos_token_id == tok.pad_token_id == 256


def test_tiny_model_weights_depend_only_on_init_seed():
    tok = build_tiny_tokenizer()
    torch.manual_seed(1)
    a = build_tiny_model(TinyModelConfig(), len(tok), 256)
    before = torch.rand(1)
    torch.manual_seed(1)
    b = build_tiny_model(TinyModelConfig(), len(tok), 256)
    assert torch.equal(torch.rand(1), before)  # the global RNG is untouched
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))


def test_chat_template_applied_or_not(tiny):
    tok, _ = tiny
    on = load_prompts(
        TextDataConfig(task={"name": "pattern", "rows": 2}, system_prompt="Be brief."),
        tok,
        context_length=256,
        max_new_tokens=8,
    )
    text = tok.decode(on.prompt_ids[0])
    assert text.startswith("<|im_start|>system\nBe brief.<|im_end|>") and text.endswith("<|im_start|>assistant\n")
    off = load_prompts(
        TextDataConfig(task={"name": "pattern", "rows": 2}, chat_template=False),
        tok,
        context_length=256,
        max_new_tokens=8,
    )
    assert tok.decode(off.prompt_ids[0]) == off.rows[0]["prompt"]


def test_conversational_prompts_from_jsonl(tiny, tmp_path):
    tok, _ = tiny
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps({"prompt": [{"role": "user", "content": "2+2?"}], "answer": "4"}) + "\n")
    data = load_prompts(
        TextDataConfig(path=str(path)),
        tok,
        context_length=256,
        max_new_tokens=8,
        required_columns={"math_answer": ["answer"]},
    )
    assert data.conversational == [True] and "2+2?" in tok.decode(data.prompt_ids[0])


def test_sampler_epochs_and_state():
    s = PromptSampler(5, seed=3)
    first = s.next(7)
    assert sorted(first[:5]) == [0, 1, 2, 3, 4] and s.state_dict() == {"epoch": 1, "position": 2, "num_rows": 5}
    t = PromptSampler(5, seed=3)
    t.load_state_dict(s.state_dict())
    assert t.next(6) == s.next(6)


def test_completion_mask_includes_first_eos_only():
    tokens = torch.tensor([[5, 6, 0, 0, 0], [5, 0, 7, 0, 0], [5, 6, 7, 8, 9]])
    mask, truncated = completion_mask(tokens, [0])
    assert mask.tolist() == [[1, 1, 1, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 1]]
    assert truncated.tolist() == [False, False, True]


def test_generation_groups_padding_and_sampling_settings(tiny):
    tok, model = tiny
    gen = TransformersGenerator(
        model, tok, GenerationConfig(max_new_tokens=6, batch_size=4, temperature=0.7, top_k=5), group_size=3
    )
    prompts = [tok("ab")["input_ids"], tok("abcdef")["input_ids"], tok("x")["input_ids"]]
    r = gen.generate(prompts, [10, 11, 12])
    assert r.num_sequences == 9 and r.prompt_index.tolist() == [10] * 3 + [11] * 3 + [12] * 3
    assert r.prompt_ids.shape[1] == 6 and r.prompt_mask[0].tolist() == [0, 0, 0, 0, 1, 1]  # left padding
    assert r.completion_ids.shape[1] <= 6
    assert torch.equal(r.truncated, (r.lengths == 6) & (r.completion_ids[:, -1] != 256))
    assert gen.settings["sampling/temperature"] == 0.7 and gen.settings["sampling/top_k"] == 5
    sub = r.select_groups([2, 0])
    assert sub.prompt_index.tolist() == [12] * 3 + [10] * 3


def test_recomputed_logprobs_match_generate_and_ignore_padding(tiny):
    """The log-probs the trainer recomputes are those generate sampled from, whatever the padding."""
    tok, model = tiny
    torch.manual_seed(0)
    prompts = [tok("a")["input_ids"], tok("hello there")["input_ids"]]
    from transformers import GenerationConfig as HF

    ids = torch.full((2, 11), 256)
    att = torch.zeros(2, 11, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, 11 - len(p) :] = torch.tensor(p)
        att[i, 11 - len(p) :] = 1
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=att,
            return_dict_in_generate=True,
            output_logits=True,
            generation_config=HF(
                do_sample=True, temperature=0.8, top_k=0, max_new_tokens=8, eos_token_id=[256], pad_token_id=256
            ),
        )
    comp = out.sequences[:, 11:]
    mask, trunc = completion_mask(comp, [256])
    r = Rollout(ids, att, torch.where(mask, comp, 256), mask, trunc, torch.arange(2), 1)
    logp = batch_logprobs(model, r, 0.8, batch_size=2).logp
    sampled = torch.log_softmax(torch.stack(out.logits, 1).float() / 0.8, -1).gather(-1, comp.unsqueeze(-1))[..., 0]
    assert torch.allclose(logp[mask], sampled[mask], atol=1e-5)
    # each row alone (no padding at all) gives the same log-probs
    for i in range(2):
        alone = Rollout(
            ids[i : i + 1, 11 - len(prompts[i]) :],
            att[i : i + 1, 11 - len(prompts[i]) :],
            r.completion_ids[i : i + 1],
            mask[i : i + 1],
            trunc[i : i + 1],
            torch.arange(1),
            1,
        )
        lp = micro_logprobs(model, alone, torch.arange(1), 0.8).logp
        assert torch.allclose(lp[0][mask[i]], logp[i][mask[i]], atol=1e-5)


def test_micro_batch_size_does_not_change_the_update(tiny_config):
    """ONE global normaliser per optimizer step: the update does not depend on the micro-batch size."""
    params = []
    for micro in (16, 3):
        t = TextGRPOTrainer(
            tiny_config(
                "iterations=1",
                "train.inner_epochs=1",
                f"train.micro_batch_size={micro}",
                "optim.eps=1.0",
                "optim.max_grad_norm=null",
                "optim.lr=1.0",
                "checkpoint.every=0",
                "checkpoint.save_final_model=false",
                "loss.preset=dr_grpo",
                name=f"m{micro}",
            )
        )
        t.train()
        params.append(torch.cat([p.detach().flatten() for p in t.model.parameters()]))
    assert torch.allclose(params[0], params[1], atol=1e-6, rtol=1e-4)


def test_dynamic_sampling_drops_flat_groups_and_refills(tiny_config, tmp_path):
    """Prompts asking for "z" always score 0 (no spread): their groups are dropped, more are generated."""
    rows = [{"prompt": "say a", "target": "a"}, {"prompt": "say z", "target": "z"}] * 4
    path = tmp_path / "mixed.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))

    def only_a(prompts, completions, target, **kw):
        return [0.0 if t == "z" else float(len(c) % 3) for c, t in zip(completions, target)]

    cfg = tiny_config(
        f"data.path={path}",
        "data.task=null",
        "iterations=3",
        "checkpoint.every=0",
        "rewards=[{name: only_a}]",
        "dynamic_sampling.enabled=true",
        "dynamic_sampling.max_extra_rounds=2",
        "prompts_per_iteration=2",
        "data.shuffle=false",
    )
    history = train_text(cfg, reward_funcs={"only_a": only_a})
    for r in history:
        assert r["dynamic_sampling/extra_rounds"] <= 2
        assert r["count/generated_groups"] == 2 * (1 + r["dynamic_sampling/extra_rounds"])
        assert r["dynamic_sampling/kept_groups"] + r["dynamic_sampling/dropped_groups"] == r["count/generated_groups"]
        assert r["zero_std_frac"] == 0.0  # only groups with reward spread are trained on
    assert sum(r["dynamic_sampling/dropped_groups"] for r in history) >= 3


def test_every_sample_level_estimator_runs(tiny_config):
    for est in ("rloo", "dr_grpo", "mc_grpo"):
        h = train_text(tiny_config("iterations=1", "checkpoint.every=0", f"advantage.estimator={est}", name=est))
        assert math.isfinite(h[0]["adv/num_live"])


def test_step_level_estimator_is_refused_clearly(tiny_config):
    """At config load, from what the estimator reads (its registry entry), before any model is built."""
    with pytest.raises(ConfigError, match="estimator 'sibling' reads siblings .* one advantage per completion"):
        tiny_config("iterations=1", "advantage.estimator=sibling")


def test_config_errors_name_the_key(tmp_path):
    with pytest.raises(ConfigError, match="unknown key 'lrr'"):
        load_text_config(Path("configs/text/tiny_pattern.yaml"), ["optim.lrr=1"])
    with pytest.raises(ConfigError, match="unknown loss preset 'dapoo'"):
        load_text_config(Path("configs/text/tiny_pattern.yaml"), ["loss.preset=dapoo"])
    with pytest.raises(ConfigError, match="exactly one of data.path"):
        load_text_config(Path("configs/text/tiny_pattern.yaml"), ["data.path=x.jsonl"])
    assert LossConfig(preset="gspo").ratio.name == "sequence"


def test_cli_train_text_and_final_model(tmp_path, capsys):
    from flowgrpo.cli import main

    out = tmp_path / "cli"
    rc = main(
        [
            "train-text",
            "configs/text/tiny_pattern.yaml",
            f"output_dir={out}",
            "iterations=2",
            "progress=false",
            "checkpoint.save_final_model=true",
            "num_threads=1",
        ]
    )
    assert rc == 0 and "reward" in capsys.readouterr().out
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    need = {
        "reward_mean",
        "reward_std",
        "rewards/target_pattern/mean",
        "adv/std",
        "clip/frac",
        "approx_kl",
        "ratio/mean",
        "completions/mean_length",
        "completions/max_length",
        "completions/clipped_ratio",
        "tokens/per_second",
        "time_rollout_s",
        "time_reward_s",
        "time_train_s",
        "rewards/nan_count",
        "check/first_pass_ratio_dev",
        "sampling/temperature",
        "grad_norm",
        "lr",
        "backward_passes",
    }
    assert need <= set(rows[0]), need - set(rows[0])
    assert (out / "config.yaml").is_file() and (out / "final" / "config.json").is_file()
    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(out / "final").config.hidden_size == 64
    assert main(["train-text", "configs/text/tiny_pattern.yaml", "optim.nope=1"]) == 2


def test_real_loading_path_from_a_saved_folder(tiny_config, tmp_path):
    """The AutoModelForCausalLM / AutoTokenizer route (as for a real model), with LoRA and KL on top."""
    first = tiny_config("iterations=1", "checkpoint.save_final_model=true", name="saved")
    train_text(first)
    folder = Path(first.output_dir) / "final"
    h = train_text(
        tiny_config(
            f"model.name_or_path={folder}",
            "iterations=1",
            "model.lora.enabled=true",
            "loss.kl.coef=0.01",
            "data.chat_template=true",
            "checkpoint.every=0",
            name="loaded",
        )
    )
    assert h[0]["check/first_pass_ratio_dev"] <= 1e-5 and h[0]["kl/ref_mean"] >= 0


@pytest.mark.parametrize("path", sorted(str(p.relative_to(ROOT)) for p in (ROOT / "configs" / "text").rglob("*.yaml")))
def test_every_shipped_text_config_is_valid(path):
    """Every recipe under configs/text passes the strict config (unknown keys, bad values, cross checks)."""
    cfg = load_text_config(ROOT / path)
    assert cfg.iterations > 0 and cfg.rewards


def test_vllm_settings_it_cannot_run_with_fail_at_config_load(tmp_path, monkeypatch):
    """Before any model loads: a GGUF file without its de-quantised copy, and a ZeRO-3 launch."""
    base = [f"output_dir={tmp_path / 'run'}", "generation.backend=vllm", "model.name_or_path=/models/qwen"]
    with pytest.raises(ConfigError, match="needs model.gguf_cache_dir"):
        load_text_config(Path("configs/text/tiny_pattern.yaml"), [*base, "model.gguf_file=q4.gguf"])
    for key, value in {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3",
                       "ACCELERATE_DEEPSPEED_ZERO3_INIT": "false"}.items():  # fmt: skip
        monkeypatch.setenv(key, value)
    with pytest.raises(ConfigError, match="vllm under ZeRO-3"):
        load_text_config(Path("configs/text/tiny_pattern.yaml"), base)
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO_STAGE", "2")
    assert load_text_config(Path("configs/text/tiny_pattern.yaml"), base).generation.backend == "vllm"
