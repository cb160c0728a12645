"""`flowgrpo list`: every registry with its entries' docs and settings, a section filter, and --json."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from flowgrpo import listing
from flowgrpo.cli import main

ROOT = Path(__file__).resolve().parents[1]

# one entry each section must show (a registry that lost its import would show nothing)
KNOWN = {
    "estimators": ["grpo", "rloo"],
    "transforms": ["clip"],
    "ratios": ["token", "sequence"],
    "bounds": ["symmetric", "asymmetric"],
    "surrogates": ["ppo_clip"],
    "aggregations": ["token_mean"],
    "kl_estimators": ["k3"],
    "step_weightings": ["inv_dt"],
    "regularizers": ["opmd", "asymre"],
    "presets": ["dapo", "flow_grpo"],
    "recipes": ["rec_one_side_nois", "canon"],
    "prompt_samplers": ["spo", "replay"],
    "kernels": ["flow_sde", "ode"],
    "plans": ["tree", "full_sde"],
    "sigma_grids": ["time_shift"],
    "methods": ["grpo", "nft"],
    "wrappers": ["adversarial"],
    "text_methods": ["grpo", "tppo"],
    "text_rewards": ["math_answer"],
    "scorers": ["brightness", "pickscore"],
    "families": ["sd3", "flux"],
}


def _list(capsys, *argv):
    code = main(["list", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def _entry_line(out, name):
    """The line that starts an entry (two spaces, its name, its doc)."""
    return next(line for line in out.splitlines() if re.match(rf"  {re.escape(name)}\s", line))


def test_the_table_covers_every_section_tested():
    assert set(listing.section_keys()) == set(KNOWN)


def test_every_section_prints_its_known_entries(capsys):
    code, out, err = _list(capsys)
    assert code == 0 and err == ""
    headers = [line for line in out.splitlines() if line and not line.startswith(" ")]
    assert len(headers) == len(KNOWN)
    for key, names in KNOWN.items():
        assert any(f"[{key}]" in h for h in headers), key
        block = out.split(f"[{key}]", 1)[1].split("\n\n", 1)[0]
        for name in names:
            assert re.search(rf"^  {re.escape(name)}\s", block, re.M), (key, name)


def test_settings_and_defaults_are_shown(capsys):
    code, out, _ = _list(capsys, "estimators", "kernels", "plans", "scorers", "families", "presets", "methods")
    assert code == 0
    assert "std_scope='group'" in out  # estimator grpo's keyword-only setting with its default
    assert "a=0.7" in out  # kernel flow_sde
    assert "split_steps=(0, 3, 6, 9)" in out  # plan tree
    assert "url=<required>" in out  # scorer remote: a setting without a default
    assert "embedded_guidance=3.5" in out  # family flux: its constructor's option
    assert "prompt_cache_size=256" in out  # ... and the base adapter's, through **kw
    assert "nft.beta=1.0" in out  # method nft: its config section
    # a preset shows the parts it sets, not only its name
    assert "bounds=asymmetric(eps_low=0.2, eps_high=0.28), aggregation='token_mean'" in _entry_line(out, "dapo")
    # docs: a registry entry's, and a family's (the adapter module's docstring)
    assert "Flow-GRPO SDE" in _entry_line(out, "flow_sde")
    assert "SD3" in _entry_line(out, "sd3")


def test_filter_prints_only_the_sections_asked_for(capsys):
    code, out, _ = _list(capsys, "kernels", "plans")
    assert code == 0
    headers = [line for line in out.splitlines() if line and not line.startswith(" ")]
    assert len(headers) == 2 and "[kernels]" in headers[0] and "[plans]" in headers[1]
    assert "flow_sde" in out and "tree" in out and "brightness" not in out
    code, out, _ = _list(capsys, "sigma-grids")  # a hyphen works too
    assert code == 0 and "time_shift" in out


def test_unknown_section_is_a_one_line_error(capsys):
    code, out, err = _list(capsys, "kernels", "kernal")
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1
    assert "unknown section 'kernal'" in err and "did you mean 'kernels'" in err
    for key in KNOWN:
        assert key in err


def test_json_output_parses(capsys):
    code, out, _ = _list(capsys, "--json", "estimators", "presets", "scorers", "families")
    assert code == 0
    data = json.loads(out)
    assert list(data) == ["estimators", "presets", "scorers", "families"]
    grpo = next(e for e in data["estimators"]["entries"] if e["name"] == "grpo")
    assert grpo["settings"]["std_scope"] == "group" and grpo["doc"] and grpo["required"] == []
    dapo = next(e for e in data["presets"]["entries"] if e["name"] == "dapo")
    assert dapo["settings"]["bounds"] == {"name": "asymmetric", "eps_low": 0.2, "eps_high": 0.28}
    remote = next(e for e in data["scorers"]["entries"] if e["name"] == "remote")
    assert "url" in remote["required"] and remote["settings"]["retry_statuses"] == [429, 500, 502, 503, 504]
    assert {e["name"] for e in data["families"]["entries"]} >= {"sd3", "flux"}
    assert data["scorers"]["source"] == "reward_models.registry"


def test_python_m_flowgrpo_cli_list():
    out = subprocess.run(
        [sys.executable, "-m", "flowgrpo.cli", "list"], capture_output=True, text=True, cwd=ROOT, check=True
    )
    for names in KNOWN.values():
        for name in names:
            assert re.search(rf"^  {re.escape(name)}\s", out.stdout, re.M), name


def test_a_filter_imports_only_what_it_lists():
    code = (
        "import sys; from flowgrpo.cli import main; assert main(['list', 'presets']) == 0; "
        "print('LOADED', sorted(m for m in ('pipelines', 'reward_models', 'diffusers', 'transformers') "
        "if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert "flow_grpo" in out.stdout and "LOADED []" in out.stdout


@pytest.mark.parametrize("value, shown", [("x" * 100, "'" + "x" * 37 + "…'"), ((1, 2), "(1, 2)")])
def test_long_defaults_are_shortened(value, shown):
    assert listing.format_settings({"v": value}) == f"v={shown}"
