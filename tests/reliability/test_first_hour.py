"""What a new user meets in the first hour, through the `flowgrpo` command (issue 16, items 2 and 5)."""

import json

from PIL import Image

from .cli_helpers import run_cli


def test_evaluate_in_the_readme_form(tmp_path):
    samples = tmp_path / "samples"
    samples.mkdir()
    rows = []
    for i, level in enumerate((40, 200)):
        Image.new("RGB", (16, 16), (level,) * 3).save(samples / f"im{i}.png")
        rows.append({"file": f"im{i}.png", "prompt": f"grey {i}"})
    (samples / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    done = run_cli("evaluate", "--images", "samples/", "--prompts", "samples/prompts.jsonl",
                   "--scorers", "brightness,colorfulness", "-o", "outputs/eval/samples",
                   cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "2 images" in done.stdout
    assert (tmp_path / "outputs/eval/samples/scores.jsonl").is_file()


def test_evaluate_help(tmp_path):
    done = run_cli("evaluate", "--help", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "--images" in done.stdout and "--scorers" in done.stdout
