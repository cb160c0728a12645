"""The first hour, part 2 (issue 30): the documented `accelerate launch` on a CPU install, where `gpu-check --tiny`
writes, missing scorer weights in one line, a fast `--help` and an immediate first line, what the progress bar
calls KL and shows for Pref-GRPO, custom reward files found beside their config, each warning once, and the
README's commands and snippets run as printed."""

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from .cli_helpers import ROOT, one_line_error, run_cli

T2I_TINY = str(ROOT / "configs/t2i/tiny/flow_grpo.yaml")
TEXT_TINY = str(ROOT / "configs/text/tiny_pattern.yaml")
QUIET = ("artifacts.tensorboard=false", "artifacts.plot=false")


# --- 1. `accelerate launch` as README and docs/scaling.md print it --------------------------------------------


def test_accelerate_launch_as_documented(tmp_path):
    """accelerate's own CLI imports timm -> torchvision before any flowgrpo code: on a CPU torch with PyPI's CUDA
    torchvision (the `clip` extra) that crashed with "operator torchvision::nms does not exist". The hook now
    comes in through torch's `torch.backends` plug-ins, so the command runs unwrapped."""
    from importlib.metadata import entry_points

    hooks = [e for e in entry_points(group="torch.backends") if e.value.startswith("torchvision_cpu_hook")]
    assert hooks, "the installed flowgrpo has no torch.backends entry point: reinstall it (pip install -e .)"
    accelerate = Path(sys.executable).with_name("accelerate")
    out = tmp_path / "run"
    argv = [str(accelerate), "launch", "--config_file", "configs/accelerate/ddp.yaml", "--num_processes", "1",
            "--main_process_port", "0",  # a free port: tests/scaling launches the shipped configs' 29500 alongside
            "scripts/train_t2i.py", "configs/t2i/tiny/flow_grpo.yaml", "iterations=1", f"output_dir={out}",
            "progress=false", *QUIET]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELERATE_", "FSDP_", "PYTHONPATH"))}
    env["HF_HUB_OFFLINE"] = "1"
    done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "torchvision::nms" not in done.stderr
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 1


def test_torchvision_imports_first_in_a_plain_interpreter(tmp_path):
    """No flowgrpo import and torchvision before torch: torch's plug-in call installs the hook during
    torchvision's own `import torch`, in time for its `_meta_registrations`."""
    import importlib.util

    if importlib.util.find_spec("torchvision") is None:
        pytest.skip("torchvision is not installed (a bare install): nothing to hook")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    code = "import torchvision, sys; from torchvision import transforms; "
    code += "print('hooked', 'torchvision_cpu_hook' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith("hooked True")


# --- 2. gpu-check --tiny never writes into the source tree ----------------------------------------------------

DOCS = ROOT / "docs" / "gpu_validation.md"
SKIP_ALL = ("--skip", "sd35", "flux", "text", "vllm", "text_full")


def _committed_report() -> dict:
    return {p: p.read_bytes() for p in (DOCS, DOCS.with_suffix(".json")) if p.exists()}


def test_gpu_check_tiny_writes_to_the_working_folder(tmp_path):
    before = _committed_report()
    try:
        done = run_cli("gpu-check", "--tiny", "--device", "cpu", *SKIP_ALL, cwd=tmp_path)
        assert done.returncode == 0, done.stderr[-3000:]
        assert _committed_report() == before  # the committed page is left alone
        assert json.loads((tmp_path / "gpu_validation.json").read_text())["mode"] == "tiny"
        assert (tmp_path / "gpu_validation.md").read_text().startswith("# GPU validation")
        # --output (alias of --out) elsewhere; the committed page itself is refused
        done = run_cli("gpu-check", "--tiny", "--device", "cpu", *SKIP_ALL, "--output", "r/x.md", cwd=tmp_path)
        assert done.returncode == 0 and (tmp_path / "r" / "x.json").is_file(), done.stderr[-3000:]
        done = run_cli("gpu-check", "--tiny", "--out", str(DOCS), cwd=tmp_path)
        one_line_error(done, "never replace the committed report", prefix="gpu_check")
        assert _committed_report() == before
    finally:  # a regression must not leave a tiny report in the checkout
        for path, data in before.items():
            if path.read_bytes() != data:
                path.write_bytes(data)


# --- 3. scorer weights that are not there -------------------------------------------------------------------


def _samples(tmp_path: Path) -> Path:
    from PIL import Image

    folder = tmp_path / "samples"
    folder.mkdir()
    Image.new("RGB", (16, 16), (90, 90, 90)).save(folder / "a.png")
    (folder / "prompts.jsonl").write_text('{"file": "a.png", "prompt": "a cat"}\n')
    return folder


