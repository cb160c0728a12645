"""Reward functions: math verification, format / length / overlong / toy rewards, the TRL contract,
None and NaN handling, failures, and bad input found at load time."""

import json
import logging
import math

import pytest
import torch

from flowgrpo.core import AdvantageConfig, GroupBatch, compute_advantages
from flowgrpo.text import DataError, RewardError, train_text
from flowgrpo.text.answers import answers_match, extract_answer, reference_answer
from flowgrpo.text.config import RewardSpec
from flowgrpo.text.reward_functions import REWARDS, build_rewards, score_completions


# --- math verification --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "completion, reference",
    [
        ("The answer is \\boxed{42}.", "42"),
        ("First 3 apples, then 5 more: 8", "8"),  # last number
        ("\\boxed{2} no wait, \\boxed{3}", "3"),  # last box
        ("\\boxed{\\frac{1}{2}}", "0.5"),  # fraction == decimal
        ("\\boxed{\\dfrac{3}{4}}", "0.75"),
        ("\\boxed{\\frac12}", "1/2"),
        ("so it is 1/2", "0.50"),
        ("it is .5", "\\frac{1}{2}"),
        ("3.0", "3"),
        ("we get 1,000 apples", "1000"),  # thousands separator
        ("\\boxed{50\\%}", "0.5"),  # percent
        ("\\boxed{x = -7}", "-7"),
        ("\\boxed{{2}}", "2"),
        ("\\boxed{1e3}", "1000"),
        ("\\boxed{\\text{Paris}}", "paris"),  # non-numeric: normalised text
        ("The total is 18.", "Natalia sold 48/2 = 24 clips.\n#### 18"),  # GSM8K-style reference
        ("\\boxed{\\frac{7}{2}}", "\\boxed{3.5}"),  # boxed reference
    ],
)
def test_math_answers_that_match(completion, reference):
    assert answers_match(extract_answer(completion), reference_answer(reference))


@pytest.mark.parametrize(
    "completion, reference",
    [
        ("\\boxed{\\frac{1}{3}}", "0.333"),  # close is not equal
        ("no number at all", "3"),
        ("\\boxed{41}", "42"),
        ("the answer is 8, not 7", "8"),  # the LAST number counts
        ("\\boxed{2/0}", "2"),
    ],
)
def test_math_answers_that_do_not_match(completion, reference):
    assert not answers_match(extract_answer(completion), reference_answer(reference))


def test_extract_modes():
    text = "\\boxed{4} and then 5"
    assert extract_answer(text) == "4"
    assert extract_answer(text, "last_number") == "5"
    assert extract_answer("just 5", "boxed") is None
    with pytest.raises(ValueError, match="extract mode"):
        extract_answer(text, "first")


def _build(*specs, **context):
    return build_rewards(
        [RewardSpec.model_validate(s) for s in specs], context={"max_tokens": 10, "eos_token_ids": [0], **context}
    )


def _call(reward, completions, ids=None, **columns):
    return reward.fn(
        prompts=["p"] * len(completions),
        completions=completions,
        completion_ids=ids or [[1]] * len(completions),
        trainer_state={},
        **columns,
    )


def test_math_answer_reward_reads_the_answer_column_and_none():
    (r,) = _build("math_answer")
    assert r.columns == ("answer",)
    assert _call(r, ["\\boxed{4}", "5", "x"], answer=["4", "4", None]) == [1.0, 0.0, None]
    (r2,) = _build({"name": "math_answer", "column": "solution", "correct": 2.0})
    assert r2.columns == ("solution",) and _call(r2, ["7"], solution=["#### 7"]) == [2.0]


def test_math_answer_conversational_completion():
    (r,) = _build("math_answer")
    assert _call(r, [[{"role": "assistant", "content": "\\boxed{9}"}]], answer=["9"]) == [1.0]


