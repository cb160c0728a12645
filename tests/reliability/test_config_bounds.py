"""Every number in every config is validated at load, before any folder or model, and a config file is plain YAML.

Issue 30: a duplicated `optim:` block silently replaced the first (a run trained at another learning rate than the
file said); `optim.betas` outside [0, 1), a negative `optim.eps`, `plan.size` 0 and a window longer than the chain
passed validation and failed (or trained nothing) after the run folder and the models existed. The tables below are
read from the configs themselves (every constrained pydantic field, every bounded registry setting), so a bound
added later is tested too; the explicit lists name what the issue found unbounded.
"""

from __future__ import annotations

import inspect
import math
import typing
from pathlib import Path
from typing import Any, Iterator

import annotated_types as at
import pytest
from pydantic import BaseModel

from flowgrpo.config import MAX_CONFIG_BYTES, ConfigError, parse_yaml
from flowgrpo.core.config import SETTING_BOUNDS, Bound
from flowgrpo.evaluation.config import EvalConfig, load_eval_config
from flowgrpo.t2i.config import T2IConfig, load_t2i_config
from flowgrpo.text.config import TextConfig, load_text_config

from .cli_helpers import ROOT, run_cli

T2I_TINY = ROOT / "configs/t2i/tiny/flow_grpo.yaml"
TEXT_TINY = ROOT / "configs/text/tiny_pattern.yaml"


def _error(load, *overrides: str) -> str:
    with pytest.raises(ConfigError) as err:
        load(*overrides)
    return str(err.value)


def _t2i(*overrides: str) -> T2IConfig:
    return load_t2i_config(T2I_TINY, overrides)


def _text(*overrides: str) -> TextConfig:
    return load_text_config(TEXT_TINY, overrides)


EVAL_BASE = ["input.generate={model: sd3, tiny: true, prompts: prompts.txt}", "scorers=[brightness]"]


def _eval(*overrides: str) -> EvalConfig:
    return load_eval_config(None, [*EVAL_BASE, *overrides])


# --------------------------------------------------------------------------------------------- plain YAML only


def _write(tmp_path: Path, text: str, name: str = "run.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_a_duplicate_key_names_the_key_both_lines_and_the_file(tmp_path):
    path = _write(tmp_path, "iterations: 3\noptim: {lr: 1.0e-3}\nseed: 1\noptim:\n  lr: 0.1\n")
    with pytest.raises(ConfigError) as err:
        load_t2i_config(path)
    text = str(err.value)
    assert len(text.splitlines()) == 1, text
    assert "duplicate key 'optim'" in text and "line 4" in text and "first at line 2" in text and str(path) in text


def test_a_duplicate_key_inside_a_section_or_a_flow_mapping(tmp_path):
    nested = _write(tmp_path, "optim:\n  lr: 1.0e-3\n  eps: 1.0e-8\n  lr: 0.1\n")
    text = _error(lambda: load_t2i_config(nested))
    assert "duplicate key 'lr' at line 4 (first at line 2)" in text and str(nested) in text
    flow = _write(tmp_path, "sampler: {num_steps: 4, height: 32, num_steps: 8}\n", "flow.yaml")
    assert "duplicate key 'num_steps' at line 1" in _error(lambda: load_t2i_config(flow))


def test_a_duplicate_key_in_an_override_value():
    text = _error(_t2i, "optim={lr: 1.0e-3, lr: 0.1}")
    assert len(text.splitlines()) == 1 and "override 'optim=" in text and "duplicate key 'lr'" in text


def test_a_duplicate_key_stops_the_cli_in_one_line_before_any_folder(tmp_path):
    path = _write(tmp_path, f"base: {T2I_TINY}\noptim: {{lr: 1.0e-3}}\niterations: 1\noptim: {{lr: 0.1}}\n")
    out = tmp_path / "out"
    done = run_cli("train-t2i", str(path), f"output_dir={out}", cwd=tmp_path)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-2000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("flowgrpo:")]
    assert len(errors) == 1 and "duplicate key 'optim' at line 4 (first at line 2)" in errors[0], done.stderr
    assert str(path) in errors[0]
    assert not out.exists()


