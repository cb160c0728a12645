"""Image-conditioned prompt rows: .jsonl rows naming input images, resized as the pipelines do, one-line errors
naming file:line, the sources reaching scorers as metadata["source_images"], grids showing source | edits, and
the tiny editing recipes learning (heavy)."""

import json

import numpy as np
import pytest
import torch
from PIL import Image

from flowgrpo.config import ConfigError
from flowgrpo.t2i.data import load_prompt_set
from flowgrpo.t2i.edit_data import ImageSpec, check_family, with_sources
from pipelines.adapters.editing import EditPrompt

from .learning_runs import learning_margin

SPEC = ImageSpec(32, 32)


def write(tmp_path, rows, name="rows.jsonl"):
    path = tmp_path / name
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def png(path, size=(32, 32), color=(200, 10, 10)):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, color).save(path)
    return path


def test_rows_name_images_relative_to_the_file_and_carry_them_as_uint8_tensors(tmp_path):
    png(tmp_path / "img" / "a.png", (64, 48), (255, 0, 0))
    png(tmp_path / "img" / "b.png", color=(0, 0, 255))
    path = write(tmp_path, [
        {"prompt": "make it blue", "images": ["img/a.png"], "task": "color"},
        {"instruction": "swap them", "images": ["img/a.png", "img/b.png"]},
        {"prompt": "make it green", "image": "img/b.png"},
        {"prompt": "a plain text-to-image row"},
    ])  # fmt: skip
    ps = load_prompt_set(None, path, images=SPEC)
    a, b, c, plain = ps.prompts
    assert (
        isinstance(a, EditPrompt)
        and a == "make it blue"
        and str(b) == "swap them"
        and not isinstance(plain, EditPrompt)
    )
    assert [len(p.images) for p in (a, b, c)] == [1, 2, 1]
    assert a.images[0].dtype == torch.uint8 and a.images[0].shape == (3, 32, 32)  # 64 x 48 resized to 32 x 32
    assert a.images[0][:, 5, 5].tolist() == [255, 0, 0] and c.images[0][:, 0, 0].tolist() == [0, 0, 255]
    meta = ps.metadata[1]
    assert meta["images"] == [str(tmp_path / "img" / "a.png"), str(tmp_path / "img" / "b.png")]
    assert all(s is t for s, t in zip(meta["source_images"], b.images))  # the tensors the model is conditioned on
    assert (
        ps.metadata[0]["task"] == "color" and "prompt" not in ps.metadata[0] and "source_images" not in ps.metadata[3]
    )
    taken = ps.take([1])
    assert taken.prompts[0] is b and taken.metadata[0]["source_images"][1] is b.images[1]


def test_resize_modes_follow_the_pipelines_image_processor(tmp_path):
    image = Image.new("RGB", (64, 32), (0, 0, 0))
    image.paste((255, 255, 255), (16, 0, 48, 32))  # white middle half, black sides
    image.save(tmp_path / "wide.png")
    path = write(tmp_path, [{"prompt": "x", "images": ["wide.png"]}])
    squashed = load_prompt_set(None, path, images=ImageSpec(32, 32, "resize")).prompts[0].images[0]
    cropped = load_prompt_set(None, path, images=ImageSpec(32, 32, "crop")).prompts[0].images[0]
    assert squashed[:, 16, 0].tolist() == [0, 0, 0] and squashed[:, 16, 16].tolist() == [255, 255, 255]
    assert bool((cropped == 255).all())  # the centre 32 x 32 of the 64 x 32 image (scaled to cover): all white


def test_bad_rows_are_one_line_errors_naming_file_and_line(tmp_path):
    png(tmp_path / "ok.png")
    png(tmp_path / "big.png", (48, 32))
    (tmp_path / "broken.png").write_bytes(b"\x89PNG not really")
    cases = [
        ({"prompt": "x", "images": ["missing.png"]}, "does not exist", SPEC),
        ({"prompt": "x", "images": ["broken.png"]}, "cannot be read", SPEC),
        ({"prompt": "x", "images": ["big.png"]}, r"is 48x32 px; data.image_resize 'exact' needs 32x32", ImageSpec(32, 32, "exact")),
        ({"prompt": "x", "images": "ok.png"}, "must be a non-empty list", SPEC),
        ({"prompt": "x", "images": []}, "must be a non-empty list", SPEC),
        ({"prompt": "x", "image": "ok.png", "images": ["ok.png"]}, "either 'image' or 'images'", SPEC),
        ({"images": ["ok.png"]}, "line 2 needs a string field 'prompt' \\(or 'instruction'\\)", SPEC),
        ({"prompt": "x", "images": ["ok.png"]}, "this prompt set takes none", None),
    ]  # fmt: skip
    for row, message, spec in cases:
        path = write(tmp_path, [{"prompt": "fine", "images": ["ok.png"]}, row])
        with pytest.raises(ConfigError, match=message) as err:
            load_prompt_set(None, path, images=spec)
        assert "\n" not in str(err.value)
        if spec is not None and "line 2" not in message:
            assert f"{path}:2" in str(err.value)


