r"""Rule-based math answer checking: reward = 1.0 if equivalent(answer(response), reference) else 0.0.

    answer(text) = the last \boxed{...} (or \fbox{...}), else the last number in the text
    reference    = the label's last \boxed{...}, else what follows its last "####" (GSM8K), else the label

Equivalent: the same string after normalisation ($, spaces, \left/\right, \text{}, a trailing '.',
thousands separators, a leading "x ="), or both numbers (a/b, \frac, percentages) within 1e-6 relative."""

from __future__ import annotations

import math
import re
from fractions import Fraction
from typing import Optional

_NUMBER = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?(?:/\d+)?|-?\.\d+")
_FRAC = re.compile(r"^(-?)\\d?frac\{([^{}]+)\}\{([^{}]+)\}$")
REL_TOL = 1e-6


def extract_boxed(text: str) -> Optional[str]:
    """Content of the last \\boxed{...} / \\fbox{...}, braces balanced; None when absent."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    brace = text.find("{", start)
    if brace < 0:
        # "\boxed 5" form
        rest = text[start:].split(None, 1)
        return rest[1].split("$")[0].strip() if len(rest) > 1 else None
    depth = 0
    for i in range(brace, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[brace + 1 : i]
    return None  # unbalanced


def extract_final_number(text: str) -> Optional[str]:
    matches = _NUMBER.findall(text)
    return matches[-1] if matches else None


def extract_answer(text: str) -> Optional[str]:
    boxed = extract_boxed(text)
    return boxed if boxed is not None else extract_final_number(text)


def normalize(answer: str) -> str:
    s = answer.strip()
    s = re.sub(r"\\text\{([^{}]*)\}", r"\1", s)
    for token in ("\\left", "\\right", "\\!", "\\,", "\\;", "$", " "):
        s = s.replace(token, "")
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = re.sub(r"^[a-zA-Z]\w*=", "", s)  # "x=5" -> "5"
    s = s.rstrip(".")
    if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", s):
        s = s.replace(",", "")
    return s


def to_number(answer: str) -> Optional[float]:
    s = normalize(answer)
    percent = s.endswith("%") or s.endswith("\\%")
    s = s.removesuffix("\\%").removesuffix("%")
    m = _FRAC.match(s)
    try:
        if m:
            value = float(Fraction(m.group(2)) / Fraction(m.group(3)))
            value = -value if m.group(1) else value
        elif re.fullmatch(r"-?\d+/\d+", s):
            value = float(Fraction(s))
        else:
            value = float(s)
    except (ValueError, ZeroDivisionError):
        return None
    if not math.isfinite(value):
        return None
    return value / 100 if percent else value


def is_equiv(prediction: Optional[str], label: object) -> bool:
    if prediction is None or label is None:
        return False
    pred, ref = normalize(str(prediction)), normalize(str(label))
    if pred == ref:
        return True
    a, b = to_number(pred), to_number(ref)
    if a is None or b is None:
        return False
    return math.isclose(a, b, rel_tol=REL_TOL, abs_tol=1e-9)


def reference_answer(label: object) -> Optional[str]:
    """The answer a label states (module docstring); None for no label."""
    if label is None:
        return None
    text = str(label)
    boxed = extract_boxed(text)
    if boxed is not None:
        return boxed
    _, hashes, after = text.rpartition("####")
    return after.strip() if hashes else text


def math_reward(sample) -> float:
    """1.0 when the response's answer (boxed, else last number) matches the label's reference."""
    return 1.0 if is_equiv(extract_answer(sample.response or ""), reference_answer(sample.label)) else 0.0
