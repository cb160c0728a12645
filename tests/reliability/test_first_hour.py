"""What a new user meets in the first hour, through the `flowgrpo` command: the README's
commands work as written, and a mistake (a bad path, YAML, setting or input) fails in one clear line."""

import json

from PIL import Image

from .cli_helpers import ROOT, run_cli


def test_evaluate_in_the_readme_form(tmp_path):
    samples = tmp_path / "samples"
    samples.mkdir()
    rows = []
    for i, level in enumerate((40, 200)):
        Image.new("RGB", (16, 16), (level,) * 3).save(samples / f"im{i}.png")
        rows.append({"file": f"im{i}.png", "prompt": f"grey {i}"})
    (samples / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    done = run_cli(
        "evaluate",
        "--images",
        "samples/",
        "--prompts",
        "samples/prompts.jsonl",
        "--scorers",
        "brightness,colorfulness",
        "-o",
        "outputs/eval/samples",
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "2 images" in done.stdout
    assert (tmp_path / "outputs/eval/samples/scores.jsonl").is_file()


def test_evaluate_help(tmp_path):
    done = run_cli("evaluate", "--help", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "--images" in done.stdout and "--scorers" in done.stdout


T2I_TINY = str(ROOT / "configs/t2i/tiny/flow_grpo.yaml")
TEXT_TINY = str(ROOT / "configs/text/tiny_pattern.yaml")


def _one_line_error(done, *needles: str) -> str:
    assert done.returncode == 2, (done.returncode, done.stderr[-2000:])
    assert "Traceback" not in done.stderr, done.stderr[-2000:]
    text = done.stderr.strip()
    for needle in needles:
        assert needle in text, text
    return text


def test_output_dir_that_is_a_file(tmp_path):
    (tmp_path / "taken").write_text("x")
    for command, config in (("train-t2i", T2I_TINY), ("train-text", TEXT_TINY)):
        done = run_cli(command, config, f"output_dir={tmp_path / 'taken'}", cwd=tmp_path)
        text = _one_line_error(done, "is a file, not a folder")
        assert len(text.splitlines()) <= 2


def test_malformed_yaml_is_one_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("iterations: 3\nsampler: {num_steps: 4\nseed: 1\n")
    text = _one_line_error(run_cli("train-t2i", str(bad), cwd=tmp_path), "not valid YAML at line")
    assert len(text.splitlines()) == 1
    text = _one_line_error(run_cli("train-text", TEXT_TINY, "optim.lr=[1,", cwd=tmp_path), "override 'optim.lr=[1,'")
    assert len(text.splitlines()) == 1


def test_reward_function_that_does_not_import(tmp_path):
    (tmp_path / "broken.py").write_text(
        "import not_a_real_module\n\ndef r(prompts, completions, **kw):\n    return []\n"
    )
    for ref in (f"{tmp_path / 'broken.py'}:r", "no_such_package.rewards:r"):
        done = run_cli(
            "train-text", TEXT_TINY, f"output_dir={tmp_path / 'out'}", f"rewards=[{{name: '{ref}'}}]", cwd=tmp_path
        )
        text = _one_line_error(done, "ModuleNotFoundError")
        assert len(text.splitlines()) == 1


def test_prompt_file_not_utf8(tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_bytes("a caf\xe9 at night\n".encode("latin-1"))
    done = run_cli(
        "train-t2i",
        T2I_TINY,
        f"output_dir={tmp_path / 'out'}",
        f"data.path={prompts}",
        "data.prompts=null",
        cwd=tmp_path,
    )
    text = _one_line_error(done, "is not UTF-8 text", "prompts.txt")
    assert len(text.splitlines()) == 1


def test_evaluate_prompt_file_not_utf8(tmp_path):
    samples = tmp_path / "samples"
    samples.mkdir()
    for i in range(2):
        Image.new("RGB", (16, 16), (100,) * 3).save(samples / f"im{i}.png")
    for name, data in (
        ("prompts.txt", "a caf\xe9\nsecond\n".encode("latin-1")),
        ("prompts.jsonl", '{"file": "im0.png", "prompt": "caf\xe9"}\n'.encode("latin-1")),
    ):
        (tmp_path / name).write_bytes(data)
        done = run_cli(
            "evaluate", "--images", str(samples), "--prompts", str(tmp_path / name), "--scorers", "brightness",
            "-o", str(tmp_path / "ev"), cwd=tmp_path,
        )  # fmt: skip
        text = _one_line_error(done, "is not UTF-8 text", name)
        assert len(text.splitlines()) == 1


def test_settings_that_cannot_work_fail_before_any_folder(tmp_path):
    for command, config, bad in (
        ("train-t2i", T2I_TINY, "sampler.num_steps=0"),
        ("train-t2i", T2I_TINY, "sampler.height=0"),
        ("train-text", TEXT_TINY, "group_size=1"),
    ):
        out = tmp_path / bad.replace("=", "_")
        done = run_cli(command, config, f"output_dir={out}", bad, cwd=tmp_path)
        _one_line_error(done, bad.split("=")[0])
        assert not out.exists()


def test_resolution_the_model_cannot_take_is_one_line(tmp_path):
    for bad, why in (("sampler.height=4096", "larger than this model takes"), ("sampler.height=9", "multiples of")):
        out = tmp_path / bad.replace("=", "_")
        done = run_cli("train-t2i", T2I_TINY, f"output_dir={out}", bad, cwd=tmp_path)
        text = _one_line_error(done, "sampler.height", why)
        assert len(text.splitlines()) == 1
        assert not out.exists() or not any(out.iterdir())  # checked before anything is written


def test_nft_progress_bar_shows_no_nan_kl(tmp_path):
    done = run_cli(
        "train-t2i",
        str(ROOT / "configs/t2i/tiny/diffusion_nft.yaml"),
        "iterations=1",
        "progress=true",
        "artifacts.tensorboard=false",
        f"output_dir={tmp_path / 'out'}",
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "reward=" in done.stderr and "kl=nan" not in done.stderr


def test_evaluating_a_tiny_model_too_large_is_one_line(tmp_path):
    (tmp_path / "p.txt").write_text("a cat\n")
    done = run_cli(
        "evaluate",
        "-o",
        str(tmp_path / "ev"),
        "input.generate.model=sd3",
        "input.generate.tiny=true",
        f"input.generate.prompts={tmp_path / 'p.txt'}",
        "input.generate.num_steps=2",
        "scorers=[brightness]",
        cwd=tmp_path,
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert "512x512 px is larger than this model takes (128 px a side)" in done.stderr
    assert "Traceback" not in done.stderr
