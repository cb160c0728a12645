"""Weights a scorer cannot find are one line that names the scorer, the hub id or path and the fix (issue 30);
a misspelt setting names the reward entry's own keys too. The hub errors are built here, not fetched: no network."""

import pytest

from reward_models import build_scorer
from reward_models.registry import ScorerWeightsError, _hub_problem


def _chain(outer: BaseException, inner: BaseException) -> BaseException:
    try:
        try:
            raise inner
        except BaseException as err:
            raise outer from err
    except BaseException as err:
        return err


def test_a_local_path_that_does_not_exist_says_so(tmp_path):
    missing = tmp_path / "no-such-model"
    for name in ("pickscore", "clip_score", "hpsv2", "imagereward", "dino_discriminator"):
        with pytest.raises(ScorerWeightsError) as err:
            build_scorer({"name": name, "model": str(missing)})
        text = str(err.value)
        assert text.startswith(name) and str(missing) in text and "does not exist" in text, text
        assert "Repo id" not in text and "\n" not in text
    with pytest.raises(ScorerWeightsError, match=r"`processor: \./nope` is a local path that does not exist"):
        build_scorer({"name": "pickscore", "model": str(tmp_path), "processor": "./nope"})


def test_not_in_the_cache_offline(monkeypatch):
    from huggingface_hub.errors import LocalEntryNotFoundError

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    err = _chain(OSError("We couldn't connect to 'https://huggingface.co' to load the files"),
                 LocalEntryNotFoundError("cannot find the requested files in the local cache"))  # fmt: skip
    text = _hub_problem("pickscore", {"model": "yuvalkirstain/PickScore_v1", "processor": "laion/CLIP-H"}, err)
    assert text.startswith("pickscore weights not found: `model: yuvalkirstain/PickScore_v1` and `processor:")
    for needle in ("HF_HUB_OFFLINE=1 forbids", "`hf download yuvalkirstain/PickScore_v1`", "`hf download laion/CLIP-H`",
                   "HF_HUB_OFFLINE=0", "point `model:` at a local folder"):  # fmt: skip
        assert needle in text, text
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "0")
    text = _hub_problem("clip_score", {"model": "openai/clip-vit-large-patch14"}, err)
    assert "could not be downloaded" in text and "HF_HUB_OFFLINE=0" not in text


def _http_error(cls, message: str):
    """A hub HTTP error as huggingface_hub raises it (it reads the response's headers)."""
    from types import SimpleNamespace

    return cls(message, response=SimpleNamespace(headers={}, status_code=404, request=None, url=""))


def test_no_such_repo_and_gated_repo():
    from huggingface_hub.errors import GatedRepoError, HFValidationError, RepositoryNotFoundError

    err = _chain(OSError("x"), _http_error(RepositoryNotFoundError, "404 nobody/typo"))
    text = _hub_problem("pickscore", {"model": "nobody/typo", "processor": "laion/CLIP-H"}, err)
    assert text.startswith(
        "pickscore weights not found: `model: nobody/typo` is neither a local folder"
    )  # the one named
    text = _hub_problem("hpsv2", {"model": "xswu/HPSv2"}, _chain(OSError("x"), _http_error(GatedRepoError, "gated")))
    assert "gated" in text and "hf auth login" in text
    assert _hub_problem("hpsv2", {"model": "xswu/HPSv2"}, HFValidationError("bad id")) is not None
    assert _hub_problem("hpsv2", {"model": "xswu/HPSv2"}, RuntimeError("CUDA out of memory")) is None  # not ours
    assert (
        _hub_problem("brightness", {}, _chain(OSError("x"), _http_error(RepositoryNotFoundError, "y"))) is None
    )  # no weights


def test_misspelt_setting_names_weight_and_alias():
    with pytest.raises(ValueError) as err:
        build_scorer({"name": "brightness", "wieght": 2})
    text = str(err.value)
    assert "did you mean 'weight'" in text and "'batch_size', 'key'" in text and "'alias'" in text
