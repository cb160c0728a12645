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

Runs are matched for a comparison by (prompt, index), so that pair must be unique within a run.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from ..config import ConfigError, read_text_file

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp")
_KNOWN_KEYS = ("file", "prompt", "index", "metadata")


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


def read_prompt_file(path: str | Path) -> list[PromptRow]:
    """Rows of a .jsonl or .txt prompt file (see the module docstring)."""
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
        if not isinstance(obj.get("prompt"), str):
            raise EvaluationError(f"{where}: needs a string 'prompt' (keys: {sorted(obj)})")
        file, index, meta = obj.get("file"), obj.get("index"), obj.get("metadata", {})
        if file is not None and not isinstance(file, str):
            raise EvaluationError(f"{where}: 'file' must be a string")
        if index is not None and (not isinstance(index, int) or isinstance(index, bool) or index < 0):
            raise EvaluationError(f"{where}: 'index' must be an int >= 0, got {index!r}")
        if not isinstance(meta, dict):
            raise EvaluationError(f"{where}: 'metadata' must be an object")
        extra = {k: v for k, v in obj.items() if k not in _KNOWN_KEYS}
        rows.append(PromptRow(obj["prompt"], file, index, {**meta, **extra}))
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


def prompt_set(path: str | Path, max_prompts: Optional[int] = None) -> list[PromptRow]:
    """Prompts to generate from: a .txt or .jsonl prompt file without `file` / `index` keys."""
    rows = read_prompt_file(path)
    bad = [n for n, r in enumerate(rows, 1) if r.file is not None or r.index is not None]
    if bad:
        raise EvaluationError(f"{path}: a prompt set for generation takes no 'file' or 'index' (row {bad[0]})")
    rows = rows[:max_prompts] if max_prompts else rows
    if not rows:
        raise EvaluationError(f"{path}: no prompts")
    return rows
