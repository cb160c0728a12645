"""Text-trainer test helpers: one CPU thread (tiny models run fastest so, and runs are bit-exact), tiny configs,
and `slow` tests deselected unless `-m slow` is given."""

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


def pytest_collection_modifyitems(config, items):
    """Tests marked `slow` under tests/text run only when asked for (`-m slow`); otherwise they are
    deselected (reported as deselected, not skipped)."""
    if "slow" in (config.getoption("markexpr") or ""):
        return
    here = Path(__file__).resolve().parent
    drop = [it for it in items if it.get_closest_marker("slow") and here in Path(str(it.fspath)).resolve().parents]
    if drop:
        dropped = set(map(id, drop))
        config.hook.pytest_deselected(items=drop)
        items[:] = [it for it in items if id(it) not in dropped]
