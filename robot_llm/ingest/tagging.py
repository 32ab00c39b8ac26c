"""Which instruments a news text mentions, from the ``instruments`` section of the config.

Rules (the example config and the README repeat them next to ``aliases``):

- **The ticker** matches only exactly as written in the config (normally upper case) and as a
  whole word: ``SBER`` finds "SBER" and "$SBER" and "SBER:" but not "Sber", "SBERP" or
  "ASBER"; a ticker ``ON`` finds "ON" but not "on", "ONE" or "MOON".
- **The name and every plain alias** match as whole words, case-insensitively; an alias of
  several words matches them separated by any run of spaces.
- **A Russian word** in a plain name or alias (Cyrillic letters only, written in the nominative
  as a dictionary gives it) matches its case forms: pymorphy3 reads it, and the forms of that
  reading's lexeme in the same number and gender are what it matches (``Сбербанк`` finds
  "Сбербанка", "Сбербанком"; ``Московская биржа`` finds "Московской бирже"). Nothing else:
  ``Газпром`` does not find "Газпромнефть" or "Газпромбанк", ``Сбер`` does not find
  "сбережения", a surname ``Волков`` finds "Волкова" but not "волка". A proper-noun reading
  (surname, name, place, organisation) wins over an ordinary one. A word pymorphy3 cannot read
  as a nominative (it takes "Алроса" for a genitive) matches only as written: add a stem (``Алрос*``).
- **A name that is also an ordinary word** — a one-word Russian alias that the dictionary also
  knows as a common noun or any other non-name word ("Магнит", "Система", "Полюс", "Волков" as
  the plural genitive of "волк") — matches only with a capital letter or in capitals:
  "Магнита", "МАГНИТА", not "магнита". A sentence that starts with the common noun still
  matches; if that is frequent, use a longer alias ("АФК Система"), which matches in any case.
  A Russian word written in capitals in the alias ("ВТБ", "ПИК") is an abbreviation: it matches
  only in capitals, and is not inflected.
- **A stem** is an alias ending in ``*``: it matches the stem followed by at most three more
  letters, in any case — the old way to catch a Russian case ending, kept as it was.
  ``Газпром*`` finds "Газпрома" but not "Газпромнефть" (another company) nor "Газпромбанк".
- **A pattern** is an alias starting with ``re:``: a Python regular expression, matched
  case-insensitively, which must still start and end on a word boundary (we add the
  boundaries). ``re:лукойл\\w{0,3}|lukoil`` is the stem rule spelt out by hand.
- "Whole word" means: not preceded or followed by a letter, digit or underscore of any
  script, so Cyrillic words are bounded correctly (Python's ``\\w`` is Unicode-aware).
- "ё" and "е" are the same letter for matching (Russian texts mostly write "е").

pymorphy3 is imported, and its dictionaries loaded (about 0.1 s), only when a tagger has a
Russian word to inflect, once per process.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from robot_llm.config import InstrumentConfig
from robot_llm.errors import RobotLLMError

__all__ = ["Tagger", "TaggingError", "word_forms"]

# Not preceded / not followed by a word character of any script.
_START = r"(?<!\w)"
_END = r"(?!\w)"
_STEM_ENDING = r"\w{0,3}"
_RUSSIAN_WORD = re.compile(r"[А-Яа-яЁё]+")
# pymorphy3's grammemes for proper nouns: a reading with one of them is a name, not a word.
_PROPER = frozenset({"Name", "Surn", "Patr", "Geox", "Orgn", "Trad"})


class TaggingError(RobotLLMError):
    """An alias in the config cannot be compiled."""


def _fold_yo(text: str) -> str:
    return text.replace("ё", "е").replace("Ё", "Е")


@functools.cache
def _morph() -> Any:
    """The process's one MorphAnalyzer (its dictionaries take a while to load, and never change)."""
    import pymorphy3

    return pymorphy3.MorphAnalyzer(lang="ru")


