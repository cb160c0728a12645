"""Final-answer extraction and numeric equivalence for verifiable math rewards.

`extract_answer` takes the content of the last \\boxed{...} (or \\fbox{...}), else the last number in
the text. `answers_match` compares two answers numerically when both parse as numbers (integers,
decimals, fractions `a/b` or `\\frac{a}{b}`, thousands separators, percentages, simple LaTeX wrappers),
and as normalised strings otherwise.
"""

from __future__ import annotations

import math
import re
from fractions import Fraction
from typing import Optional

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
_NUMBER = re.compile(
    r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:\s*/\s*\d+(?:\.\d+)?)?"
    r"|[-+]?\.\d+"
)


def last_boxed(text: str) -> Optional[str]:
    """Content of the last \\boxed{...} with balanced braces, or None."""
    starts = [m.end() for m in _BOXED.finditer(text)]
    for start in reversed(starts):
        depth, i = 1, start
        while i < len(text):
            if text[i] == "{":
                depth += 1
            elif text[i] == "}":
                depth -= 1
                if depth == 0:
                    return text[start:i].strip()
            i += 1
    return None


def last_number(text: str) -> Optional[str]:
    found = _NUMBER.findall(text)
    return found[-1].strip() if found else None


def extract_answer(text: str, mode: str = "boxed_or_last") -> Optional[str]:
    """The final answer of a completion: boxed first (`boxed_or_last`), only boxed, or only the last number."""
    if mode not in ("boxed_or_last", "boxed", "last_number"):
        raise ValueError(f"extract mode: expected 'boxed_or_last', 'boxed' or 'last_number', got {mode!r}")
    if mode in ("boxed_or_last", "boxed"):
        boxed = last_boxed(text)
        if boxed is not None or mode == "boxed":
            return boxed
    return last_number(text)


def reference_answer(text: str) -> str:
    """The answer inside a reference: after `####` (GSM8K), inside \\boxed{}, or the text itself."""
    text = str(text)
    if "####" in text:
        return text.split("####")[-1].strip()
    return last_boxed(text) or text.strip()


def _strip_outer_braces(s: str) -> str:
    while len(s) >= 2 and s[0] == "{" and s[-1] == "}":
        depth = 0
        for i, ch in enumerate(s):
            depth += ch == "{"
            depth -= ch == "}"
            if depth == 0 and i < len(s) - 1:
                return s  # "{a}{b}": the first brace closes early
        s = s[1:-1].strip()
    return s


def _strip_latex(s: str) -> str:
    s = s.strip().strip("$").strip().replace("\u2212", "-")
    s = _strip_outer_braces(s)
    s = re.sub(r"\\text\{([^{}]*)\}", r"\1", s)
    s = re.sub(r"\\(?:mathrm|textbf|mathbf)\{([^{}]*)\}", r"\1", s)
    for token in ("\\left", "\\right", "\\!", "\\,", "\\;", "\\:", "\\ ", "^\\circ", "^{\\circ}", "\\displaystyle"):
        s = s.replace(token, "")
    s = re.sub(r"\\[dt]?frac\{([^{}]*)\}\{([^{}]*)\}", r"(\1)/(\2)", s)
    s = re.sub(r"\\[dt]?frac(\d)(\d)", r"\1/\2", s)
    s = s.replace("\\%", "%").replace("\\$", "")
    s = re.sub(r"^[a-zA-Z]\s*=\s*", "", s)  # "x = 5"
    return s.strip().rstrip(".").strip()


def parse_number(s: str) -> Optional[tuple[Fraction, bool]]:
    """(value, was a percentage) of a plain numeric answer, or None if it is not one."""
    s = _strip_latex(s).replace(" ", "")
    percent = s.endswith("%")
    s = s.rstrip("%")
    if re.fullmatch(r"[-+]?\d{1,3}(,\d{3})+(\.\d+)?", s):
        s = s.replace(",", "")
    m = re.fullmatch(r"\(?([-+]?[\d.]+(?:[eE][-+]?\d+)?)\)?/\(?([-+]?[\d.]+(?:[eE][-+]?\d+)?)\)?", s)
    try:
        if m:
            den = Fraction(m.group(2))
            if den == 0:
                return None
            return Fraction(m.group(1)) / den, percent
        if re.fullmatch(r"\(?[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?\)?", s):
            return Fraction(s.strip("()")), percent
    except (ValueError, ZeroDivisionError):
        return None
    return None


def _normalise_text(s: str) -> str:
    return re.sub(r"\s+", "", _strip_latex(s)).lower()


def answers_match(predicted: Optional[str], reference: str, rel_tol: float = 1e-6) -> bool:
    """Numeric equivalence when both sides are numbers (0.5 == 1/2 == \\frac{1}{2}; 50% == 50 or 0.5)."""
    if predicted is None:
        return False
    a, b = parse_number(predicted), parse_number(reference)
    if a is not None and b is not None:
        (va, pa), (vb, pb) = a, b
        candidates = [va] + ([va / 100] if pa and not pb else [])
        targets = [vb] + ([vb / 100] if pb and not pa else [])
        for x in candidates:
            for y in targets:
                if x == y or math.isclose(float(x), float(y), rel_tol=rel_tol, abs_tol=1e-12):
                    return True
        return False
    return _normalise_text(predicted) == _normalise_text(reference)
