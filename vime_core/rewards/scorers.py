"""Text scorers on sample.response against sample.label:

    normalise(s) = lower-case, no punctuation or articles a/an/the, whitespace collapsed
    exact_match  = 1.0 if normalise(response) == normalise(label) else 0.0
    f1           = 2 P R / (P + R) over the normalised token multisets (both empty 1.0, one 0.0)

A list label means "any of these": the best score over its items."""

from __future__ import annotations

import re
import string
from collections import Counter

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = str.maketrans("", "", string.punctuation)


def normalise_text(s: str) -> str:
    s = str(s).lower().translate(_PUNCT)
    s = _ARTICLES.sub(" ", s)
    return " ".join(s.split())


def _labels(label) -> list[str]:
    if label is None:
        return []
    return [str(x) for x in label] if isinstance(label, (list, tuple)) else [str(label)]


def exact_match_score(prediction: str, label: str) -> float:
    return 1.0 if normalise_text(prediction) == normalise_text(label) else 0.0


def f1_score(prediction: str, label: str) -> float:
    pred, ref = normalise_text(prediction).split(), normalise_text(label).split()
    if not pred and not ref:
        return 1.0
    common = sum((Counter(pred) & Counter(ref)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(pred), common / len(ref)
    return 2 * precision * recall / (precision + recall)


def exact_match_reward(sample) -> float:
    return max((exact_match_score(sample.response or "", lab) for lab in _labels(sample.label)), default=0.0)


def f1_reward(sample) -> float:
    return max((f1_score(sample.response or "", lab) for lab in _labels(sample.label)), default=0.0)