@pytest.mark.parametrize(
    "text, why",
    [
        ("a: &lr {lr: 1}\noptim: *lr\n", "anchor '&lr' at line 1"),
        ("optim: *lr\n", "alias '*lr' at line 1"),
        ("optim:\n  <<: {lr: 1}\n", "merge key '<<' at line 2"),
        ("seed: !!int 3\n", "tag 'tag:yaml.org,2002:int' at line 1"),
        ("seed: !custom 3\n", "tag '!custom' at line 1"),
        ("seed: !!python/object/apply:os.system [echo hi]\n", "tag 'tag:yaml.org,2002:python/object/apply:os.system'"),
        ("seed: " + "[" * 5000 + "]" * 5000 + "\n", "nesting deeper than 64 levels"),
    ],
)
def test_yaml_beyond_plain_values_is_refused_in_one_line(tmp_path, text, why):
    path = _write(tmp_path, text)
    message = _error(lambda: load_t2i_config(path))
    assert len(message.splitlines()) == 1 and why in message and str(path) in message, message


def test_billion_laughs_is_refused_at_once(tmp_path):
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 12)]  # 10**12 strings
    path = _write(tmp_path, "\n".join(lines) + "\n")
    assert "anchors and aliases are not supported" in _error(lambda: load_t2i_config(path))


