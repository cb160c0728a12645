"""OCR reward: does the image show the text quoted in the prompt?

Recipe (Flow-GRPO's OCR reward, flow_grpo/ocr.py of its release):
  target     = the text between the first pair of double quotes in the prompt, or the metadata
               field `ocr_target` when given (a None entry falls back to the prompt);
  recognised = every word the engine read with confidence > min_confidence, concatenated;
  both strings are lower-cased and stripped of whitespace;
  distance   = 0 if the target is a substring of the recognised text, else the Levenshtein
               distance between the two strings (rapidfuzz), capped at len(target);
  reward     = 1 - distance / len(target), in [0, 1].
Differences from the reference, on purpose: a prompt without a quoted pair (Flow-GRPO: an
IndexError that crashed the call; a lone quote took the rest of the prompt), an empty target
(ZeroDivisionError) and an engine failure on one image (Flow-GRPO: reward 0) are NaN, "could not
score", and counted in counters["no_target"] / ["ocr_errors"]. Whitespace of every kind is
removed, not only spaces. Curly quotes (“...”) count as quotes too.
Extra output: '<key>/distance', the capped edit distance. `last_texts` keeps the recognised text
of the last batch for logging.

Engines: anything with read(image: PIL.Image) -> [(text, confidence in [0, 1]), ...]. Built in:
"tesseract" (Tesseract 5 through pytesseract; needs the `tesseract` binary: Debian/Ubuntu
`apt-get install tesseract-ocr`, plus `tesseract-ocr-<lang>` for languages other than English).
Flow-GRPO used PaddleOCR 2.9 (PP-OCRv4), which reads scene text better than Tesseract; reward
values from the two engines are not comparable. Plug another engine with OCR_ENGINES or pass an
engine object to OCRScorer.
"""

from __future__ import annotations

import math
import re
import shutil
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Protocol

import torch
from PIL import Image

from .base import Scorer
from .registry import register

INSTALL_HINT = (
    "install it with `apt-get install tesseract-ocr` (Debian/Ubuntu; `brew install tesseract` on "
    "macOS) or set tesseract_cmd to the binary's path"
)
_QUOTED = re.compile(r'"([^"]*)"|“([^”]*)”')
_SPACE = re.compile(r"\s+")


class OCREngineError(RuntimeError):
    """The OCR engine cannot run (binary, package or language data missing)."""


class OCREngine(Protocol):
    name: str

    def read(self, image: Image.Image) -> list[tuple[str, float]]:
        """Words or lines read in the image, each with a confidence in [0, 1]."""


class TesseractEngine:
    """Tesseract through pytesseract. `config` holds extra command-line options; the default page
    segmentation mode 11 ("sparse text, as much as possible, in no particular order") suits
    signs and captions in generated images better than mode 3 (a page of text) [our choice, not
    from a reference]."""

    name = "tesseract"

    def __init__(self, *, cmd: str | None = None, lang: str = "eng", config: str = "--psm 11", timeout_s: float = 30.0):
        try:
            import pytesseract
        except ImportError:
            raise OCREngineError(
                "the OCR engine 'tesseract' needs the Python package pytesseract "
                "(pip install pytesseract) and the tesseract binary: " + INSTALL_HINT
            ) from None
        binary = cmd or pytesseract.pytesseract.tesseract_cmd
        if shutil.which(binary) is None:
            raise OCREngineError(f"tesseract binary {binary!r} not found; " + INSTALL_HINT)
        if cmd is not None:
            # pytesseract keeps the binary in module state: every engine in the process shares it.
            pytesseract.pytesseract.tesseract_cmd = cmd
        try:
            languages = set(pytesseract.get_languages(config=""))  # also proves the binary runs
        except (pytesseract.TesseractNotFoundError, pytesseract.TesseractError, OSError) as e:
            raise OCREngineError(f"tesseract binary {binary!r} does not run ({e}); " + INSTALL_HINT) from None
        missing = [part for part in lang.split("+") if part not in languages]
        if missing:
            raise OCREngineError(
                f"tesseract has no language data for {missing} (installed: {sorted(languages)}); "
                f"install it with `apt-get install "
                f"{' '.join('tesseract-ocr-' + m for m in missing)}`"
            )
        self._pytesseract = pytesseract
        self.lang, self.config, self.timeout_s = lang, config, float(timeout_s)

    def read(self, image: Image.Image) -> list[tuple[str, float]]:
        out = self._pytesseract.image_to_data(
            image, lang=self.lang, config=self.config, timeout=self.timeout_s, output_type=self._pytesseract.Output.DICT
        )
        words = []
        for text, conf in zip(out["text"], out["conf"]):
            text, conf = str(text).strip(), float(conf)
            if text and conf >= 0:  # -1: a layout row (block, line), not a word
                words.append((text, conf / 100.0))
        return words