def test_format_regex():
    (r,) = _build({"name": "format_regex", "pattern": r"^<think>.*</think>", "mode": "match"})
    assert _call(r, ["<think>a\nb</think> 4", "4 <think></think>"]) == [1.0, 0.0]
    (d,) = _build("format_regex")  # default: a \boxed{} answer somewhere
    assert _call(d, ["so \\boxed{3}", "3"]) == [1.0, 0.0]


def test_length_penalty_and_overlong():
    (lp,) = _build({"name": "length_penalty", "free_tokens": 2, "coef": 0.5})
    assert _call(lp, ["a"] * 3, ids=[[1], [1] * 2, [1] * 10]) == [0.0, 0.0, -0.5]
    (ol,) = _build({"name": "overlong", "buffer": 4})  # L_max 10 from the run, buffer 4: flat up to 6
    got = _call(ol, ["a"] * 5, ids=[[1] * n for n in (3, 6, 8, 10, 12)])
    assert got == [0.0, 0.0, pytest.approx(-0.5), pytest.approx(-1.0), -1.0]
    with pytest.raises(ValueError, match="buffer"):
        _build({"name": "overlong", "buffer": 11})


def test_target_pattern_counts_tokens_not_eos():
    (r,) = _build("target_pattern")
    assert r.columns == ("target",)
    # 3 of 4 tokens are "a" (the final eos id 0 does not count); empty completion scores 0
    assert _call(r, ["aaab", "", "xx"], ids=[[97, 97, 97, 98, 0], [0], [1, 2]], target=["a", "a", None]) == [
        0.75,
        0.0,
        None,
    ]
    (c,) = _build({"name": "target_pattern", "pattern": "ab", "per": "char"})
    assert c.columns == () and _call(c, ["abab", "xabx"]) == [1.0, 0.5]


def test_unknown_reward_and_bad_setting_are_named():
    with pytest.raises(Exception, match="valid names"):
        _build("math_answr")
    with pytest.raises(ValueError, match="has no setting 'colum'"):
        _build({"name": "math_answer", "colum": "x"})


# --- scoring: None, NaN, failures ----------------------------------------------------------------


def _score(rewards, n=4, stop=False, **columns):
    return score_completions(
        rewards,
        prompts=["p"] * n,
        completions=["c"] * n,
        completion_ids=[[1]] * n,
        columns=columns,
        trainer_state={"global_step": 0},
        stop_on_error=stop,
    )


def test_trl_signature_gets_columns_and_none_becomes_nan():
    seen = {}

    def partial_reward(prompts, completions, completion_ids, level, **kwargs):
        seen.update(kwargs, level=level)
        return [1.0 if lv == "easy" else None for lv in level]

    rewards = build_rewards([RewardSpec(name="mine", columns=["level"])], extra={"mine": partial_reward})
    assert rewards[0].columns == ("level",)
    s = _score(rewards, level=["easy", "hard", "easy", "hard"])
    assert s.none_counts == [2] and s.error_counts == [0]
    assert s.values[:, 0].tolist()[0] == 1.0 and math.isnan(s.values[1, 0])
    assert seen["trainer_state"] == {"global_step": 0} and seen["level"][0] == "easy"


def test_raising_reward_marks_nan_and_is_counted(caplog):
    def broken(prompts, completions, **kw):
        raise ZeroDivisionError("boom")

    rewards = build_rewards(
        [RewardSpec(name="broken"), RewardSpec(name="ok")],
        extra={"broken": broken, "ok": lambda prompts, completions, **kw: [0.5] * len(prompts)},
    )
    with caplog.at_level(logging.WARNING):
        s = _score(rewards)
    assert "reward function 'broken' failed: ZeroDivisionError: boom" in caplog.text
    assert s.error_counts == [4, 0] and torch.isnan(s.values[:, 0]).all() and (s.values[:, 1] == 0.5).all()
    with pytest.raises(RewardError, match="'broken' failed.*stop_on_reward_error"):
        _score(rewards, stop=True)


