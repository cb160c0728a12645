"""Prompts: JSONL rows or a built-in generated task, rendered (chat template) and tokenised up front.

Every row is checked when the data is loaded, so bad input fails before any training: a row without
the prompt field or without a column a reward needs, and a prompt too long for the model's context,
raise `DataError` naming the row (and its line in the file).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Optional


from .config import TextDataConfig


class DataError(ValueError):
    """A dataset that cannot be used; the message names the row."""


# --- built-in tasks -----------------------------------------------------------------------------

TASKS: dict[str, Callable[..., list[dict[str, Any]]]] = {}


def task(name: str):
    def register(fn):
        if name in TASKS:
            raise ValueError(f"task '{name}' is already registered")
        TASKS[name] = fn
        return fn

    return register


@task("pattern")
def pattern_task(
    *, rows: int = 64, targets: str = "a", seed: int = 0, template: str = "Write {target} again and again: "
) -> list[dict[str, Any]]:
    """Toy task for tests and demos: emit the target text; the `target` column feeds `target_pattern`."""
    rng = random.Random(seed)
    return [{"prompt": template.format(target=t), "target": t} for t in (rng.choice(targets) for _ in range(rows))]


@task("arithmetic")
def arithmetic_task(
    *,
    rows: int = 256,
    max_operand: int = 20,
    ops: str = "+-*",
    seed: int = 0,
    template: str = "What is {a} {op} {b}? Put the final answer in \\boxed{{}}.",
) -> list[dict[str, Any]]:
    """Generated arithmetic questions with an `answer` column (for `math_answer`)."""
    rng = random.Random(seed)
    out = []
    for _ in range(rows):
        a, b, op = rng.randint(0, max_operand), rng.randint(0, max_operand), rng.choice(ops)
        value = {"+": a + b, "-": a - b, "*": a * b}[op]
        out.append({"prompt": template.format(a=a, b=b, op=op), "answer": str(value)})
    return out


@task("echo")
def echo_task(
    *,
    rows: int = 64,
    words: str = "red green blue cat dog sun moon tree",
    min_words: int = 2,
    max_words: int = 5,
    seed: int = 0,
    template: str = "Repeat: {text}\n",
) -> list[dict[str, Any]]:
    """Repeat a short random sentence; the `reference` column feeds `bleu` / `semantic_similarity`."""
    vocab = words.split()
    if not vocab or not 1 <= min_words <= max_words:
        raise ValueError("echo: need some words and 1 <= min_words <= max_words")
    rng = random.Random(seed)
    out = []
    for _ in range(rows):
        text = " ".join(rng.choice(vocab) for _ in range(rng.randint(min_words, max_words)))
        out.append({"prompt": template.format(text=text), "reference": text})
    return out


# --- loading ------------------------------------------------------------------------------------


@dataclass
class PromptData:
    """Rows with their rendered prompts and token ids; `where(i)` says where row i came from."""

    rows: list[dict[str, Any]]
    prompt_ids: list[list[int]]
    conversational: list[bool]
    source: str
    line_numbers: Optional[list[int]] = None

    def __len__(self) -> int:
        return len(self.rows)

    def where(self, i: int) -> str:
        if self.line_numbers is not None:
            return f"data row {i} ({self.source} line {self.line_numbers[i]})"
        return f"data row {i} ({self.source})"


def read_jsonl(path: str | Path) -> tuple[list[dict[str, Any]], list[int]]:
    path = Path(path)
    if not path.is_file():
        raise DataError(f"data file not found: {path}")
    rows, lines = [], []
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise DataError(f"{path} is not UTF-8 text (byte {err.start}); save it as UTF-8") from None
    for n, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise DataError(f"{path} line {n}: not valid JSON ({err.msg})") from None
        if not isinstance(row, dict):
            raise DataError(f"{path} line {n}: expected a JSON object, got {type(row).__name__}")
        rows.append(row)
        lines.append(n)
    if not rows:
        raise DataError(f"{path}: no rows")
    return rows, lines


def render_prompt(prompt: Any, tokenizer, cfg: TextDataConfig, where: str) -> tuple[list[int], bool]:
    """Token ids of one prompt and whether it is conversational (a list of chat messages).

    With a chat template (and `chat_template: true`) a string prompt becomes one user message and the
    generation prompt is added; without one, the string is tokenised as is.
    """
    conversational = isinstance(prompt, list)
    if not conversational and not isinstance(prompt, str):
        raise DataError(f"{where}: the prompt must be a string or a list of chat messages, got {type(prompt).__name__}")
    use_template = cfg.chat_template and getattr(tokenizer, "chat_template", None)
    if conversational and not use_template:
        raise DataError(
            f"{where}: a conversational prompt needs a tokenizer with a chat template (and data.chat_template: true)"
        )
    if use_template:
        messages = list(prompt) if conversational else [{"role": "user", "content": prompt}]
        if cfg.system_prompt and not any(m.get("role") == "system" for m in messages):
            messages = [{"role": "system", "content": cfg.system_prompt}] + messages
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    else:
        text = prompt if cfg.system_prompt is None else f"{cfg.system_prompt}\n{prompt}"
        ids = tokenizer(text)["input_ids"]
    if not ids:
        raise DataError(f"{where}: the prompt is empty after tokenisation")
    return list(ids), conversational


def load_prompts(
    cfg: TextDataConfig,
    tokenizer,
    *,
    context_length: Optional[int],
    max_new_tokens: int,
    required_columns: dict[str, Iterable[str]] | None = None,
) -> PromptData:
    """Read, check and tokenise every row.

    required_columns: {reward name: columns it needs}; a row without one of them is an error.
    context_length: the model's context; prompt tokens + max_new_tokens must fit in it.
    """
    if cfg.path is not None:
        rows, lines = read_jsonl(cfg.path)
        source = str(cfg.path)
    else:
        if cfg.task.name not in TASKS:
            raise DataError(f"unknown built-in task '{cfg.task.name}'; valid tasks: {sorted(TASKS)}")
        try:
            rows = TASKS[cfg.task.name](**cfg.task.settings)
        except TypeError as err:
            raise DataError(f"task '{cfg.task.name}': {err}") from None
        lines, source = None, f"built-in task '{cfg.task.name}'"
    if cfg.max_rows is not None:
        rows = rows[: cfg.max_rows]
        lines = lines[: cfg.max_rows] if lines else lines
    data = PromptData(rows, [], [], source, lines)
    reserved = {"prompts", "completions", "completion_ids", "trainer_state"}  # reward-function arguments
    needs = {col: reward for reward, cols in (required_columns or {}).items() for col in cols}
    for i, row in enumerate(rows):
        if cfg.prompt_field not in row:
            raise DataError(
                f"{data.where(i)} has no prompt field '{cfg.prompt_field}' (data.prompt_field); its keys: {sorted(row)}"
            )
        clash = reserved & set(row)
        if clash:
            raise DataError(
                f"{data.where(i)} has a column named {sorted(clash)[0]!r}, which is a reward-function "
                f"argument; rename it"
            )
        for col, reward in needs.items():
            if col not in row:
                raise DataError(
                    f"{data.where(i)} has no column '{col}', which reward '{reward}' needs; its keys: {sorted(row)}"
                )
        ids, conv = render_prompt(row[cfg.prompt_field], tokenizer, cfg, data.where(i))
        if context_length is not None and len(ids) + max_new_tokens > context_length:
            raise DataError(
                f"{data.where(i)}: the prompt has {len(ids)} tokens; with "
                f"generation.max_new_tokens={max_new_tokens} that exceeds the model context of "
                f"{context_length} tokens (shorten the prompt or lower max_new_tokens)"
            )
        data.prompt_ids.append(ids)
        data.conversational.append(conv)
    return data
