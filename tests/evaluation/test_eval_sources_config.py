"""Prompt files, image folders, and the strict evaluation config (YAML + overrides + flags)."""

import pytest

from eval_helpers import gray_folder, solid, write_jsonl
from flowgrpo.config import ConfigError
from flowgrpo.evaluation import EvaluationError, load_eval_config, main
from flowgrpo.evaluation.sources import folder_samples, prompt_set


def test_txt_prompts_match_sorted_files_and_number_repeats(tmp_path):
    folder = tmp_path / "imgs"
    folder.mkdir()
    for name in ("b.png", "a.png", "c.jpg"):
        solid(folder, name, (10, 20, 30))
    (folder / "notes.md").write_text("not an image")
    (folder / "prompts.txt").write_text("a cat\n\na dog\na cat\n")
    samples = folder_samples(folder)
    assert [s.file.rsplit("/", 1)[1] for s in samples] == ["a.png", "b.png", "c.jpg"]
    assert [(s.prompt, s.index) for s in samples] == [("a cat", 0), ("a dog", 0), ("a cat", 1)]
    (folder / "prompts.txt").write_text("a cat\na dog\n")
    with pytest.raises(EvaluationError, match="2 prompts but .* 3 images"):
        folder_samples(folder)


def test_jsonl_prompts_with_index_and_metadata(tmp_path):
    folder = tmp_path / "imgs"
    folder.mkdir()
    solid(folder, "x.png", (0, 0, 0))
    solid(folder, "y.png", (0, 0, 0))
    write_jsonl(
        folder / "prompts.jsonl",
        [
            {"file": "x.png", "prompt": "p", "index": 3, "metadata": {"a": 1}, "tag": "t"},
            {"file": "y.png", "prompt": "p"},
        ],
    )
    s = folder_samples(folder)
    assert [(x.prompt, x.index) for x in s] == [("p", 3), ("p", 1)]
    assert s[0].metadata == {"a": 1, "tag": "t"} and s[1].metadata == {}
    write_jsonl(
        folder / "prompts.jsonl",
        [{"file": "x.png", "prompt": "p", "index": 0}, {"file": "y.png", "prompt": "p", "index": 0}],
    )
    with pytest.raises(EvaluationError, match="must be unique"):
        folder_samples(folder)
    write_jsonl(folder / "prompts.jsonl", [{"file": "nope.png", "prompt": "p"}])
    with pytest.raises(EvaluationError, match="not found"):
        folder_samples(folder)
    write_jsonl(folder / "prompts.jsonl", [{"prompt": "p"}])
    with pytest.raises(EvaluationError, match="needs a 'file'"):
        folder_samples(folder)
    (folder / "prompts.jsonl").write_text('{"file": "x.png"}\n')
    with pytest.raises(EvaluationError, match="prompts.jsonl:1: needs a string 'prompt'"):
        folder_samples(folder)
    (folder / "prompts.jsonl").unlink()
    with pytest.raises(EvaluationError, match="no prompts.jsonl or prompts.txt"):
        folder_samples(folder)


def test_prompt_set_for_generation(tmp_path):
    p = write_jsonl(tmp_path / "set.jsonl", [{"prompt": "a", "tag": "x"}, {"prompt": "b"}, {"prompt": "c"}])
    rows = prompt_set(p, max_prompts=2)
    assert [r.prompt for r in rows] == ["a", "b"] and rows[0].metadata == {"tag": "x"}
    write_jsonl(p, [{"prompt": "a", "file": "x.png"}])
    with pytest.raises(EvaluationError, match="takes no 'file'"):
        prompt_set(p)


def test_config_yaml_overrides_and_strict_errors(tmp_path):
    cfg_file = tmp_path / "eval.yaml"
    cfg_file.write_text(
        "input:\n  images: {dir: imgs}\nscorers: [brightness, {name: jpeg_compressibility, quality: 80}]\n"
        "report: {top_k: 2}\n"
    )
    cfg = load_eval_config(cfg_file, ["report.top_k=5", "stats.resamples=100"])
    assert cfg.report.top_k == 5 and cfg.stats.resamples == 100 and cfg.input.images.dir == "imgs"
    assert [(s.name, s.settings) for s in cfg.scorers] == [
        ("brightness", {}),
        ("jpeg_compressibility", {"quality": 80}),
    ]
    with pytest.raises(
        ConfigError, match=r"unknown key 'num_step' \(did you mean 'num_steps'\?\); valid keys: .*'guidance_scale'"
    ):
        load_eval_config(
            None,
            [
                "input.generate.model=sd3",
                "input.generate.tiny=true",
                "input.generate.prompts=p.txt",
                "input.generate.num_step=3",
                "scorers=[brightness]",
            ],
        )
    with pytest.raises(ConfigError, match="exactly one of images"):
        load_eval_config(
            cfg_file, ["input.generate.model=sd3", "input.generate.tiny=true", "input.generate.prompts=p.txt"]
        )
    with pytest.raises(ConfigError, match="exactly one of generate.pretrained"):
        load_eval_config(None, ["input.generate.model=sd3", "input.generate.prompts=p.txt", "scorers=[brightness]"])
    with pytest.raises(ConfigError, match="unknown scorer 'brightnes'.*did you mean 'brightness'"):
        load_eval_config(cfg_file, ["scorers=[brightnes]"])
    with pytest.raises(
        ConfigError, match="has no setting \\['qualty'\\]; valid settings: \\['batch_size', 'key', 'quality'\\]"
    ):
        load_eval_config(cfg_file, ["scorers=[{name: jpeg_compressibility, qualty: 3}]"])
    with pytest.raises(ConfigError, match="need a comparison"):
        load_eval_config(cfg_file, ["scorers=[{name: pointwise_as_pairwise, scorer: brightness}]"])
    with pytest.raises(ConfigError, match="at most one of baseline"):
        load_eval_config(cfg_file, ["compare=old", "baseline.images.dir=x"])


def test_cli_flags_and_errors(tmp_path, capsys):
    folder = gray_folder(tmp_path / "imgs", [("a", 10), ("b", 200)])
    out = tmp_path / "out"
    assert (
        main(
            [
                "--images",
                str(folder),
                "--scorers",
                "brightness",
                "-o",
                str(out),
                "--no-progress",
                "report.enabled=false",
            ]
        )
        == 0
    )
    assert (out / "scores.csv").is_file() and not (out / "report.html").exists()
    assert "2 images" in capsys.readouterr().out
    # an earlier run is never overwritten silently
    assert main(["--images", str(folder), "--scorers", "brightness", "-o", str(out), "--no-progress"]) == 2
    assert "already holds an evaluation run" in capsys.readouterr().err
    assert main(["--prompts", "p.txt", "--scorers", "brightness"]) == 2
    assert "--prompts goes with --images" in capsys.readouterr().err
    assert main(["--images", str(folder), "-o", str(tmp_path / "o2"), "scorers=[]"]) == 2
    assert "scorers" in capsys.readouterr().err
    assert main(["--images", str(tmp_path / "missing"), "--scorers", "brightness", "-o", str(tmp_path / "o3")]) == 2
    assert "image folder not found" in capsys.readouterr().err