@pytest.mark.parametrize(
    "bad, why", [(lambda p, c, **k: [1.0], "returned 1 values for 4"), (lambda p, c, **k: ["x"] * 4, "returned str")]
)
def test_contract_violations_are_failures(bad, why):
    rewards = build_rewards(
        [RewardSpec(name="bad")], extra={"bad": lambda prompts, completions, **kw: bad(prompts, completions)}
    )
    assert _score(rewards).error_counts == [4]
    with pytest.raises(RewardError, match=why):
        _score(rewards, stop=True)


def test_nan_heads_with_ignore_head_and_gdpo():
    """None in one head leaves that head out of the sum (TRL); a fully unscored sample gets advantage 0."""
    nan = math.nan
    r = torch.tensor([[[1.0, nan], [0.0, 1.0], [nan, nan], [1.0, 0.0]]])  # [P=1, G=4, K=2]
    batch = GroupBatch(rewards=r, head_nan_policy="ignore_head")
    assert torch.allclose(batch.scalar_rewards()[0, [0, 1, 3]], torch.tensor([1.0, 1.0, 1.0]))
    adv = compute_advantages(batch, AdvantageConfig(estimator="gdpo", head_nan_policy="ignore_head"))
    assert adv.advantages[0, 2] == 0 and adv.metrics["rewards/nan_count"] == 1


def test_user_function_from_a_file(tmp_path):
    f = tmp_path / "my_rewards.py"
    f.write_text(
        "def short(prompts, completions, scale=1.0, **kw):\n    return [scale / (1 + len(c)) for c in completions]\n"
    )
    (r,) = build_rewards([RewardSpec.model_validate({"name": f"{f}:short", "scale": 2.0})])
    assert r.name == "short" and _call(r, ["a", "abc"]) == [1.0, 0.5]
    with pytest.raises(ValueError, match="no callable 'nope'"):
        build_rewards([RewardSpec(name=f"{f}:nope")])


def test_registry_lists_builtins():
    assert {"math_answer", "format_regex", "length_penalty", "overlong", "target_pattern"} <= set(REWARDS.names())


# --- in the trainer ------------------------------------------------------------------------------


def test_trainer_counts_failed_rewards_and_keeps_training(tiny_config):
    def flaky(prompts, completions, trainer_state, **kw):
        if trainer_state["global_step"] == 0:
            raise RuntimeError("service down")
        return [None if i % 2 else 0.0 for i in range(len(prompts))]

    cfg = tiny_config("iterations=2", "checkpoint.every=0", "rewards=[{name: target_pattern}, {name: flaky}]")
    history = train_text(cfg, reward_funcs={"flaky": flaky})
    assert history[0]["rewards/flaky/error_count"] == 16 and history[0]["rewards/flaky/none_count"] == 0
    assert history[1]["rewards/flaky/error_count"] == 0 and history[1]["rewards/flaky/none_count"] == 8
    assert history[0]["rewards/nan_count"] == 0  # ignore_head: target_pattern still scores every sample
    assert math.isfinite(history[1]["rewards/target_pattern/mean"])
    with pytest.raises(RewardError, match="'flaky' failed"):
        train_text(
            tiny_config(
                "iterations=1",
                "stop_on_reward_error=true",
                "rewards=[{name: target_pattern}, {name: flaky}]",
                name="stop",
            ),
            reward_funcs={"flaky": flaky},
        )


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_missing_column_names_the_row_and_column(tiny_config, tmp_path):
    data = _jsonl(
        tmp_path / "d.jsonl", [{"prompt": "1+1?", "answer": "2"}, {"prompt": "2+2?", "answer": "4"}, {"prompt": "3+3?"}]
    )
    cfg = tiny_config(f"data.path={data}", "data.task=null", "rewards=[math_answer]")
    with pytest.raises(
        DataError,
        match=r"data row 2 \(.*d.jsonl line 3\) has no column 'answer', "
        r"which reward 'math_answer' needs",
    ):
        train_text(cfg)


