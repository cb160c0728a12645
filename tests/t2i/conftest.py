import pytest

from flowgrpo.t2i import load_t2i_config

from .learning_runs import RECIPES_DIR


@pytest.fixture
def recipe_config(tmp_path):
    """load_t2i_config of a tiny recipe, quiet and writing under tmp_path/<name>."""

    def make(recipe: str, *overrides: str, name: str = "run"):
        return load_t2i_config(
            RECIPES_DIR / f"{recipe}.yaml",
            [
                f"output_dir={tmp_path / name}",
                "progress=false",
                "artifacts.tensorboard=false",
                "artifacts.plot=false",
                *overrides,
            ],
        )

    return make