@functools.lru_cache(maxsize=4096)
def word_forms(word: str) -> tuple[tuple[str, ...], bool]:
    """The case forms of a Russian word (lower case, "ё" as "е") and whether it is also an ordinary word.

    ``word`` is read as a nominative: the forms are those of its lexeme in the same part of
    speech, number and gender, a proper-noun reading first. Without a nominative reading the
    word alone is returned.
    """
    parses = _morph().parse(word)
    ordinary = any(p.is_known and not _PROPER & p.tag.grammemes for p in parses)
    nominative = sorted((p for p in parses if p.tag.case == "nomn"), key=lambda p: not _PROPER & p.tag.grammemes)
    forms = {_fold_yo(word.lower())}
    if nominative:
        reading = nominative[0]
        tag = reading.tag
        forms.update(
            _fold_yo(f.word)
            for f in reading.lexeme
            if (f.tag.POS, f.tag.number, f.tag.gender) == (tag.POS, tag.number, tag.gender)
        )
    return tuple(sorted(forms)), ordinary


def _alternatives(spellings: Iterable[str]) -> str:
    """A regular expression for any of ``spellings``, their shared beginning factored out."""
    spellings = sorted(set(spellings), key=lambda s: (-len(s), s))
    prefix = spellings[-1]  # the shortest
    while not all(s.startswith(prefix) for s in spellings):
        prefix = prefix[:-1]
    if len(spellings) == 1:
        return re.escape(prefix)
    return re.escape(prefix) + "(?:" + "|".join(re.escape(s[len(prefix) :]) for s in spellings) + ")"


def _alias_rule(alias: str) -> tuple[str, bool]:
    """The regular expression for one name or alias, boundaries included, and whether it is case-sensitive."""
    alias = _fold_yo(alias.strip())
    if alias.startswith("re:"):
        body = alias[3:]
        re.compile(body)  # raises re.error for the caller to report
        return f"{_START}(?:{body}){_END}", False
    if alias.endswith("*"):
        stem = alias[:-1].rstrip()
        if not stem:
            raise re.error("a stem needs at least one letter before '*'")
        return f"{_START}{_words(stem.split(), inflect=False)}{_STEM_ENDING}{_END}", False
    words = alias.split()
    if not words:
        raise re.error("empty alias")
    if len(words) == 1 and _RUSSIAN_WORD.fullmatch(alias):
        if len(alias) > 1 and alias.isupper():
            return f"{_START}{re.escape(alias)}{_END}", True
        forms, ordinary = word_forms(alias)
        if ordinary:
            spellings = [s for f in forms for s in (f[:1].upper() + f[1:], f.upper())]
            return f"{_START}{_alternatives(spellings)}{_END}", True
        return f"{_START}{_alternatives(forms)}{_END}", False
    return f"{_START}{_words(words, inflect=True)}{_END}", False


def _words(words: list[str], *, inflect: bool) -> str:
    """The words in sequence, any run of whitespace between them; with ``inflect``, a Russian word in its case forms."""
    parts = []
    for word in words:
        if inflect and _RUSSIAN_WORD.fullmatch(word) and not (len(word) > 1 and word.isupper()):
            parts.append(_alternatives(word_forms(word)[0]))
        else:
            parts.append(re.escape(word))
    return r"\s+".join(parts)


@dataclass(frozen=True)
class _Matcher:
    ticker: str
    exact: re.Pattern[str]  # the ticker and the names that must keep their capitals, case-sensitive
    words: re.Pattern[str] | None  # the other names and aliases, case-insensitive


@dataclass(frozen=True)
class Tagger:
    """Finds instrument tickers in text; build once per ingest run with :meth:`from_instruments`."""

    matchers: tuple[_Matcher, ...]

    @classmethod
    def from_instruments(cls, instruments: Iterable[InstrumentConfig]) -> Tagger:
        """Compile every instrument's ticker, name and aliases; TaggingError names a bad alias."""
        matchers = []
        for inst in instruments:
            exact = [f"{_START}{re.escape(inst.ticker)}{_END}"]
            parts = []
            for alias in (inst.name, *inst.aliases):
                try:
                    pattern, case_sensitive = _alias_rule(alias)
                except re.error as exc:
                    raise TaggingError(f"instruments[{inst.ticker}].aliases: cannot use {alias!r}: {exc}") from None
                (exact if case_sensitive else parts).append(pattern)
            words = re.compile("|".join(parts), re.IGNORECASE) if parts else None
            matchers.append(_Matcher(inst.ticker, re.compile("|".join(exact)), words))
        return cls(tuple(matchers))

    def tag(self, *texts: str) -> tuple[str, ...]:
        """The tickers mentioned in any of ``texts``, in config order."""
        joined = _fold_yo("\n".join(t for t in texts if t))
        found = []
        for m in self.matchers:
            if m.exact.search(joined) or (m.words is not None and m.words.search(joined)):
                found.append(m.ticker)
        return tuple(found)
