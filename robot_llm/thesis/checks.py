"""Checks of a stored thesis against itself and its night: the direction its text states, and degeneration.

A strategy trades on the number and a person reads the sentence, so the two must agree
(:func:`thesis_direction` reads the verdict the sentence states) and the sentence must come
from the news, not from the prompt's worked examples, not echo a headline back, and not be
the same sentence the night already wrote for another instrument (:func:`degeneration_flags`).
No torch, no database: the worker calls these on each row before it is stored.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Iterable

__all__ = [
    "FLAG_DISAGREES",
    "FLAG_ECHO",
    "FLAG_EXAMPLE",
    "FLAG_REPEATED",
    "degeneration_flags",
    "normalised",
    "own_words",
    "thesis_direction",
]

#: The thesis states one direction, its stored stance's sign the other.
FLAG_DISAGREES = "disagrees"
#: The thesis is (a near copy of) a line of the prompt that is not news: a worked example.
FLAG_EXAMPLE = "example_copy"
#: The thesis repeats a news line of its own prompt.
FLAG_ECHO = "headline_echo"
#: The same sentence was already stored for another instrument of this night and template.
FLAG_REPEATED = "repeated"

# Verdict words: what a thesis says the price will do. Stems, matched at a word start.
_UP = {
    "en": (
        "rise",
        "rising",
        "rose",
        "gain",
        "higher",
        "grow",
        "increase",
        "rally",
        "rallies",
        "climb",
        "up ",
        "upside",
        "bullish",
        "support",
        "boost",
        "rebound",
        "outperform",
        "beat",
    ),
    "ru": ("подорож", "рост", "растут", "вырас", "вырос", "повыс", "поддерж", "укреп", "увелич", "позитив", "подним"),
}
_DOWN = {
    "en": (
        "fall",
        "fell",
        "drop",
        "decline",
        "lower",
        "weigh",
        "pressure",
        "down ",
        "downside",
        "bearish",
        "slide",
        "slump",
        "plunge",
        "lose",
        "loss",
        "cut",
        "underperform",
        "miss",
    ),
    "ru": ("подешев", "упад", "паден", "сниж", "сниз", "давя", "давит", "давл", "убыт", "негатив", "ослаб", "потер"),
}
_FLAT = {
    "en": ("flat", "unchanged", "neutral", "sideways", "little impact", "no significant"),
    "ru": ("нейтрал", "без изменен", "не изменит", "вряд ли изменит", "боков", "существенных новостей нет"),
}


def normalised(text: str) -> str:
    """Lower case, NFKC, letters and digits only, single spaces: the form sentences are compared in."""
    text = unicodedata.normalize("NFKC", text).casefold()
    return " ".join(re.sub(r"[^\w%]+", " ", text).split())


def _hits(text: str, stems: Iterable[str]) -> int:
    return sum(1 for stem in stems if re.search(rf"(?<!\w){re.escape(stem.rstrip())}", text) and stem.strip())


def thesis_direction(text: str, language: str) -> int | None:
    """The direction a thesis's own words state: 1 up, -1 down, 0 flat, None when it states none (or both).

    The verdict of the last clause wins when the sentence names both ("the loss weighs on
    the stock, which may rise": up), as the templates' theses put their verdict last.
    """
    lang = "ru" if language.startswith("ru") else "en"
    clauses = [c for c in re.split(r"[;,.:]| but | however | но | однако ", text.casefold()) if c.strip()]
    for clause in reversed(clauses):
        clause = " " + clause + " "
        up, down, flat = _hits(clause, _UP[lang]), _hits(clause, _DOWN[lang]), _hits(clause, _FLAT[lang])
        if flat and not (up or down):
            return 0
        if up != down:
            return 1 if up > down else -1
    return None


def own_words(text: str, verdicts: Iterable[str] = ()) -> str:
    """``text`` without the verdict phrase the night closed it with (``stance.verdicts``): the model's own words."""
    stripped = text.rstrip()
    for phrase in verdicts:
        phrase = phrase.strip()
        if phrase and stripped.endswith(phrase):
            return stripped[: -len(phrase)].rstrip("; ")
    return text


def degeneration_flags(
    text: str, prompt: str, news: Iterable[str], seen: Iterable[str], verdicts: Iterable[str] = ()
) -> list[str]:
    """Which degenerations a thesis shows: a copied prompt line (worked example), an echoed news line, a repeat.

    ``news`` are the texts of the news items shown in the prompt (title and summary: a prompt line
    that shows part of one, a headline, is a news line too), ``seen`` the sentences already stored
    for other instruments of the night, ``verdicts`` the phrases the night closes theses with: the
    model's own words are compared (:func:`own_words`), not the template's phrase. Near copies count:
    compared in :func:`normalised` form, a thesis that a prompt line contains (or that contains it)
    and is at least half its length.
    """
    verdicts = tuple(verdicts)
    mine = normalised(own_words(text, verdicts))
    if not mine:
        return []
    news_forms = [n for n in (normalised(n) for n in news) if n]
    news_lines, other_lines = [], []
    for line in prompt.splitlines():
        _, _, tail = line.partition(":")
        form = normalised(tail if tail else line)
        if form:
            shown = any(n in form or form in n for n in news_forms)
            (news_lines if shown else other_lines).append(form)

    def near(a: str, b: str) -> bool:
        short, long = sorted((a, b), key=len)
        return bool(short) and short in long and 2 * len(short) >= len(long)

    flags: list[str] = []
    if any(near(mine, n) for n in (*news_forms, *news_lines)):
        flags.append(FLAG_ECHO)
    if any(near(mine, form) for form in other_lines):
        flags.append(FLAG_EXAMPLE)
    if mine in {normalised(own_words(s, verdicts)) for s in seen}:
        flags.append(FLAG_REPEATED)
    return flags
