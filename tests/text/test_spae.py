"""SPAE in the text trainer (flowgrpo/text/step_probe.py, method grpo's hooks): the probe -> step_rewards ->
per-token advantage path re-derived loop by loop in float64 on fixed inputs (teacher-forced and sampled readings),
the gold-answer and settings errors, and the recipe learning the toy task against the same run at lr 0.

On the tiny random model the source's boundary ".\\n\\n" is never sampled (a byte-level tokenizer has no such token,
and random bytes rarely spell it): the fixed inputs end steps at "." and the learning run sets `boundary: a`, the
toy task's target letter (every "a" ends a step; a completion without one is a single step, its outcome advantage
alone).
"""

import math
import statistics
import types

import pytest
import torch

from flowgrpo.config import ConfigError
from flowgrpo.core import compute_advantages
from flowgrpo.distributed import Distributed
from flowgrpo.text import train_text
from flowgrpo.text.collect import group_batch
from flowgrpo.text.generation import Rollout
from flowgrpo.text.models import build_tiny_model, build_tiny_tokenizer
from flowgrpo.text import step_probe
from flowgrpo.text.step_probe import StepProbe

SPAE = "advantage.estimator={name: spae, boundary: '.', shaping_coef: 0.5}"
ARITH = ["data.task={name: arithmetic, rows: 4}", "rewards=[{name: math_answer}]", SPAE]


