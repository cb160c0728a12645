"""A resume with another model (layer count, family, LoRA rank) or recipe is refused in one line naming the keys,
before the checkpoint's optimizer state (which would not fit the new model) is loaded: no torch traceback.
Through `flowgrpo train-text` / `train-t2i`."""

import shutil
import subprocess
from pathlib import Path

import pytest

from .cli_helpers import ROOT, run_cli

TEXT = str(ROOT / "configs/text/tiny_pattern.yaml")
T2I_TINY = ROOT / "configs/t2i/tiny"


def _refused(done: subprocess.CompletedProcess, *parts: str) -> None:
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("flowgrpo: resume: "), last
    assert "A resumed run keeps its settings" in last
    for part in parts:
        assert part in last, (part, last)


def test_text_resume_with_another_layer_count_is_refused(tmp_path):
    out = tmp_path / "run"
    common = ["train-text", TEXT, "progress=false", f"output_dir={out}"]
    assert run_cli(*common, "iterations=1", cwd=tmp_path).returncode == 0
    done = run_cli(*common, "iterations=2", "resume=true", "model.tiny.num_layers=3", cwd=tmp_path)
    _refused(done, "model.tiny.num_layers: 2 in the checkpoint, 3 now")
    done = run_cli(*common, "iterations=2", "resume=true", "model.lora.enabled=true", cwd=tmp_path)
    _refused(done, "model.lora.enabled: False in the checkpoint, True now")


COMMON = ["progress=false", "artifacts.tensorboard=false", "artifacts.plot=false", "checkpoint.save_final_model=false"]


@pytest.fixture(scope="module")
def t2i_run(tmp_path_factory) -> Path:
    """One finished tiny flow_grpo run (its checkpoint at step 1), made once for the module: each test resumes a
    copy of it (the refusals below need only a checkpoint of the recipe, not one of their own)."""
    folder = tmp_path_factory.mktemp("t2i_run")
    done = run_cli("train-t2i", str(T2I_TINY / "flow_grpo.yaml"), *COMMON, f"output_dir={folder / 'run'}",
                   "iterations=1", cwd=folder)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return folder / "run"


def _copy(run: Path, tmp_path: Path) -> Path:
    shutil.copytree(run, tmp_path / "run")
    return tmp_path / "run"


@pytest.mark.parametrize(
    "change, named",
    [
        (["model.family=sd15"], ["model.family: 'sd3' in the checkpoint, 'sd15' now"]),
        (["model.lora.rank=4"], ["model.lora.rank: 8 in the checkpoint, 4 now"]),
        (["model.finetune=full"], ["model.finetune: 'lora' in the checkpoint, 'full' now"]),
    ],
)
def test_t2i_resume_with_another_model_is_refused(t2i_run, tmp_path, change, named):
    out = _copy(t2i_run, tmp_path)
    recipe = str(T2I_TINY / "flow_grpo.yaml")
    done = run_cli("train-t2i", recipe, *COMMON, f"output_dir={out}", "iterations=2", "resume=true", *change,
                   cwd=tmp_path)  # fmt: skip
    _refused(done, *named)


def test_t2i_resume_with_another_recipe_is_refused(t2i_run, tmp_path):
    out = _copy(t2i_run, tmp_path)
    done = run_cli("train-t2i", str(T2I_TINY / "diffusion_nft.yaml"), *COMMON, f"output_dir={out}", "iterations=2",
                   "resume=true", cwd=tmp_path)  # fmt: skip
    _refused(done, "method: 'grpo' in the checkpoint, 'nft' now")
    assert Path(out / "checkpoints" / "step_00000001").is_dir()


def test_a_setting_added_since_the_checkpoint_is_no_change_at_its_default():
    """A checkpoint written before a setting existed resumes while the setting keeps its default; set to another
    value, the resume is refused naming it (the checkpoint ran without it)."""
    from flowgrpo.checkpoint import check_resume_config
    from flowgrpo.config import ConfigError

    saved = {"optim": {"lr": 0.1}, "rewards": [{"name": "a"}]}
    defaults = {"optim": {"lr": 0.5, "loss_scale": {"name": "none"}}, "monitor": {"enabled": True}}
    now = {
        "optim": {"lr": 0.1, "loss_scale": {"name": "none"}},
        "rewards": [{"name": "a"}],
        "monitor": {"enabled": True},
    }
    check_resume_config(now, saved, set(), defaults)  # both added keys at their defaults
    with pytest.raises(ConfigError, match=r"optim.loss_scale: \(unset\) in the checkpoint, \{'name': 'dynamic'\} now"):
        check_resume_config({**now, "optim": {"lr": 0.1, "loss_scale": {"name": "dynamic"}}}, saved, set(), defaults)
    with pytest.raises(ConfigError, match="monitor"):  # without the defaults every added key is a change
        check_resume_config(now, saved, set())