def test_missing_prompt_field_names_the_row(tiny_config, tmp_path):
    data = _jsonl(tmp_path / "d.jsonl", [{"prompt": "a"}, {"question": "b"}])
    with pytest.raises(DataError, match="data row 1 .* has no prompt field 'prompt'"):
        train_text(tiny_config(f"data.path={data}", "data.task=null", "rewards=[{name: target_pattern, pattern: a}]"))


def test_too_long_prompt_names_the_row(tiny_config, tmp_path):
    data = _jsonl(tmp_path / "d.jsonl", [{"prompt": "short"}, {"prompt": "x" * 240}])  # 240 + 32 > 256
    with pytest.raises(
        DataError,
        match=r"data row 1 .*line 2\): the prompt has 240 tokens; with "
        r"generation.max_new_tokens=32 that exceeds the model context of 256",
    ):
        train_text(tiny_config(f"data.path={data}", "data.task=null", "rewards=[{name: target_pattern, pattern: a}]"))


# --- issue 30: custom reward functions (file resolution, tracebacks, misspelt settings) ---------------------


def test_a_failing_function_logs_its_first_traceback_once_then_counts(caplog):
    def broken(prompts, completions, **kw):
        return [1 / 0 for _ in completions]  # the failing line

    rewards = build_rewards([RewardSpec(name="broken")], extra={"broken": broken})
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            _score(rewards)
    assert caplog.text.count("Traceback (most recent call last)") == 1
    assert "return [1 / 0 for _ in completions]  # the failing line" in caplog.text
    assert "failure 2 of this function" in caplog.text and "failure 3 of this function" in caplog.text
    assert rewards[0].failures == 3


def test_misspelt_setting_suggests_the_entry_keys():
    with pytest.raises(ValueError, match=r"has no setting 'wieght' \(did you mean 'weight'\?\).*'alias', 'columns'"):
        _build({"name": "target_pattern", "wieght": 2.0})


def test_user_function_setting_it_cannot_take_is_named(tmp_path):
    (tmp_path / "fixed.py").write_text("def r(prompts, completions, completion_ids, scale=1.0):\n    return []\n")
    with pytest.raises(ValueError, match=r"has no setting 'scal' \(did you mean 'scale'\?\)"):
        _build({"name": f"{tmp_path / 'fixed.py'}:r", "scal": 2.0})
    (tmp_path / "open.py").write_text("def r(prompts, completions, **kw):\n    return []\n")
    assert _build({"name": f"{tmp_path / 'open.py'}:r", "anything": 1})  # **kwargs: any setting goes through


def test_relative_reward_file_resolves_beside_the_config_naming_it(tmp_path, monkeypatch):
    from flowgrpo.text.reward_imports import reward_files_relative_to, rewards_config_dir

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "a/base.yaml").write_text("rewards: [{name: 'f.py:r'}]\n")
    (tmp_path / "b/run.yaml").write_text("base: ../a/base.yaml\niterations: 2\n")
    (tmp_path / "b/own.yaml").write_text("base: ../a/base.yaml\nrewards: [target_pattern]\n")
    assert rewards_config_dir(tmp_path / "b/run.yaml") == tmp_path / "a"  # the base sets rewards
    assert rewards_config_dir(tmp_path / "b/own.yaml") == tmp_path / "b"  # its own list replaces the base's
    (tmp_path / "a/f.py").write_text("def r(prompts, completions, **kw):\n    return [0.25] * len(completions)\n")
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    try:
        reward_files_relative_to(tmp_path / "b/run.yaml")
        (fn,) = _build("f.py:r")
        assert _call(fn, ["x"]) == [0.25]
        (cwd / "g.py").write_text("def r(prompts, completions, **kw):\n    return [0.5] * len(completions)\n")
        (fn,) = _build("g.py:r")  # not beside the config: the working directory
        assert _call(fn, ["x"]) == [0.5]
        with pytest.raises(ValueError, match=r"file not found: h\.py; looked beside the config that names it \("):
            _build("h.py:r")
    finally:
        reward_files_relative_to(None)
