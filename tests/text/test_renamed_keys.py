"""Text config keys renamed to the image trainer's names: the old ones still load (a FutureWarning names the new
key), both names at once is an error, and a checkpoint's config saved before the rename reads as today's."""

from __future__ import annotations

import copy
import warnings

import pytest
import yaml

from flowgrpo.config import ConfigError
from flowgrpo.text.config import RENAMED_KEYS, load_text_config, migrate_saved_config

NEW = ["iterations=3", "prompts_per_iteration=3", "group_size=4", "rollout_split=2", "model.lora.rank=4"]
OLD = ["steps=3", "generation.prompts_per_step=3", "generation.group_size=4", "generation.rollout_split=2",
       "model.lora.r=4"]  # fmt: skip


@pytest.fixture
def load(tmp_path):
    """The embedded defaults (no YAML file, which already names the new keys) plus `overrides`."""
    return lambda *overrides: load_text_config(None, [f"output_dir={tmp_path / 'run'}", *overrides])


def test_old_keys_still_load_with_a_warning_naming_the_new_key(load):
    with pytest.warns(FutureWarning) as caught:
        old = load(*OLD, "model.lora.enabled=true")
    messages = [str(w.message) for w in caught if issubclass(w.category, FutureWarning)]
    for before, after in RENAMED_KEYS.items():
        assert any(f"'{before}' is now '{after}'" in m for m in messages), (before, messages)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the new names load without a warning
        new = load(*NEW, "model.lora.enabled=true")
    assert old == new
    assert (new.iterations, new.prompts_per_iteration, new.group_size, new.rollout_split) == (3, 3, 4, 2)
    assert new.model.lora.rank == 4


@pytest.mark.parametrize("old, new", list(zip(OLD, NEW)))
def test_old_and_new_key_in_one_file_is_an_error(tmp_path, old, new):
    """One layer that names a setting twice is ambiguous: refused, naming the new key."""
    (key_old, value), key_new = old.split("="), new.split("=")[0]

    def nested(key: str) -> dict:
        *path, leaf = key.split(".")
        out = node = {}
        for part in path:
            node = node.setdefault(part, {})
        node[leaf] = int(value)
        return out

    from flowgrpo.config import deep_merge

    both = tmp_path / "both.yaml"
    both.write_text(yaml.safe_dump(deep_merge(nested(key_old), nested(key_new))))
    with pytest.raises(ConfigError, match=f"give only '{key_new}'"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            load_text_config(both, [f"output_dir={tmp_path / 'run'}"])


def test_an_old_key_override_wins_over_the_file_s_new_key(tmp_path):
    """The shipped YAMLs name the new keys; a script that still overrides `steps=` sets `iterations`."""
    with pytest.warns(FutureWarning, match="'steps' is now 'iterations'"):
        cfg = load_text_config("configs/text/tiny_pattern.yaml", [f"output_dir={tmp_path / 'run'}", "steps=3"])
    assert cfg.iterations == 3


def test_a_config_saved_before_the_rename_migrates_to_the_new_dump(load):
    """A checkpoint stores `model_dump(mode="json")` of the run's config: the one written before the rename
    (old keys in their old places) reads, silently, as the dump of the same run today."""
    now = load(*NEW).model_dump(mode="json")
    saved = copy.deepcopy(now)  # the same run's dump under the old names
    saved["steps"] = saved.pop("iterations")
    saved["generation"]["prompts_per_step"] = saved.pop("prompts_per_iteration")
    saved["generation"]["group_size"] = saved.pop("group_size")
    saved["generation"]["rollout_split"] = saved.pop("rollout_split")
    saved["model"]["lora"]["r"] = saved["model"]["lora"].pop("rank")
    assert saved != now
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        migrated = migrate_saved_config(saved)
    assert migrated == now
    assert "steps" in saved and "r" in saved["model"]["lora"]  # the caller's dict is left as it was
    assert migrate_saved_config(now) == now  # a config saved after the rename is unchanged
