"""Registry: names, settings, errors, and the package's import discipline."""

import subprocess
import sys
from pathlib import Path

import pytest

from reward_models import ScorerConfig, UnknownScorerError, available, build_scorer, get_entry, register
from reward_models.registry import unregister

PACKAGE = Path(__file__).resolve().parents[2] / "reward_models"
SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "reward_server.py"
BUILTINS = {
    "brightness",
    "colorfulness",
    "jpeg_compressibility",
    "jpeg_incompressibility",
    "clip_score",
    "pickscore",
    "aesthetic",
    "image_similarity",
    "remote",
    "multi",
    "pointwise_as_pairwise",
    "ocr",
    "vlm_judge",
    "vlm_judge_pairwise",
    "geneval",
}


def test_builtins_are_registered_with_their_kind():
    assert BUILTINS <= set(available())
    assert {"pointwise_as_pairwise", "vlm_judge_pairwise"} <= set(available("pairwise"))
    assert not {"ocr", "vlm_judge", "geneval"} & set(available("pairwise"))
    assert "pickscore" in available("pointwise")


def test_duplicate_name_raises():
    @register("test_dup_scorer")
    def build(*, batch_size: int = 1):
        """A test entry."""

    try:
        with pytest.raises(ValueError, match="already registered"):
            register("test_dup_scorer")(build)
        with pytest.raises(ValueError, match="already registered"):
            register("brightness")(build)
    finally:
        unregister("test_dup_scorer")


def test_unknown_name_lists_valid_names_and_closest():
    with pytest.raises(UnknownScorerError) as info:
        build_scorer("pickscor")
    message = str(info.value)
    assert "did you mean 'pickscore'" in message
    assert all(name in message for name in BUILTINS)


def test_unknown_and_missing_settings_are_errors():
    with pytest.raises(ValueError, match="did you mean 'batch_size'"):
        build_scorer({"name": "brightness", "batchsize": 4})
    with pytest.raises(ValueError, match=r"needs setting\(s\) \['url'\]"):
        build_scorer("remote")


def test_config_forms():
    assert ScorerConfig.parse("brightness") == ScorerConfig("brightness")
    assert ScorerConfig.parse({"name": "brightness", "batch_size": 3}) == ScorerConfig("brightness", {"batch_size": 3})
    with pytest.raises(ValueError, match="needs a 'name'"):
        ScorerConfig.parse({"batch_size": 3})
    scorer = build_scorer(ScorerConfig("brightness", {"batch_size": 3}), key="luma")
    assert scorer.batch_size == 3 and scorer.key == "luma"


def test_entries_expose_settings_with_published_defaults():
    settings = get_entry("pickscore").settings
    assert settings["model"] == "yuvalkirstain/PickScore_v1"
    assert settings["processor"] == "laion/CLIP-ViT-H-14-laion2B-s32B-b79K"
    assert get_entry("clip_score").settings["model"] == "openai/clip-vit-large-patch14"
    assert get_entry("jpeg_compressibility").settings["quality"] == 95


def test_import_is_light():
    code = (
        "import sys, reward_models; heavy = [m for m in ('torch', 'transformers', 'PIL') if m in sys.modules];"
        "assert not heavy, heavy"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_no_trainer_imports_and_no_pickle():
    sources = list(PACKAGE.glob("*.py")) + [SCRIPT]
    for path in sources:
        text = path.read_text()
        for banned in (
            "import flowgrpo",
            "from flowgrpo",
            "import pipelines",
            "from pipelines",
            "import pickle",
            "import dill",
            "import cloudpickle",
        ):
            assert banned not in text, f"{path.name}: {banned}"
