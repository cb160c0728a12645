"""Config loading, overrides, strict errors, and the `flowgrpo` command's core demo."""

import json
import subprocess
import sys

import pytest
import yaml

from flowgrpo.cli import main
from flowgrpo.config import ConfigError, apply_override, deep_merge, dump_config, load_config
from flowgrpo.core import LossConfig
from flowgrpo.demo import DEFAULTS, DemoConfig, run_demo
from flowgrpo.metrics import MetricsWriter, read_metrics


def test_overrides_parse_yaml_values_and_nest():
    data = {"loss": {"bounds": "symmetric"}}
    apply_override(data, "lr=1e-4")
    apply_override(data, "loss.bounds.eps=0.1")
    apply_override(data, "steps=[1, 2]")
    apply_override(data, "flag=true")
    assert data == {"lr": 1e-4, "loss": {"bounds": {"name": "symmetric", "eps": 0.1}}, "steps": [1, 2], "flag": True}


@pytest.mark.parametrize("bad", ["novalue", "a..b=1", "=3"])
def test_malformed_override_is_an_error(bad):
    with pytest.raises(ConfigError):
        apply_override({}, bad)


def test_override_into_a_value_is_an_error():
    with pytest.raises(ConfigError, match="is not a section"):
        apply_override({"lr": 1.0}, "lr.x=2")


def test_deep_merge_keeps_untouched_keys():
    assert deep_merge({"a": {"b": 1, "c": 2}}, {"a": {"b": 3}}) == {"a": {"b": 3, "c": 2}}


def test_unknown_key_names_itself_and_the_valid_ones(tmp_path):
    with pytest.raises(ConfigError) as err:
        load_config(DemoConfig, overrides=["iteratons=3"], defaults=DEFAULTS)
    msg = str(err.value)
    assert "iteratons" in msg and "did you mean 'iterations'" in msg and "group_size" in msg


def test_unknown_nested_name_lists_valid_names():
    with pytest.raises(ConfigError) as err:
        load_config(DemoConfig, overrides=["loss.preset=dapoo"], defaults=DEFAULTS)
    assert "dapo" in str(err.value) and "gspo" in str(err.value)


def test_missing_file_and_bad_top_level(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(DemoConfig, tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(DemoConfig, bad)


def test_file_then_overrides_and_round_trip(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"iterations": 3, "loss": {"bounds": {"eps_high": 0.5}}}))
    cfg = load_config(DemoConfig, path, ["group_size=4"], defaults=DEFAULTS)
    assert cfg.iterations == 3 and cfg.group_size == 4
    assert cfg.loss.preset == "dapo"  # the embedded default survives a partial file
    assert cfg.loss.bounds.settings == {"eps_low": 0.2, "eps_high": 0.5}
    dump_config(cfg, tmp_path / "resolved.yaml")
    again = load_config(DemoConfig, tmp_path / "resolved.yaml")
    assert again == cfg


def test_loss_part_settings_merge_with_preset_and_defaults():
    assert LossConfig(preset="dapo", bounds={"eps_high": 0.4}).bounds.settings == {"eps_low": 0.2, "eps_high": 0.4}
    assert LossConfig(bounds={"eps": 0.3}).bounds.name == "symmetric"
    assert LossConfig(preset="flow_grpo", kl={"coef": 0.1}).kl.estimator == "flow_grpo"


def test_metrics_writer_round_trip(tmp_path):
    with MetricsWriter(tmp_path / "m.jsonl") as w:
        w.write({"a": 1.0, "nan": float("nan"), "inf": float("inf")})
    assert read_metrics(tmp_path / "m.jsonl") == [{"a": 1.0, "nan": None, "inf": "inf"}]


def _demo(tmp_path, **over):
    cfg = load_config(
        DemoConfig,
        overrides=[f"{k}={v}" for k, v in over.items()] + [f"output_dir={tmp_path}", "progress=false"],
        defaults=DEFAULTS,
    )
    return run_demo(cfg)


def test_demo_learns_far_above_lr_zero(tmp_path):
    learned = _demo(tmp_path / "a", iterations=30)
    frozen = _demo(tmp_path / "b", iterations=30, lr=0)
    gain = sum(r["reward_mean"] for r in learned[-5:]) / 5 - sum(r["reward_mean"] for r in learned[:5]) / 5
    drift = sum(r["reward_mean"] for r in frozen[-5:]) / 5 - sum(r["reward_mean"] for r in frozen[:5]) / 5
    assert gain > 0.2 and abs(drift) < 0.05
    assert all(r["ratio_first_pass_max_dev"] < 1e-6 for r in learned)  # on-policy ratio is 1
    keys = set(learned[0])
    assert {"reward_mean", "reward_std", "approx_kl", "clip/frac", "ratio/mean", "zero_std_frac"} <= keys


@pytest.mark.parametrize("preset", ["grpo", "dr_grpo", "gspo", "sapo", "cispo"])
def test_demo_runs_every_text_preset(tmp_path, preset):
    history = _demo(tmp_path, iterations=15, **{"loss.preset": preset})
    assert history[-1]["reward_mean"] > history[0]["reward_mean"]


def test_cli_demo_and_list(tmp_path, capsys):
    assert main(["demo", "iterations=3", "progress=false", f"output_dir={tmp_path}"]) == 0
    assert "reward" in capsys.readouterr().out
    assert (tmp_path / "config.yaml").exists() and len(read_metrics(tmp_path / "metrics.jsonl")) == 3
    assert main(["demo", "nonsense=1"]) == 2
    assert "unknown key 'nonsense'" in capsys.readouterr().err
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    assert "turning_point" in out and "ratio_norm" in out and "dapo" in out


def test_import_flowgrpo_stays_light():
    code = (
        "import sys, flowgrpo, flowgrpo.core, flowgrpo.config; "
        "heavy = [m for m in ('diffusers', 'transformers', 'accelerate', 'peft') if m in sys.modules]; "
        "print(json.dumps(heavy))"
    )
    out = subprocess.run([sys.executable, "-c", "import json; " + code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == []
