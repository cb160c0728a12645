"""The real recipes' prompt files: a missing one names the fetch command; scripts/fetch_prompts.py converts
local copies and checks what is there. No network here: the download paths are not run."""

import json
import re
import subprocess
import sys
from pathlib import Path

from .cli_helpers import ROOT, run_cli

SCRIPT = str(ROOT / "scripts/fetch_prompts.py")


def real_prompt_files() -> list[str]:
    """Every prompt file (data.path, data.eval_path) a recipe in configs/t2i/real/ reads."""
    from flowgrpo.config import read_yaml_config

    files = set()
    for config in (ROOT / "configs/t2i/real").glob("*.yaml"):
        data = read_yaml_config(config).get("data") or {}
        files |= {data[k] for k in ("path", "eval_path") if data.get(k)}
    # image-edit rows (.jsonl naming images: kontext_edit, qwenimage_edit_plus) are not fetched by fetch_prompts.py;
    # docs/recipes.md, "Editing recipes", says where they come from and how to convert them
    files = {f for f in files if not f.endswith(".jsonl")}
    return sorted(files)


def test_missing_prompt_file_names_the_fetch_command(tmp_path):
    files = real_prompt_files()
    assert {"prompts/pickscore_sfw_train.txt", "prompts/unigenbench_train.txt"} <= set(files)
    out = tmp_path / "prompts"
    for file in files:  # the trainer's one-line error names the command that fetches this very file
        done = run_cli(
            "train-t2i",
            str(ROOT / "configs/t2i/tiny/flow_grpo.yaml"),
            "data.prompts=null",
            f"data.path={file}",
            f"output_dir={tmp_path / 'out'}",
            cwd=tmp_path,
        )
        assert done.returncode == 2, done.stderr[-2000:]
        line = done.stderr.strip().splitlines()[-1]
        assert re.search(rf"python scripts/fetch_prompts\.py {set_name(file)}\b", line), line
        # and the script knows the file: --check lists it as missing with the same command
        check = subprocess.run([sys.executable, SCRIPT, "--check", "--out", str(out)], capture_output=True, text=True)
        assert check.returncode == 1
        assert f"{out / Path(file).name}: missing (python scripts/fetch_prompts.py {set_name(file)})" in check.stdout
    for file in files:  # every one of them can be filled from a local copy, after which --check passes
        (tmp_path / "local.txt").write_text(f"a prompt for {file}\n", encoding="utf-8")
        done = subprocess.run(
            [sys.executable, SCRIPT, Path(file).stem, "--from", str(tmp_path / "local.txt"), "--out", str(out)],
            capture_output=True,
            text=True,
        )
        assert done.returncode == 0, done.stderr
    check = subprocess.run([sys.executable, SCRIPT, "--check", "--out", str(out)], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout


def set_name(file: str) -> str:
    """The group the fetch command takes for a prompt file: prompts/pickscore_sfw_test.txt -> pickscore_sfw."""
    return Path(file).stem.rsplit("_", 1)[0]


def test_fetch_from_local_files_then_check(tmp_path):
    (tmp_path / "photo.json").write_text(json.dumps(["a red bus", "  a red bus ", "a cat on a mat"]))
    (tmp_path / "anime.jsonl").write_text(json.dumps({"prompt": "a fox in the snow"}) + "\n")
    out = tmp_path / "prompts"
    done = subprocess.run(
        [
            sys.executable,
            SCRIPT,
            "hpdv2_test",
            "--from",
            str(tmp_path / "photo.json"),
            str(tmp_path / "anime.jsonl"),
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    assert (out / "hpdv2_test.txt").read_text(encoding="utf-8").splitlines() == [
        "a red bus",
        "a cat on a mat",
        "a fox in the snow",
    ]
    check = subprocess.run([sys.executable, SCRIPT, "--check", "--out", str(out)], capture_output=True, text=True)
    assert check.returncode == 1  # the other three sets are missing
    assert "hpdv2_test.txt: 3 prompts" in check.stdout
    assert "pickscore_train.txt: missing (python scripts/fetch_prompts.py pickscore)" in check.stdout
