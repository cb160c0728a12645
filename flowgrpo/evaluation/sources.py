"""Image sources: prompt files and folders of images, turned into a list of `Sample`s.

Prompt file formats
-------------------
JSONL (`*.jsonl`), one JSON object per line:
    {"file": "cat_0.png", "prompt": "a cat", "index": 0, "metadata": {"tag": "animals"}}
  - `prompt` (string) is required.
  - `file` is required for an image folder (a path relative to the folder, or absolute) and must not
    be given in a prompt set for generation.
  - `index` (int, optional) tells apart several images of one prompt; without it images are numbered
    0, 1, 2, ... per prompt in the order of the file.
  - `metadata` (object, optional) and every other key (e.g. GenEval's `tag`, `include`) are kept as
    the image's metadata and handed to scorers that read metadata.
TXT (any other suffix): one prompt per line; blank lines are skipped. In an image folder the prompts
  are matched to the image files sorted by file name (the counts must agree); `index` counts the
  images of each prompt in that order.

Image editing: a row may name its input image(s), `"images": [paths]` (or `"image": path`), relative to the
.jsonl file, and give its text as `prompt` or `instruction` (flowgrpo/t2i/edit_data.py). A prompt set for
generation reads them with the trainer's loader (`edit_data.edit_prompt`: each image brought to the generated
size, errors name file:line) and its rows become `EditPrompt`s; an image folder keeps the paths (made absolute)
in the metadata "images". Scoring loads them into metadata["source_images"] (uint8 [3, H, W] tensors).

Videos: a folder may hold clips instead (`.mp4`, animated `.webp` / `.gif`, as flowgrpo/video_io.py writes them),
scored by video scorers (reward_models/video.py); one run holds images or videos, not both (scoring.py).

Runs are matched for a comparison by (prompt, index), so that pair must be unique within a run.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from ..config import ConfigError, read_text_file
from ..t2i.edit_data import ImageSpec, edit_prompt, names_images

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".mp4")  # and videos (flowgrpo/video_io.py)
_KNOWN_KEYS = ("file", "prompt", "index", "metadata")
SOURCES = "images"  # metadata key of an edit's input image paths (absolute, or relative to the run folder)


class EvaluationError(ValueError):
    """Input that cannot be evaluated (missing files, malformed prompt files, ...)."""


@dataclass
class Sample:
    """One image: `file` is absolute, or relative to the run folder that holds it."""

    file: str
    prompt: str
    index: int
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def key(self) -> tuple[str, int]:
        return (self.prompt, self.index)


@dataclass
class PromptRow:
    prompt: str
    file: Optional[str] = None
    index: Optional[int] = None
    metadata: dict[str, Any] = field(default_factory=dict)
    line: int = 0


def read_prompt_file(path: str | Path, images: Optional[ImageSpec] = None) -> list[PromptRow]:
    """Rows of a .jsonl or .txt prompt file (see the module docstring). With `images`, rows naming input images
    are loaded by the trainer's loader into `EditPrompt`s (their metadata gains "images" and "source_images")."""
    path = Path(path)
    if not path.is_file():
        raise EvaluationError(f"prompt file not found: {path}")
    try:
        text = read_text_file(path, "prompt file")
    except ConfigError as err:  # not UTF-8: one line naming the file and the byte
        raise EvaluationError(str(err)) from None
    if path.suffix.lower() != ".jsonl":
        return [PromptRow(line.strip()) for line in text.splitlines() if line.strip()]
    rows = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{n}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as err:
            raise EvaluationError(f"{where}: not JSON ({err.msg})") from None
        if not isinstance(obj, dict):
            raise EvaluationError(f"{where}: expected a JSON object, got {type(obj).__name__}")
        text_key = "prompt" if "prompt" in obj else "instruction"
        if not isinstance(obj.get(text_key), str):
            raise EvaluationError(f"{where}: needs a string 'prompt' (or 'instruction') (keys: {sorted(obj)})")
        file, index, meta = obj.get("file"), obj.get("index"), obj.get("metadata", {})
        if file is not None and not isinstance(file, str):
            raise EvaluationError(f"{where}: 'file' must be a string")
        if index is not None and (not isinstance(index, int) or isinstance(index, bool) or index < 0):
            raise EvaluationError(f"{where}: 'index' must be an int >= 0, got {index!r}")
        if not isinstance(meta, dict):
            raise EvaluationError(f"{where}: 'metadata' must be an object")
        extra = {k: v for k, v in obj.items() if k not in (*_KNOWN_KEYS, text_key)}
        text, meta = obj[text_key], {**meta, **extra}
        if images is not None and names_images(meta):
            try:
                text = edit_prompt(text, meta, path, n, "input.generate.prompts", images)
            except ConfigError as err:
                raise EvaluationError(str(err)) from None
        rows.append(PromptRow(text, file, index, meta, n))
    return rows


