"""Prompt sets: inline lists, a .txt file (one prompt per line) or a .jsonl file (prompt + metadata)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from ..config import ConfigError, read_text_file
from .edit_data import ImageSpec, edit_prompt, names_images, text_of


@dataclass
class PromptSet:
    prompts: list[str]
    metadata: list[dict[str, Any]] = field(default_factory=list)  # one dict per prompt (may be empty)

    def __post_init__(self) -> None:
        if not self.metadata:
            self.metadata = [{} for _ in self.prompts]

    def __len__(self) -> int:
        return len(self.prompts)

    def take(self, index: list[int]) -> "PromptSet":
        return PromptSet([self.prompts[i] for i in index], [self.metadata[i] for i in index])


# the prompt files scripts/fetch_prompts.py writes: its set name -> the splits it has
FETCHABLE = {"pickscore": ("train", "test"), "pickscore_sfw": ("train", "test"), "hpdv2": ("train", "test"),
             "unigenbench": ("train",), "ocr": ("train", "test"), "dancegrpo_video": ("train",), "refl": ("train",),
             "simple_animals": ("train", "test")}  # fmt: skip


def _fetch_hint(file: Path) -> str:
    """For a missing prompts/<set>_<split>.txt: the command that fetches it."""
    if file.parent.name != "prompts":
        return ""
    name, _, split = file.stem.rpartition("_")
    if file.suffix == ".txt" and split in FETCHABLE.get(name, ()):
        return f"; fetch it: python scripts/fetch_prompts.py {name} (or convert a local copy with --from)"
    return "; the real recipes' prompt sets: python scripts/fetch_prompts.py --check lists them"


def load_prompt_set(
    prompts: Optional[list[str]], path: Optional[str], what: str = "data", images: Optional[ImageSpec] = None
) -> Optional[PromptSet]:
    """Inline prompts or a file; None when neither is given. .jsonl rows may name input images (edit_data.py):
    `images` sets the size they are brought to."""
    if prompts is not None:
        if not prompts or not all(isinstance(p, str) and p for p in prompts):
            raise ConfigError(f"{what}: prompts must be a non-empty list of non-empty strings")
        return PromptSet(list(prompts))
    if path is None:
        return None
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"{what}: prompt file '{path}' does not exist{_fetch_hint(file)}")
    if file.suffix == ".jsonl":
        rows, metas = [], []
        for n, line in enumerate(read_text_file(file, what).splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise ConfigError(f"{what}: {path} line {n} is not JSON: {err}") from None
            text = text_of(row) if isinstance(row, dict) else None
            if not isinstance(text, str):
                raise ConfigError(f"{what}: {path} line {n} needs a string field 'prompt' (or 'instruction')")
            rows.append(edit_prompt(text, row, file, n, what, images) if names_images(row) else text)
            metas.append(row)
        out = PromptSet(rows, metas)
    else:
        out = PromptSet([line.strip() for line in read_text_file(file, what).splitlines() if line.strip()])
    if not out.prompts:
        raise ConfigError(f"{what}: prompt file '{path}' has no prompts")
    return out