def _fixed(tiny_config, *extra):
    """A config, the tiny model, its tokenizer, four data rows and a P = 2 x G = 2 rollout with known tokens."""
    cfg = tiny_config(*ARITH, *extra)
    tok = build_tiny_tokenizer()
    torch.manual_seed(0)
    model = build_tiny_model(cfg.model.tiny, len(tok), tok.eos_token_id).eval()
    rows = [{"prompt": "q0", "answer": "12"}, {"prompt": "q1", "answer": "-3"}]
    enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    prompts = [enc("What is 5+7?"), enc("2-5=")]
    completions = [enc("5+7. so 12."), enc("hm 12"), enc("2. minus 5. is -3. ok"), enc(".x.")]
    eos = tok.eos_token_id
    completions[1] = completions[1] + [eos]  # an end-of-sequence token inside the mask
    Lp, Tc = max(map(len, prompts)), max(map(len, completions)) + 2
    pids = torch.full((4, Lp), eos)
    pmask = torch.zeros(4, Lp, dtype=torch.long)
    cids = torch.full((4, Tc), eos)
    cmask = torch.zeros(4, Tc, dtype=torch.bool)
    for n in range(4):
        p, c = prompts[n // 2], completions[n]
        pids[n, Lp - len(p) :], pmask[n, Lp - len(p) :] = torch.tensor(p), 1
        cids[n, : len(c)], cmask[n, : len(c)] = torch.tensor(c), True
    index = torch.tensor([0, 0, 1, 1])
    rollout = Rollout(pids, pmask, cids, cmask, torch.zeros(4, dtype=torch.bool), index, 2)
    ctx = types.SimpleNamespace(cfg=cfg, model=model, dist=Distributed(), iteration=0)
    return cfg, model, tok, rows, rollout, ctx, completions, prompts


def test_probe_to_token_advantages_match_a_float64_loop(tiny_config):
    cfg, model, tok, rows, rollout, ctx, completions, prompts = _fixed(tiny_config)
    probe = StepProbe(ctx, tok, rows)
    rewards = torch.tensor([[1.0], [0.0], [0.0], [1.0]])
    groups = group_batch(cfg, [types.SimpleNamespace(weight=1.0, name="r")], rewards, rollout)
    record, counts = {}, {"nfe_nograd": 0}
    fed = probe.inputs(groups, rollout, record, counts)
    adv = compute_advantages(fed, cfg.advantage)
    tokens = probe.token_advantages(adv, rollout)

    # the float64 loop: steps, one forward per probe, acc / conf / Phi, the estimator, each token's step
    enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    suffix, dot = enc("**Final Answer**\n\\boxed{"), enc(".")[0]
    m64 = build_tiny_model(cfg.model.tiny, len(tok), tok.eos_token_id)
    m64.load_state_dict(model.state_dict())
    m64 = m64.double().eval()
    ends = [[j for j, t in enumerate(c) if t == dot] or [len(c) - 1] for c in completions]
    assert ends == [[3, 10], [5], [1, 10, 17], [0, 2]]
    phi = []
    for n, c in enumerate(completions):
        gold = enc(rows[n // 2]["answer"])
        row = []
        for end in ends[n]:
            ids = torch.tensor([prompts[n // 2] + c[: end + 1] + suffix + gold])
            with torch.no_grad():
                logits = m64(input_ids=ids).logits[0, -len(gold) - 1 : -1]
            logp = torch.log_softmax(logits, -1)
            lp = sum(float(logp[k, g]) for k, g in enumerate(gold))
            H = sum(float(-(logp[k].exp() * logp[k]).sum()) for k in range(len(gold)))
            acc, conf = math.exp(lp) / len(gold), math.exp(-H) / len(gold)
            row.append(1.5 * acc * conf + 0.5 * acc - conf)
        phi.append(row)
    S = fed.step_rewards.shape[-1]
    assert S == 3 and counts["nfe_nograd"] == sum(map(len, ends)) == 8
    for n in range(4):
        got = fed.step_rewards.view(4, S)[n]
        assert got[: len(phi[n])].tolist() == pytest.approx(phi[n], abs=1e-5)
        assert fed.step_mask.view(4, S)[n].tolist() == [k < len(phi[n]) for k in range(S)]
    r = rewards[:, 0].tolist()
    for n in range(4):
        g = [r[2 * (n // 2)], r[2 * (n // 2) + 1]]
        mean = sum(g) / 2
        std = math.sqrt(sum((x - mean) ** 2 for x in g) / 1)  # unbiased, as grpo's default
        a_group = (r[n] - mean) / (std + 1e-4)
        step_adv, saturated = [], False
        for k, p in enumerate(phi[n]):
            f = 0.5 if saturated and a_group > 0 else 1.0
            saturated = saturated or p >= 0.9
            delta = 0.0 if k == 0 else p - phi[n][k - 1]
            step_adv.append(a_group * f + 0.5 * max(-1.0, min(1.0, delta)))
        for j in range(len(completions[n])):
            k = next((i for i, e in enumerate(ends[n]) if j <= e), len(ends[n]) - 1)
            assert float(tokens[n, j]) == pytest.approx(step_adv[k], abs=1e-5), (n, j)
    # every real step weighs 1, the padding steps 0: one weight per completion after grpo's amax over steps
    assert adv.sample_weight.amax(-1).tolist() == [[1.0, 1.0], [1.0, 1.0]]
    assert record["spae/steps_mean"] == 2.0


def test_gold_answers_and_settings_are_checked(tiny_config):
    cfg, model, tok, rows, rollout, ctx, *_ = _fixed(tiny_config)
    with pytest.raises(ValueError, match=r"row 1 has no 'answer'"):
        StepProbe(ctx, tok, [rows[0], {"prompt": "q1"}])
    ctx.cfg = tiny_config(SPAE, "data.task={name: unknown_task}")
    with pytest.raises(ValueError, match=r"data.task 'unknown_task' has none \(tasks with them: \['arithmetic'"):
        StepProbe(ctx, tok, rows)
    ctx.cfg = tiny_config(SPAE, "data.task={name: unknown_task}", "advantage.estimator.answer_column=answer")
    assert StepProbe(ctx, tok, rows).gold == ["12", "-3"]
    with pytest.raises(ConfigError, match=r"probe_samples: must be an integer >= 0, got -1"):
        tiny_config(*ARITH, "advantage.estimator.probe_samples=-1")
    with pytest.raises(ConfigError, match=r"no setting 'boundry'.*valid settings: \['answer_column', 'boundary'"):
        tiny_config("advantage.estimator={name: spae, boundry: a}")


def test_sampled_probes_read_what_the_source_reads(tiny_config, monkeypatch):
    """probe_samples N > 0: N continuations per probe (temperature 0.6 here); at each sampled position t < K the
    gold token's log-prob if in the top 20 of the model's (temperature-1) distribution, else -10, and the top 20's
    unnormalised entropy, both re-derived by a float64 forward over prefix + the sampled tokens before t."""
    N = 3
    cfg, model, tok, rows, rollout, ctx, completions, prompts = _fixed(
        tiny_config, f"advantage.estimator.probe_samples={N}", "advantage.estimator.probe_max_tokens=4",
        "advantage.estimator.probe_batch_size=24",  # 24 sequences a generate call: the 8 probes x N in one
    )  # fmt: skip
    readers = []

    class Recording(step_probe.GoldReader):
        def __call__(self, input_ids, scores):
            readers.append(self) if self.t == 0 else None
            self.seen = input_ids.clone()
            return super().__call__(input_ids, scores)

    monkeypatch.setattr(step_probe, "GoldReader", Recording)
    probe = StepProbe(ctx, tok, rows)
    rewards = torch.tensor([[1.0], [0.0], [0.0], [1.0]])
    groups = group_batch(cfg, [types.SimpleNamespace(weight=1.0, name="r")], rewards, rollout)
    counts = {"nfe_nograd": 0}
    fed = probe.inputs(groups, rollout, {}, counts)
    assert counts["nfe_nograd"] == 8 * N and len(readers) == 1  # 8 probes x N continuations, one block
    reader = readers[0]
    m64 = build_tiny_model(cfg.model.tiny, len(tok), tok.eos_token_id)
    m64.load_state_dict(model.state_dict())
    m64 = m64.double().eval()
    enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    suffix, dot, eos = enc("**Final Answer**\n\\boxed{"), enc(".")[0], tok.eos_token_id
    ends = [[j for j, t in enumerate(c) if t == dot] or [len(c) - 1] for c in completions]
    probe_rows = [(n, end) for n, e in enumerate(ends) for end in e]
    width = reader.seen.shape[1] - reader.t + 1  # the probe prompts' padded width
    phi, hits, positions = [], 0, 0
    for i, (n, end) in enumerate(probe_rows):
        prefix = prompts[n // 2] + completions[n][: end + 1] + suffix
        gold = enc(rows[n // 2]["answer"])
        acc = conf = 0.0
        for s in range(N):
            r = i * N + s
            sampled = reader.seen[r, width:].tolist()
            lp = H = 0.0
            count = 0
            for t in range(len(gold)):
                if eos in sampled[:t] or t >= reader.t:
                    break
                with torch.no_grad():
                    logits = m64(input_ids=torch.tensor([prefix + sampled[:t]])).logits[0, -1]
                logp = torch.log_softmax(logits, -1)
                top = logp.topk(20)
                hit = gold[t] in top.indices.tolist()
                value, h = float(logp[gold[t]]) if hit else -10.0, float(-(top.values.exp() * top.values).sum())
                assert bool(reader.valid[r, t]), (r, t)
                assert float(reader.lp[r, t]) == pytest.approx(value, abs=1e-6)
                assert float(reader.entropy[r, t]) == pytest.approx(h, abs=1e-6)
                lp, H, count, hits = lp + value, H + h, count + 1, hits + hit
                positions += 1
            if count:
                acc += math.exp(lp) / count
                conf += math.exp(-H) / count
            assert int(reader.valid[r].sum()) == count
        acc, conf = acc / N, conf / N
        phi.append(1.5 * acc * conf + 0.5 * acc - conf)
    got = fed.step_rewards.reshape(4, -1)[fed.step_mask.reshape(4, -1)]
    assert got.tolist() == pytest.approx(phi, abs=1e-5)
    assert 0 < hits < positions  # both paths ran: a gold token in the top 20, and one outside (-10)


@pytest.mark.heavy
def test_spae_recipe_learns_far_above_lr0(tiny_config):
    """Recipe spae (boundary "a"), 15 steps, against the same run at lr 0. Measured (CPU, one thread, seed 1):
    last-5 reward 0.90 (lr 0: 0.005); by then every "a" is a step (~32 probes a completion), the potential 0.95.
    ~16 s."""
    common = ["recipe=spae", "advantage.estimator.boundary=a", "iterations=15", "checkpoint.every=0"]
    history = train_text(tiny_config(*common))
    control = train_text(tiny_config(*common, "optim.lr=0", name="lr0"))
    last = lambda h: statistics.mean(r["reward_mean"] for r in h[-5:])  # noqa: E731
    assert history[0]["reward_mean"] < 0.05 and last(history) - last(control) > 0.5, (last(history), last(control))
    assert history[-1]["spae/steps_mean"] > 10 and history[-1]["spae/potential_mean"] > 0.5
    assert history[-1]["spae/saturated_frac"] > 0.5 and control[-1]["spae/steps_mean"] < 2
    assert history[-1]["nfe_nograd"] >= 16 * history[-1]["spae/steps_mean"]  # the probes are counted
    assert all(r["check/first_pass_ratio_dev"] <= 1e-5 for r in history)