def test_missing_scorer_weights_are_one_line(tmp_path):
    """Offline with an empty hub cache: one line naming the scorer, the hub ids and the three ways out, instead
    of ~50 lines of hub traceback; a local path that does not exist says so (not "malformed repo id")."""
    env = {"HF_HOME": str(tmp_path / "empty_hf_home")}  # whatever this machine has cached
    _samples(tmp_path)
    done = run_cli("evaluate", "--images", "samples/", "--scorers", "pickscore", "-o", "ev", cwd=tmp_path, env=env)
    line = one_line_error(done, "pickscore", "yuvalkirstain/PickScore_v1", "HF_HUB_OFFLINE", "hf download", "`model:`")
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert "not in the local hub cache" in line
    done = run_cli(
        "evaluate", "--images", "samples/", "-o", "ev2", "scorers=[{name: pickscore, model: /nonexistent/PickScore}]",
        cwd=tmp_path, env=env,
    )  # fmt: skip
    line = one_line_error(done, "pickscore", "/nonexistent/PickScore", "does not exist")
    assert "Repo id" not in line
    done = run_cli("train-t2i", T2I_TINY, f"output_dir={tmp_path / 'run'}", "rewards=[{name: clip_score}]",
                   cwd=tmp_path, env=env)  # fmt: skip
    one_line_error(done, "clip_score", "openai/clip-vit-large-patch14", "HF_HUB_OFFLINE=0", "`model:`")


# --- 4. a fast --help, and a first line at once ---------------------------------------------------------------


