"""Text-trainer test helpers: one CPU thread (tiny models run fastest so, and runs are bit-exact), tiny configs."""

from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "text" / "tiny_pattern.yaml"


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def tiny_config(tmp_path):
    """`tiny_config(*overrides)`: the CPU toy config, quiet, writing under tmp_path."""
    from flowgrpo.text import load_text_config

    def make(*overrides: str, name: str = "run"):
        base = [f"output_dir={tmp_path / name}", "progress=false", "num_threads=1"]
        return load_text_config(TINY, [*base, *overrides])

    return make