def test_a_config_file_over_the_size_bound_is_refused_before_it_is_read(tmp_path):
    path = tmp_path / "huge.yaml"
    with path.open("w") as f:
        f.write("seed: 1\n")
        f.write(("# " + "x" * 1022 + "\n") * (MAX_CONFIG_BYTES // 1024 + 1))
    message = _error(lambda: load_t2i_config(path))
    assert len(message.splitlines()) == 1 and "a config file is at most 4 MiB" in message and str(path) in message
    assert "at most 4 MiB" in _error(_t2i, "data.prompts=[" + "a," * (MAX_CONFIG_BYTES // 2) + "]")


def test_plain_yaml_keeps_working():
    text = """
# a comment
seed: 1
optim:
  lr: 1e-4            # a float, not a string
  betas: [0.9, 0.99]  # flow list
sampler: {num_steps: 4, schedule: {name: time_shift, shift: 3}}
data:
  prompts:
    - a cat
    - "a dog: quoted"
    - 'single'
text: |
  a block
  scalar
same: {a: 1}
other: {a: 2}
empty:
"""
    assert parse_yaml(text) == {
        "seed": 1,
        "optim": {"lr": 1e-4, "betas": [0.9, 0.99]},
        "sampler": {"num_steps": 4, "schedule": {"name": "time_shift", "shift": 3}},
        "data": {"prompts": ["a cat", "a dog: quoted", "single"]},
        "text": "a block\nscalar\n",
        "same": {"a": 1},
        "other": {"a": 2},
        "empty": None,
    }


def test_a_base_file_is_not_a_duplicate(tmp_path):
    _write(tmp_path, "optim: {lr: 1.0e-3}\nseed: 3\n", "base.yaml")
    child = _write(tmp_path, "base: base.yaml\noptim: {lr: 0.1}\n", "child.yaml")
    cfg = load_t2i_config(child)
    assert cfg.optim.lr == 0.1 and cfg.seed == 3


# ------------------------------------------------------------------------------- what the issue found unbounded


@pytest.mark.parametrize(
    "load, override, key",
    [
        (_t2i, "optim.betas=[0.9, 1.0]", "optim.betas.1"),
        (_t2i, "optim.betas=[-0.1, 0.999]", "optim.betas.0"),
        (_text, "optim.betas=[1.5, 0.999]", "optim.betas.0"),
        (_t2i, "optim.eps=-1.0e-8", "optim.eps"),
        (_t2i, "optim.eps=0", "optim.eps"),
        (_t2i, "optim.weight_decay=-0.1", "optim.weight_decay"),
        (_t2i, "optim.max_grad_norm=0", "optim.max_grad_norm"),
        (_t2i, "optim.lr=.nan", "optim.lr"),
        (_t2i, "optim.lr=.inf", "optim.lr"),
        (_t2i, "plan={name: window, size: 0}", "plan.size"),
        (_t2i, "plan={name: window, size: -1}", "plan.size"),
        (_t2i, "plan={name: window, size: 2, schedule: sliding}", "plan.schedule"),
        (_t2i, "plan={name: full_sde, train_fraction: 0}", "plan.train_fraction"),
        (_t2i, "plan={name: tree, split_steps: [0, 2], branch: 1}", "plan.branch"),
        (_t2i, "ratio_check.tolerance=0", "ratio_check.tolerance"),
        (_t2i, "loss.kl.coef=-0.01", "loss.kl.coef"),
        (_t2i, "loss.log_ratio_clamp=0", "loss.log_ratio_clamp"),
        (_t2i, "loss.bounds={name: symmetric, eps: -0.1}", "loss.bounds.eps"),
        (_t2i, "advantage.estimator={name: grpo, eps: -1.0e-4}", "advantage.estimator.eps"),
        (_t2i, "advantage.estimator={name: mc_grpo, mad_floor: 0}", "advantage.estimator.mad_floor"),
        (_t2i, "advantage.estimator={name: grpo, std_scope: groups}", "advantage.estimator.std_scope"),
        (_t2i, "advantage.estimator={name: grpo, unbiased: 'no'}", "advantage.estimator.unbiased"),
        (_t2i, "advantage.transforms=[{name: clip, max: -5}]", "advantage.transforms.0.max"),
        (_t2i, "sampler.sde_kernel={name: flow_sde, a: -0.7}", "sampler.sde_kernel.a"),
        (_t2i, "sampler.schedule={name: time_shift, shift: 0}", "sampler.schedule.shift"),
        (_t2i, "sampler.shift=-3", "sampler.shift"),
        (_t2i, "sampler.guidance_scale=-1", "sampler.guidance_scale"),
        (_t2i, "edges.width_pruning=1.5", "edges.width_pruning"),
        (_t2i, "nft.kl_coef=-1", "nft.kl_coef"),
        (_t2i, "adversarial.betas=[0.5, 1.0]", "adversarial.betas.1"),
        (_t2i, "eval.num_steps=0", "eval.num_steps"),
        (_t2i, "model.lora.alpha=0", "model.lora.alpha"),
        (_t2i, "num_threads=0", "num_threads"),
        (_t2i, "seed=-1", "seed"),
        (_t2i, "rewards=[{name: brightness, weight: .nan}]", "rewards.0.weight"),
        (_text, "generation.min_p=1.5", "generation.min_p"),
        (_text, "generation.repetition_penalty=0", "generation.repetition_penalty"),
        (_text, "model.lora.alpha=0", "model.lora.alpha"),
        (_text, "model.tiny.num_heads=0", "model.tiny.num_heads"),
        (_text, "data.max_rows=0", "data.max_rows"),
        (_text, "dynamic_sampling.min_std=-1", "dynamic_sampling.min_std"),
        (_text, "train.logprob_batch_size=0", "train.logprob_batch_size"),
        (_eval, "input.generate.guidance_scale=-1", "input.generate.guidance_scale"),
        (_eval, "stats.seed=-1", "stats.seed"),
    ],
)
def test_the_issue_s_unbounded_settings_fail_at_load_naming_the_key(load, override, key):
    text = _error(load, override)
    lines = [line for line in text.splitlines() if line.strip().startswith(key + ":")]
    assert len(lines) == 1, text


@pytest.mark.parametrize(
    "load, overrides, key, why",
    [
        (_t2i, ["plan={name: window, size: 9}"], "plan", "does not fit before step 6"),
        (_t2i, ["plan={name: window, size: 2, range_end: 9}"], "plan", "range_end 9 lies past the chain's 6"),
        (_t2i, ["plan=ode_only"], "plan", "trains none of the 6 steps"),
        (_t2i, ["plan={name: window, size: 2, schedule: decay, min_iters: 5, max_iters: 2}"], "plan", "min_iters"),
        (_t2i, ["plan={name: probes, window_end: 9}", "advantage.estimator=turning_point"], "plan", "window (0, 9)"),
        (
            _t2i,
            ["plan={name: tree, split_steps: [0, 2]}", "advantage.estimator=tree_depth", "edges.depth_pruning=[7]"],
            "edges.depth_pruning",
            "[1, 6]",
        ),
        (_text, ["model.tiny.num_heads=3"], "model.tiny", "must divide hidden_size"),
    ],
)
def test_settings_that_depend_on_each_other_fail_at_load(load, overrides, key, why):
    text = _error(load, *overrides)
    assert any(line.strip().startswith(key + ":") and why in line for line in text.splitlines()), text


def test_the_issue_s_settings_stop_the_cli_before_any_folder(tmp_path):
    for bad in ("plan={name: window, size: 0}", "plan={name: window, size: 9}", "optim.betas=[0.9, 1.0]"):
        out = tmp_path / "out"
        done = run_cli("train-t2i", str(T2I_TINY), f"output_dir={out}", bad, cwd=tmp_path)
        assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-2000:]
        assert ("plan" if bad.startswith("plan") else "optim.betas.1") in done.stderr
        assert not out.exists()


# ------------------------------------------------------------ the table: every constrained field and setting


def _nested_models(annotation: Any) -> list[type[BaseModel]]:
    """The BaseModel classes a field holds directly (itself, or Optional of it; not lists: an override cannot
    index one, and `rewards.0.weight` is in the explicit list)."""
    if typing.get_origin(annotation) in (list, tuple, dict):
        return []
    args = typing.get_args(annotation) or (annotation,)
    return [a for a in args if isinstance(a, type) and issubclass(a, BaseModel)]


def _fields(model: type[BaseModel], prefix: str = "", seen: frozenset = frozenset()) -> Iterator[tuple[str, Any]]:
    for name, field in model.model_fields.items():
        key = f"{prefix}{name}"
        yield key, field
        for sub in _nested_models(field.annotation):
            if sub not in seen:
                yield from _fields(sub, key + ".", seen | {model})


def _bad_numbers(metadata: list[Any], integer: bool) -> list[Any]:
    step = 1 if integer else 0.5
    out: list[Any] = []
    for m in metadata:
        if isinstance(m, at.Ge):
            out.append(m.ge - step)
        elif isinstance(m, at.Gt):
            out.append(m.gt)
        elif isinstance(m, at.Le):
            out.append(m.le + step)
        elif isinstance(m, at.Lt):
            out.append(m.lt)
    return out


def _yaml(value: Any) -> str:
    if isinstance(value, float) and math.isnan(value):
        return ".nan"
    return repr(value) if not isinstance(value, str) else f"'{value}'"


def _is_float(annotation: Any) -> bool:
    return annotation is float or (
        typing.get_origin(annotation) is typing.Union and float in typing.get_args(annotation)
    )


def _is_int(annotation: Any) -> bool:
    return annotation is int or (typing.get_origin(annotation) is typing.Union and int in typing.get_args(annotation))


LOADERS = [(_t2i, T2IConfig), (_text, TextConfig), (_eval, EvalConfig)]


def _constrained_cases() -> list[tuple[Any, str, Any]]:
    cases = []
    for load, root in LOADERS:
        for key, field in _fields(root):
            if key.startswith("baseline."):  # the same InputConfig as `input`
                continue
            for bad in _bad_numbers(field.metadata, _is_int(field.annotation)):
                cases.append((load, key, bad))
    return cases


CONSTRAINED = _constrained_cases()


def test_the_table_covers_the_configs():
    keys = {key for _, key, _ in CONSTRAINED}
    assert len(keys) >= 70, sorted(keys)
    for key in ("optim.eps", "optim.weight_decay", "ratio_check.tolerance", "loss.kl.coef", "sampler.shift",
                "eval.num_steps", "generation.min_p", "stats.seed", "input.generate.guidance_scale"):  # fmt: skip
        assert key in keys, key


@pytest.mark.parametrize("load, key, bad", CONSTRAINED, ids=[f"{k}={b}" for _, k, b in CONSTRAINED])
def test_every_constrained_field_refuses_a_value_outside_naming_the_key(load, key, bad):
    text = _error(load, f"{key}={_yaml(bad)}")
    assert any(line.strip().startswith(key + ":") for line in text.splitlines()), text


FLOATS = [(load, key) for load, root in LOADERS for key, f in _fields(root) if _is_float(f.annotation)]


@pytest.mark.parametrize("load, key", FLOATS, ids=[k for _, k in FLOATS])
def test_every_float_field_refuses_nan_and_inf(load, key):
    for bad in (".nan", "-.inf"):
        text = _error(load, f"{key}={bad}")
        assert any(line.strip().startswith(key + ":") for line in text.splitlines()), text


# registry kind -> (override of the part, key prefix in the error)
PART_KEYS = {
    "advantage estimator": ("advantage.estimator", "advantage.estimator"),
    "advantage transform": ("advantage.transforms", "advantage.transforms.0"),
    "bounds": ("loss.bounds", "loss.bounds"),
    "surrogate": ("loss.surrogate", "loss.surrogate"),
    "aggregation": ("loss.aggregation", "loss.aggregation"),
    "step weighting": ("loss.step_weighting", "loss.step_weighting"),
    "kernel": ("sampler.sde_kernel", "sampler.sde_kernel"),
    "sigma grid": ("sampler.schedule", "sampler.schedule"),
    "rollout plan": ("plan", "plan"),
    "regularizer": ("loss.regularizer", "loss.regularizer"),
    "prompt sampler": ("prompt_sampling", "prompt_sampling"),  # the text trainer's (TEXT_ONLY)
}
TEXT_ONLY = {"prompt sampler"}


def _bad_settings(bound: Bound) -> list[Any]:
    if bound.choices:
        return ["not_a_choice", 3]
    out: list[Any] = [float("nan"), True, "1"]
    if bound.integer:
        out.append(2.5)
    if bound.low is not None:
        out.append(bound.low if bound.low_open else bound.low - (1 if bound.integer else 0.5))
    if bound.high is not None:
        out.append(bound.high if bound.high_open else bound.high + 1)
    return out


SETTINGS = [
    (kind, name, setting, bad)
    for kind, entries in sorted(SETTING_BOUNDS.items())
    for name, bounds in sorted(entries.items())
    for setting, bound in sorted(bounds.items())
    for bad in _bad_settings(bound)
]


def test_every_bounded_registry_kind_is_configurable_here():
    assert set(SETTING_BOUNDS) <= set(PART_KEYS), set(SETTING_BOUNDS) - set(PART_KEYS)
    assert len({(k, n, s) for k, n, s, _ in SETTINGS}) >= 50


@pytest.mark.parametrize("kind, name, setting, bad", SETTINGS, ids=[f"{n}.{s}={b!r}" for _, n, s, b in SETTINGS])
def test_every_bounded_setting_refuses_a_value_outside_naming_the_key(kind, name, setting, bad):
    part, key = PART_KEYS[kind]
    value = f"{{name: {name}, {setting}: {_yaml(bad)}}}"
    load = _text if kind in TEXT_ONLY else _t2i
    text = _error(load, f"{part}=[{value}]" if kind == "advantage transform" else f"{part}={value}")
    lines = [line for line in text.splitlines() if line.strip().startswith(f"{key}.{setting}:")]
    assert len(lines) == 1 and "must be" in lines[0] and f"'{name}'" in lines[0], text


def _registry(kind: str) -> Any:
    from flowgrpo.core import AGGREGATIONS, BOUNDS, ESTIMATORS, REGULARIZERS, STEP_WEIGHTINGS, SURROGATES
    from flowgrpo.core.prompt_state import PROMPT_SAMPLERS
    from flowgrpo.core.transforms import TRANSFORMS
    from pipelines.plans import PLANS
    from pipelines.schedules import SIGMA_GRIDS
    from pipelines.steps import KERNELS

    regs = [ESTIMATORS, TRANSFORMS, BOUNDS, SURROGATES, AGGREGATIONS, REGULARIZERS, PROMPT_SAMPLERS, KERNELS]
    regs += [SIGMA_GRIDS, PLANS, STEP_WEIGHTINGS]
    return next(r for r in regs if r.kind == kind)


def test_every_bounded_setting_s_default_passes():
    for kind, entries in SETTING_BOUNDS.items():
        registry = _registry(kind)
        for name, bounds in entries.items():
            defaults = registry.get(name).settings
            for setting, bound in bounds.items():
                default = defaults[setting]
                assert default is inspect.Parameter.empty or default is None or bound.allows(default), (
                    kind, name, setting, default
                )  # fmt: skip


def test_defaults_and_every_shipped_config_pass():
    T2IConfig()
    TextConfig()
    for path in sorted((ROOT / "configs/t2i").rglob("*.yaml")):
        if not path.name.startswith("_"):
            load_t2i_config(path)
    for path in sorted((ROOT / "configs/text").rglob("*.yaml")):
        load_text_config(path)
    _eval()