def test_help_imports_no_torch(tmp_path):
    code = (
        "import sys\nfrom flowgrpo.cli import main\n"
        "for argv in (['--help'], ['train-t2i', '--help'], ['train-text', '--help'], ['gpu-check', '--help']):\n"
        "    try:\n        main(argv)\n    except SystemExit as e:\n        assert e.code == 0, argv\n"
        "print('torch imported:', 'torch' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "usage: flowgrpo train-t2i" in done.stdout and "usage: flowgrpo gpu-check" in done.stdout
    assert done.stdout.strip().endswith("torch imported: False")


# the process ends once the command's second line is out: the lines are the test, the run after them is not
# (it is ~5 s of t2i model build and iteration, which other tests run)
_FIRST_RECORD = """
import logging, os, sys
seen = []
class First(logging.Handler):
    def emit(self, record):
        seen.append(("torch" in sys.modules, record.name, record.getMessage()))
        if len(seen) == 2:
            for torch_loaded, name, message in seen:
                print("RECORD", torch_loaded, name, message)
            sys.stdout.flush()
            os._exit(0)
logging.getLogger("flowgrpo.cli").addHandler(First())  # the command's own lines (on stdout)
from flowgrpo.cli import main
main(sys.argv[1:])
sys.exit(3)  # the command ended before its second line
"""


@pytest.mark.parametrize("command,config", [("train-t2i", T2I_TINY), ("train-text", TEXT_TINY)])
def test_a_run_says_what_it_loads_before_importing_torch(tmp_path, command, config):
    done = subprocess.run(
        [sys.executable, "-c", _FIRST_RECORD, command, config, "iterations=1", "progress=false",
         f"output_dir={tmp_path / 'run'}"],
        cwd=tmp_path, capture_output=True, text=True, timeout=600,
        env={**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    first, second = [line for line in done.stdout.splitlines() if line.startswith("RECORD")][:2]
    assert first.startswith("RECORD False flowgrpo.cli ") and command in first and "importing torch" in first, first
    assert "loading" in second and str(tmp_path / "run") in second, second
    assert done.stdout.startswith(f"INFO flowgrpo.cli: {command} {config}: importing torch")  # the very first line


# --- 5. the progress bar ----------------------------------------------------------------------------------------


def test_progress_bar_names_its_kl(tmp_path):
    """`kl=` was the old/new approximate KL, read as the KL to the reference: now `kl_old=`, and `kl_ref=` where
    the loss computes a KL to the reference."""
    done = run_cli("train-t2i", T2I_TINY, "iterations=1", "progress=true", "loss.kl.coef=0.04", *QUIET,
                   f"output_dir={tmp_path / 'run'}", cwd=tmp_path)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "kl_ref=" in done.stderr and "kl_old=" in done.stderr
    assert not re.search(r"[ ,]kl=", done.stderr), done.stderr[-2000:]


def test_pref_grpo_bar_shows_what_moves(tmp_path):
    """Pref-GRPO's weighted reward mean is the win rate's 0.5 by construction: the bar shows the pointwise
    reward's mean and the judge's spread of win rates instead."""
    done = run_cli("train-t2i", str(ROOT / "configs/t2i/tiny/pref_grpo.yaml"), "iterations=1", "progress=true",
                   *QUIET, f"output_dir={tmp_path / 'run'}", cwd=tmp_path)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    record = json.loads((tmp_path / "run/metrics.jsonl").read_text().splitlines()[0])
    assert record["reward_mean"] == pytest.approx(0.5)  # what the bar used to show
    assert "reward=" not in done.stderr
    assert f"judge_sd={record['rewards/judge/std']:.3f}" in done.stderr
    assert f"brightness={record['rewards/brightness/mean']:.4f}" in done.stderr
    assert "reward 0.5000 -> 0.5000" not in done.stdout  # the closing summary too
    assert f"brightness {record['rewards/brightness/mean']:.4f} -> " in done.stdout and "judge: pairwise" in done.stdout


# --- 6. custom reward files -----------------------------------------------------------------------------------

_REWARD_FILE = "def r(prompts, completions, **kw):\n    return [0.5 for _ in completions]\n"


def test_reward_file_is_found_beside_the_config_that_names_it(tmp_path):
    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg/my_reward.py").write_text(_REWARD_FILE)
    (tmp_path / "cfg/run.yaml").write_text(f"base: {TEXT_TINY}\nrewards: [{{name: 'my_reward.py:r'}}]\n")
    # a base in another folder sets the rewards: its folder is where the file is looked for
    (tmp_path / "base").mkdir()
    (tmp_path / "base/b_reward.py").write_text(_REWARD_FILE)
    (tmp_path / "base/base.yaml").write_text(f"base: {TEXT_TINY}\nrewards: [{{name: 'b_reward.py:r'}}]\n")
    (tmp_path / "top").mkdir()
    (tmp_path / "top/run.yaml").write_text("base: ../base/base.yaml\niterations: 1\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    for config in ("cfg/run.yaml", "top/run.yaml"):
        out = tmp_path / config.replace("/", "_")
        done = run_cli("train-text", str(tmp_path / config), "iterations=1", "progress=false", f"output_dir={out}",
                       cwd=elsewhere)  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
    # neither beside the config nor in the working directory: one line naming both places
    (tmp_path / "cfg/none.yaml").write_text(f"base: {TEXT_TINY}\nrewards: [{{name: 'nowhere.py:r'}}]\n")
    done = run_cli("train-text", str(tmp_path / "cfg/none.yaml"), f"output_dir={tmp_path / 'x'}", cwd=elsewhere)
    one_line_error(done, "nowhere.py", str(tmp_path / "cfg" / "nowhere.py"), str(elsewhere / "nowhere.py"))
    # the working-directory fallback (e.g. a reward given on the command line)
    (elsewhere / "here.py").write_text(_REWARD_FILE)
    done = run_cli("train-text", TEXT_TINY, "iterations=1", "progress=false", f"output_dir={tmp_path / 'y'}",
                   "rewards=[{name: 'here.py:r'}]", cwd=elsewhere)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]


def test_a_failing_reward_shows_its_traceback_once(tmp_path):
    (tmp_path / "bad.py").write_text(
        "def r(prompts, completions, **kw):\n    return [1 / 0 for _ in completions]  # the line to see\n"
    )
    done = run_cli("train-text", TEXT_TINY, "iterations=3", "progress=false", f"output_dir={tmp_path / 'run'}",
                   "rewards=[{name: 'bad.py:r', alias: bad}, target_pattern]", cwd=tmp_path)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stderr.count("Traceback (most recent call last)") == 1, done.stderr[-3000:]
    assert "# the line to see" in done.stderr and "ZeroDivisionError" in done.stderr
    assert "failure 3 of this function" in done.stderr


# --- 7. noise -------------------------------------------------------------------------------------------------


def test_guard_warnings_print_once(tmp_path):
    (tmp_path / "inf.py").write_text(
        "def r(prompts, completions, **kw):\n"
        "    return [float('inf') if i % 2 else 0.5 for i in range(len(completions))]\n"
    )
    done = run_cli("train-text", TEXT_TINY, "iterations=2", "progress=false", f"output_dir={tmp_path / 'run'}",
                   "rewards=[{name: 'inf.py:r'}]", cwd=tmp_path)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    for step in (1, 2):
        assert done.stderr.count(f"step {step}: 8 of 16 rewards inf (left out)") == 1, done.stderr[-3000:]
    assert "WARNING flowgrpo.guards: step 1: 8 of 16 rewards inf (left out)" in done.stderr


def test_truncation_warnings_are_shown_once(tmp_path):
    long = " ".join(["a very long prompt about a red apple on a wooden table"] * 10)
    prompts = json.dumps([long, "b " + long, "c " + long, "d " + long])
    done = run_cli("train-t2i", T2I_TINY, "iterations=2", "progress=false", *QUIET, f"data.prompts={prompts}",
                   f"data.eval_prompts={json.dumps([long])}", f"output_dir={tmp_path / 'run'}",
                   cwd=tmp_path)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Token indices sequence length" not in done.stderr
    kinds = [line.split(":")[0] for line in done.stderr.splitlines() if "was truncated because" in line]
    assert kinds and len(kinds) == len(set(kinds)), done.stderr[-3000:]  # each kind once (CLIP, T5)
    assert "shown once" in done.stderr


def test_misspelt_reward_setting_suggests_weight(tmp_path):
    for command, config, name in (("train-t2i", T2I_TINY, "brightness"), ("train-text", TEXT_TINY, "target_pattern")):
        done = run_cli(command, config, f"output_dir={tmp_path / command}", f"rewards=[{{name: {name}, wieght: 2}}]",
                       cwd=tmp_path)  # fmt: skip
        one_line_error(done, "'wieght'", "did you mean 'weight'", "'alias'")


# --- 8. README commands and snippets, as printed -------------------------------------------------------------

README = (ROOT / "README.md").read_text()


def _fenced(first_line: str) -> str:
    """The README code block whose first line is `first_line`."""
    for block in re.findall(r"```[a-z]*\n(.*?)```", README, flags=re.S):
        if block.startswith(first_line + "\n"):
            return block
    raise AssertionError(f"README has no code block starting with {first_line!r}")


def _readme_command(prefix: str) -> list[str]:
    match = re.search(rf"`?({re.escape(prefix)}[^`\n]*)`?", README)
    assert match, prefix
    return shlex.split(match.group(1))


def test_readme_custom_reward_example(tmp_path):
    for name in ("my_task/brevity.py", "my_task/run.yaml"):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(_fenced(f"# {name}"))
    (tmp_path / "configs").symlink_to(ROOT / "configs")  # the checkout the README's example sits in
    argv = _readme_command("flowgrpo train-text my_task/run.yaml")
    done = run_cli(*argv[1:], "progress=false", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "outputs/text/my_task/metrics.jsonl").read_text().splitlines()]
    assert len(records) == 3 and all(0 < r["rewards/brevity/mean"] <= 1 for r in records)


def test_readme_evaluate_prompt_file_example(tmp_path):
    from PIL import Image

    block = _fenced('{"file": "apple_0.png", "prompt": "a red apple", "index": 0}')
    (tmp_path / "samples").mkdir()
    (tmp_path / "samples/prompts.jsonl").write_text(block)
    for i, row in enumerate(json.loads(line) for line in block.splitlines()):
        Image.new("RGB", (16, 16), (40 + 60 * i,) * 3).save(tmp_path / "samples" / row["file"])
    argv = _readme_command("flowgrpo evaluate --images samples/ --scorers brightness")
    done = run_cli(*argv[1:], cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "3 images" in done.stdout
    rows = [json.loads(line) for line in (tmp_path / "outputs/eval/samples/scores.jsonl").read_text().splitlines()]
    assert {r["prompt"] for r in rows} == {"a red apple", "a blue car"}


def test_readme_lora_snippet_loads_lora_and_lora_ema(tmp_path, monkeypatch):
    """The diffusers snippet as printed, with a tiny SD3 pipeline folder for /models/sd3.5-medium, the CPU for
    cuda, and a tiny run's output folder for outputs/my_run (which holds lora/ and lora_ema/)."""
    import torch

    from pipelines.adapters import build_adapter

    run = tmp_path / "outputs/my_run"
    done = run_cli("train-t2i", T2I_TINY, "iterations=1", "progress=false", *QUIET, f"output_dir={run}", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (run / "lora/pytorch_lora_weights.safetensors").is_file()
    assert (run / "lora_ema/pytorch_lora_weights.safetensors").is_file()
    build_adapter("sd3", tiny=True).pipe.save_pretrained(tmp_path / "sd3-tiny")
    snippet = _fenced("import torch").replace("/models/sd3.5-medium", str(tmp_path / "sd3-tiny"))
    snippet = snippet.replace('.to("cuda")', '.to("cpu")').replace("num_inference_steps=40", "num_inference_steps=2")
    monkeypatch.chdir(tmp_path)
    for folder in ("lora", "lora_ema"):
        code = snippet.replace("outputs/my_run/lora", f"outputs/my_run/{folder}", 1)
        scope: dict = {}
        exec(compile(code, "README.md", "exec"), scope)
        pipe = scope["pipe"]
        assert pipe.get_active_adapters(), folder  # the LoRA is loaded and active
        assert (tmp_path / "apple.png").is_file()
        (tmp_path / "apple.png").unlink()
    assert torch.is_tensor(next(pipe.transformer.parameters()))
