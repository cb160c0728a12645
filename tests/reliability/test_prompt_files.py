"""The real recipes' prompt files: a missing one names the fetch command; scripts/fetch_prompts.py converts
local copies and checks what is there (issue 16, item 4). No network here: the download paths are not run."""

import json
import subprocess
import sys

from .cli_helpers import ROOT, run_cli

SCRIPT = str(ROOT / "scripts/fetch_prompts.py")


def test_missing_prompt_file_names_the_fetch_command(tmp_path):
    done = run_cli(
        "train-t2i",
        str(ROOT / "configs/t2i/tiny/flow_grpo.yaml"),
        "data.prompts=null",
        "data.path=prompts/pickscore_train.txt",
        f"output_dir={tmp_path / 'out'}",
        cwd=tmp_path,
    )
    assert done.returncode == 2
    assert "python scripts/fetch_prompts.py pickscore" in done.stderr.strip().splitlines()[-1]


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
