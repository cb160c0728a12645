"""Registry: names, settings, errors, and the package's import discipline."""

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from reward_models import ScorerConfig, UnknownScorerError, available, build_scorer, get_entry, register
from reward_models.registry import unregister, with_settings

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


def test_shared_settings_sections_are_flat_settings_of_every_scorer_that_takes_them():
    from reward_models.encoders import BackboneSettings
    from reward_models.http_client import HttpSettings
    from reward_models.judge_client import JudgeSettings

    sections = {
        HttpSettings: ("remote", "geneval", "vlm_judge", "vlm_judge_pairwise"),
        JudgeSettings: ("vlm_judge", "vlm_judge_pairwise"),
        BackboneSettings: ("clip_score", "pickscore", "aesthetic", "image_similarity"),
    }
    for section, names in sections.items():
        for name in names:
            settings = get_entry(name).settings
            assert {f.name for f in dataclasses.fields(section)} <= set(settings), (name, section.__name__)
    assert get_entry("vlm_judge_pairwise").settings["timeout_s"] == 300.0  # a factory's own default wins
    assert get_entry("remote").settings["timeout_s"] == HttpSettings.__dataclass_fields__["timeout_s"].default


def test_with_settings_passes_every_setting_and_checks_its_defaults():
    @dataclasses.dataclass
    class Section:
        url: str
        retries: int = 3

    @with_settings(Section, retries=5)
    def build(*, batch_size: int = 1, **section):
        """A test factory."""
        return batch_size, section

    register("test_section_scorer")(build)
    try:
        assert build_scorer("test_section_scorer", url="u") == (1, {"url": "u", "retries": 5})
        with pytest.raises(ValueError, match="did you mean 'retries'"):
            build_scorer("test_section_scorer", url="u", retry=1)
        with pytest.raises(ValueError, match=r"needs setting\(s\) \['url'\]"):
            build_scorer("test_section_scorer")
    finally:
        unregister("test_section_scorer")
    with pytest.raises(ValueError, match="name no section field"):
        with_settings(Section, retrys=1)(lambda **section: None)
    with pytest.raises(ValueError, match="given twice"):
        with_settings(Section)(lambda *, url="": None)


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