OCR_ENGINES: dict[str, Callable[..., OCREngine]] = {"tesseract": TesseractEngine}


def quoted_target(prompt: str) -> str | None:
    """The text between the first pair of quotes ("..." or “...”), or None."""
    m = _QUOTED.search(prompt)
    if m is None:
        return None
    return m.group(1) if m.group(1) is not None else m.group(2)


def normalise(text: str) -> str:
    return _SPACE.sub("", text).lower()


def ocr_distance(recognised: str, target: str, substring_match: bool = True) -> tuple[float, int]:
    """(reward, capped distance) for normalised strings; target must be non-empty. `substring_match`: the target
    found inside the read text is distance 0 (Flow-GRPO's image OCR); False: the plain edit distance (its video OCR)."""
    from rapidfuzz.distance import Levenshtein

    if substring_match and target in recognised:
        dist = 0
    else:
        dist = min(Levenshtein.distance(recognised, target), len(target))
    return 1.0 - dist / len(target), dist


class OCRScorer(Scorer):
    name = "ocr"
    requires_prompts = True

    def __init__(
        self,
        engine: OCREngine,
        *,
        min_confidence: float = 0.0,
        workers: int = 4,
        batch_size: int = 32,
        key: str | None = None,
        substring_match: bool = True,
    ):
        super().__init__(batch_size=batch_size, key=key)
        self.substring_match = bool(substring_match)
        if not callable(getattr(engine, "read", None)):
            raise TypeError(f"an OCR engine needs a read(image) method, got {type(engine).__name__}")
        if int(workers) < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        self.engine, self.min_confidence, self.workers = engine, float(min_confidence), int(workers)
        self.last_texts: list[str | None] = []
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    def _read(self, image: Image.Image) -> str | None:
        try:
            words = self.engine.read(image)
        except Exception:  # noqa: BLE001 - one unreadable image is NaN, counted
            with self._lock:
                self.counters["ocr_errors"] += 1
            return None
        return " ".join(text for text, conf in words if conf > self.min_confidence)

    def __call__(self, images, prompts=None, metadata=None):
        self.last_texts = []
        return super().__call__(images, prompts, metadata)

    def score_batch(self, images, prompts, metadata):
        overrides = metadata.get("ocr_target", [None] * len(prompts))
        targets = []
        for prompt, override in zip(prompts, overrides):
            target = override if override is not None else quoted_target(prompt)
            target = None if target is None else normalise(str(target))
            if not target:
                self.counters["no_target"] += 1
                target = None
            targets.append(target)
        todo = [i for i, t in enumerate(targets) if t is not None]
        pil = images.pil()
        if self.workers > 1 and len(todo) > 1:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=self.workers, thread_name_prefix="ocr")
            texts = list(self._pool.map(self._read, [pil[i] for i in todo]))
        else:
            texts = [self._read(pil[i]) for i in todo]
        recognised: list[str | None] = [None] * len(prompts)
        reward = torch.full((len(prompts),), float("nan"))
        distance = torch.full((len(prompts),), float("nan"))
        for i, text in zip(todo, texts):
            recognised[i] = text
            if text is not None:
                r, d = ocr_distance(normalise(text), targets[i], self.substring_match)
                reward[i], distance[i] = r, float(d)
        self.last_texts.extend(recognised)
        return {self.key: reward, f"{self.key}/distance": distance}

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False)
            self._pool = None


@register("ocr")
def build_ocr(
    *,
    engine: "str | OCREngine" = "tesseract",
    tesseract_cmd: str | None = None,
    lang: str = "eng",
    tesseract_config: str = "--psm 11",
    timeout_s: float = 30.0,
    min_confidence: float = 0.0,
    workers: int = 4,
    batch_size: int = 32,
    key: str | None = None,
    substring_match: bool = True,
) -> OCRScorer:
    """Flow-GRPO OCR reward: 1 - min(1, edit distance / len(target)), target quoted in the prompt."""
    if isinstance(engine, str):
        if engine not in OCR_ENGINES:
            raise ValueError(f"unknown OCR engine {engine!r}; available: {sorted(OCR_ENGINES)}")
        if engine == "tesseract":
            engine = TesseractEngine(cmd=tesseract_cmd, lang=lang, config=tesseract_config, timeout_s=timeout_s)
        else:
            engine = OCR_ENGINES[engine]()
    if not math.isfinite(float(min_confidence)):
        raise ValueError("min_confidence must be finite")
    return OCRScorer(
        engine, min_confidence=min_confidence, workers=workers, batch_size=batch_size, key=key,
        substring_match=substring_match,
    )  # fmt: skip