def assign_indices(rows: list[PromptRow], where: str) -> list[int]:
    """Each row's index: its own, else 0, 1, ... per prompt in file order; (prompt, index) unique."""
    seen: Counter = Counter()
    out = []
    for row in rows:
        out.append(seen[row.prompt] if row.index is None else row.index)
        seen[row.prompt] += 1
    counts = Counter(zip((r.prompt for r in rows), out))
    dupes = [(key, c) for key, c in counts.items() if c > 1]
    if dupes:
        (prompt, index), c = dupes[0]
        raise EvaluationError(f"{where}: (prompt, index) must be unique, but ({prompt!r}, {index}) occurs {c} times")
    return out


def list_images(folder: Path) -> list[Path]:
    """Image files directly in `folder`, sorted by name."""
    return sorted(
        (p for p in folder.iterdir() if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES), key=lambda p: p.name
    )


def folder_samples(folder: str | Path, prompts: Optional[str | Path] = None) -> list[Sample]:
    """Samples of an image folder with its prompts file (default: prompts.jsonl, else prompts.txt)."""
    folder = Path(folder).resolve()
    if not folder.is_dir():
        raise EvaluationError(f"image folder not found: {folder}")
    if prompts is None:
        found = [folder / n for n in ("prompts.jsonl", "prompts.txt") if (folder / n).is_file()]
        if not found:
            raise EvaluationError(f"{folder} has no prompts.jsonl or prompts.txt; set images.prompts")
        prompts = found[0]
    prompts = Path(prompts)
    rows = read_prompt_file(prompts)
    if prompts.suffix.lower() == ".jsonl":
        missing_file = [i for i, r in enumerate(rows) if r.file is None]
        if missing_file:
            raise EvaluationError(
                f"{prompts}: every line needs a 'file' for an image folder (line {missing_file[0] + 1} has none)"
            )
        files = [Path(r.file) if Path(r.file).is_absolute() else folder / r.file for r in rows]
        absent = [str(f) for f in files if not f.is_file()]
        if absent:
            raise EvaluationError(f"{prompts}: {len(absent)} image file(s) not found, e.g. {absent[:3]}")
        for row in rows:
            _resolve_sources(row, prompts)
    else:
        files = list_images(folder)
        if len(files) != len(rows):
            raise EvaluationError(
                f"{prompts} has {len(rows)} prompts but {folder} has {len(files)} images "
                f"({', '.join(IMAGE_SUFFIXES)}); a .txt prompt file needs one line per image "
                "in sorted file-name order"
            )
    if not rows:
        raise EvaluationError(f"{prompts}: no prompts")
    indices = assign_indices(rows, str(prompts))
    return [Sample(str(f.resolve()), r.prompt, i, r.metadata) for f, r, i in zip(files, rows, indices)]


def _resolve_sources(row: PromptRow, prompts: Path) -> None:
    """An image-folder row's input images ("images" / "image", relative to the prompts file): checked, made absolute."""
    if not names_images(row.metadata):
        return
    where = f"{prompts}:{row.line}"
    names = [row.metadata.pop("image")] if "image" in row.metadata else row.metadata.pop(SOURCES)
    if SOURCES in row.metadata:
        raise EvaluationError(f"{where}: give either 'image' or 'images', not both")
    if not isinstance(names, list) or not names or not all(isinstance(n, str) and n for n in names):
        raise EvaluationError(f"{where}: 'images' must be a non-empty list of paths (relative to the .jsonl file)")
    paths = [(prompts.parent / n).resolve() for n in names]
    absent = [str(p) for p in paths if not p.is_file()]
    if absent:
        raise EvaluationError(f"{where}: input image '{absent[0]}' does not exist")
    row.metadata[SOURCES] = [str(p) for p in paths]


def prompt_set(
    path: str | Path, max_prompts: Optional[int] = None, images: Optional[ImageSpec] = None
) -> list[PromptRow]:
    """Prompts to generate from: a .txt or .jsonl prompt file without `file` / `index` keys (rows naming input
    images become EditPrompts when `images` is given)."""
    rows = read_prompt_file(path, images)
    bad = [n for n, r in enumerate(rows, 1) if r.file is not None or r.index is not None]
    if bad:
        raise EvaluationError(f"{path}: a prompt set for generation takes no 'file' or 'index' (row {bad[0]})")
    rows = rows[:max_prompts] if max_prompts else rows
    if not rows:
        raise EvaluationError(f"{path}: no prompts")
    return rows
