"""What a stored thesis must be: the rules of the store boundary, and how reports classify what was stored.

A thesis row is stored only when it is *valid*: its text is not empty (unless its template
asks for a stance only, ``max_new_tokens: 0``), every label log-probability is a finite
number, and its stance is a finite number in [-1, 1] with a finite score in [0, 1] — or it
is an explicit abstention: the request asked no stance question (its template has none), so
the row carries no stance, no label and no label log-probabilities, or the night had no news
and no signals for it (kind ``no_inputs``: no text, no stance). Anything else is refused
with its reason (:func:`thesis_problem`): the request fails instead, and the previous valid
thesis stays the latest one strategies read.

Reports also count valid-but-poor theses (:func:`is_degenerate`): text with no letter or
digit, or one word repeated over the whole text (a model stuck in a loop).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

__all__ = ["is_degenerate", "thesis_problem"]

_WORD = re.compile(r"\w+", re.UNICODE)


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def thesis_problem(row: Mapping[str, Any]) -> str | None:
    """Why ``row`` (a thesis about to be stored) is invalid, or None when it may be stored.

    What the row must carry follows from its request's ``params``: a stance question
    (``params.stance``) asks for a finite stance, a template with ``max_new_tokens: 0`` asks
    for no text (a stance-only row), and a row of kind ``no_inputs`` is the night's explicit
    "no opinion" (no text, no stance).
    """
    text = row.get("text")
    logprobs = row.get("label_logprobs") or {}
    stance, score = row.get("stance"), row.get("score")
    if row.get("kind") == "no_inputs":
        if text or stance is not None or logprobs:
            return "a 'no inputs' abstention that carries a thesis or a stance (nothing stored)"
        return None
    params = row.get("params") or {}
    asks_stance = params.get("stance") is not None
    asks_text = int(params.get("max_new_tokens", 1)) != 0
    if asks_text and (not isinstance(text, str) or not text.strip()):
        return "the model wrote an empty thesis (nothing stored)"
    if not asks_text and not asks_stance:
        return "a template with no thesis and no stance question stores nothing (nothing stored)"
    bad = sorted(str(k) for k, v in logprobs.items() if not _finite(v))
    if bad:
        return f"non-finite label log-probabilities for {', '.join(repr(b) for b in bad)} (nothing stored)"
    if not asks_stance:
        if stance is not None or logprobs:
            return "a stance on a request that asked no stance question (nothing stored)"
        return None
    if stance is None:
        return "the request asked for a stance and none was scored (nothing stored)"
    if not _finite(stance) or not -1.0 <= stance <= 1.0:
        return f"stance {stance!r} is not a finite number in [-1, 1] (nothing stored)"
    if not _finite(score) or not 0.0 <= score <= 1.0:
        return f"stance score {score!r} is not a finite number in [0, 1] (nothing stored)"
    if not logprobs:
        return "a stance without the label log-probabilities it came from (nothing stored)"
    return None


def is_degenerate(text: str) -> bool:
    """A stored thesis that says nothing: no letter or digit at all, or one word repeated throughout."""
    words = _WORD.findall(text.casefold())
    if not words:
        return True
    return len(words) >= 3 and len(set(words)) == 1