def test_families_and_rows_must_agree():
    edit, plain = EditPrompt("x", [torch.zeros(3, 4, 4, dtype=torch.uint8)]), "a cat"
    check_family([edit], "flux_kontext")
    check_family([plain], "sd3")
    with pytest.raises(ConfigError, match="'qwenimage_edit' edits images: every prompt row needs 'images'.*1 of 2"):
        check_family([edit, plain], "qwenimage_edit")
    with pytest.raises(ConfigError, match="1 prompt rows name input images, but model family 'flux' does not edit"):
        check_family([edit, plain], "flux")


def test_grid_rows_start_with_their_sources():
    red = torch.zeros(3, 8, 8, dtype=torch.uint8)
    red[0] = 255
    blue = torch.zeros(3, 16, 16, dtype=torch.uint8)
    blue[2] = 255
    edits = torch.full((4, 3, 8, 8), 0.5)  # 2 prompts x 2 images
    out, cols = with_sources(edits, [EditPrompt("a", [red, blue]), EditPrompt("b", [red])], 2)
    assert cols == 4 and out.shape == (8, 3, 8, 8)
    assert out[0, 0].eq(1).all() and out[1, 2].eq(1).all() and out[2].eq(0.5).all()  # red | blue (resized) | edits
    assert out[4, 0].eq(1).all() and out[5].eq(0).all() and out[6:].eq(0.5).all()  # red | black pad | edits
    assert with_sources(edits, ["a", "b"], 2) == (edits, 2)


def test_an_edit_run_passes_sources_to_scorers_and_draws_source_edit_grids(recipe_config, tmp_path, monkeypatch):
    from reward_models.toy import BrightnessScorer as Brightness

    from flowgrpo.t2i import train_t2i

    seen = []
    original = Brightness.score_batch

    def spy(self, images, prompts, metadata):
        seen.append((list(prompts), metadata.get("source_images")))
        return original(self, images, prompts, metadata)

    monkeypatch.setattr(Brightness, "score_batch", spy)
    cfg = recipe_config(
        "kontext_edit", "iterations=1", "group_size=2", "prompts_per_iteration=1", "sampler.num_steps=2",
        "artifacts.grid_every=1", "checkpoint.save_final_model=false", "data.shuffle=false",
    )  # fmt: skip
    (record,) = train_t2i(cfg)
    assert record["check/first_pass_ratio_dev"] < 1e-5  # the first training pass re-scores the rollout at ratio 1
    rollout = [(p, s) for p, s in seen if len(p) == 2]  # (the evaluations before / after score 4 prompts x 1)
    assert len(rollout) == 1
    prompts, sources = rollout[0]
    assert prompts == ["make the square brighter"] * 2 and len(sources) == 2
    red = torch.from_numpy(np.asarray(Image.open("configs/t2i/tiny/edit_data/red_square.png").convert("RGB")))
    assert all(len(s) == 1 and torch.equal(s[0], red.permute(2, 0, 1)) for s in sources)
    grid = Image.open(next((tmp_path / "run" / "grids").glob("rollout_*.png")))
    assert grid.size == (3 * 32, 32)  # source | 2 edits
    assert torch.equal(torch.from_numpy(np.asarray(grid))[:, :32], red)


@pytest.mark.heavy
@pytest.mark.parametrize("recipe", ["kontext_edit", "qwenimage_edit", "klein_edit"])
def test_edit_recipe_learns(recipe, tmp_path):
    # 8 iterations: the gain is 15 (qwenimage_edit), 45 (kontext_edit) and 52 (klein_edit: one trained SDE step;
    # 5 to 50 at seeds 3, 5, 7, 9, 11) standard errors there, 3x the margin
    m = learning_margin(recipe, tmp_path, iterations=8)
    assert m["first_learn"] == pytest.approx(m["first_still"], abs=1e-7), m
    assert m["gain"] > 5.0 * m["noise"] and m["gain"] > 0, m
