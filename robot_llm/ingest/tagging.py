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
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

from robot_llm.config_sections import InstrumentConfig
from robot_llm.errors import RobotLLMError

__all__ = ["Tagger", "TaggingError", "word_forms"]

# Not preceded / not followed by a word character of any script; a word is a run of them.
_START = r"(?<!\w)"
_END = r"(?!\w)"
_WORD = re.compile(r"\w+")
_STEM_LETTERS = 3  # a stem takes at most this many more letters: a Russian case ending
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


class _Rule(NamedTuple):
    """How one ticker, name or alias is looked for.

    Most are single words: looked up among the text's words as a set (``exact``: as written,
    ``word``: lower case, ``stem``: the lower-case stem), so a text is read once whatever the
    number of instruments. Phrases are looked for only when their first word occurs;
    ``re:`` patterns and whatever else is not a plain word are searched in full.
    """

    kind: Literal["exact", "word", "stem", "phrase", "pattern"]
    keys: frozenset[str] = frozenset()  # the spellings (a phrase's first word's; a stem's stem)
    pattern: re.Pattern[str] | None = None  # phrase and pattern: the whole regular expression


def _is_word(text: str) -> bool:
    return _WORD.fullmatch(text) is not None


def _alias_rule(alias: str) -> _Rule:
    """The rule for one name or alias; re.error when it cannot be one."""
    alias = _fold_yo(alias.strip())
    if alias.startswith("re:"):
        return _Rule("pattern", pattern=re.compile(f"{_START}(?:{alias[3:]}){_END}", re.IGNORECASE))
    if alias.endswith("*"):
        stem = alias[:-1].rstrip()
        if not stem:
            raise re.error("a stem needs at least one letter before '*'")
        if _is_word(stem):
            return _Rule("stem", frozenset({stem.lower()}))
        body = _words(stem.split(), inflect=False)
        return _Rule("pattern", pattern=re.compile(rf"{_START}{body}\w{{0,{_STEM_LETTERS}}}{_END}", re.IGNORECASE))
    words = alias.split()
    if not words:
        raise re.error("empty alias")
    if len(words) > 1:
        pattern = re.compile(f"{_START}{_words(words, inflect=True)}{_END}", re.IGNORECASE)
        if _is_word(words[0]):
            return _Rule("phrase", frozenset(_spellings(words[0])), pattern)
        return _Rule("pattern", pattern=pattern)
    if _RUSSIAN_WORD.fullmatch(alias) and not _is_abbreviation(alias):
        forms, ordinary = word_forms(alias)
        if ordinary:
            return _Rule("exact", frozenset(s for f in forms for s in (f[:1].upper() + f[1:], f.upper())))
        return _Rule("word", frozenset(forms))
    if _is_abbreviation(alias):
        return _Rule("exact", frozenset({alias}))
    if _is_word(alias):
        return _Rule("word", frozenset({alias.lower()}))
    return _Rule("pattern", pattern=re.compile(f"{_START}{re.escape(alias)}{_END}", re.IGNORECASE))


def _is_abbreviation(word: str) -> bool:
    return len(word) > 1 and word.isupper() and _RUSSIAN_WORD.fullmatch(word) is not None


def _spellings(word: str) -> tuple[str, ...]:
    """A word of a phrase in lower case: a Russian word in its case forms, others as written."""
    if _RUSSIAN_WORD.fullmatch(word) and not _is_abbreviation(word):
        return word_forms(word)[0]
    return (word.lower(),)


def _words(words: list[str], *, inflect: bool) -> str:
    """The words in sequence, any run of whitespace between them; with ``inflect``, a Russian word in its case forms."""
    return r"\s+".join(_alternatives(_spellings(w)) if inflect else re.escape(w) for w in words)


def _index(rules: Iterable[tuple[int, _Rule]], kind: str) -> dict[str, frozenset[int]]:
    """Spelling -> the instruments whose ``kind`` rules have it."""
    index: dict[str, set[int]] = {}
    for i, rule in rules:
        if rule.kind == kind:
            for key in rule.keys:
                index.setdefault(key, set()).add(i)
    return {key: frozenset(found) for key, found in index.items()}


@dataclass(frozen=True)
class Tagger:
    """Finds instrument tickers in text; build once per ingest run with :meth:`from_instruments`."""

    tickers: tuple[str, ...]
    exact: Mapping[str, frozenset[int]]  # a word as written -> instruments (tickers, names that keep capitals)
    words: Mapping[str, frozenset[int]]  # a lower-case word -> instruments
    stems: Mapping[str, frozenset[int]]  # a lower-case stem -> instruments
    phrases: Mapping[str, tuple[tuple[re.Pattern[str], int], ...]]  # lower-case first word -> (phrase, instrument)
    patterns: tuple[tuple[re.Pattern[str], int], ...]  # searched in every text

    @classmethod
    def from_instruments(cls, instruments: Iterable[InstrumentConfig]) -> Tagger:
        """Compile every instrument's ticker, name and aliases; TaggingError names a bad alias."""
        tickers = []
        rules: list[tuple[int, _Rule]] = []
        for i, inst in enumerate(instruments):
            tickers.append(inst.ticker)
            if _is_word(inst.ticker):
                rules.append((i, _Rule("exact", frozenset({inst.ticker}))))
            else:  # "BRK.B": not one word, but still whole
                rules.append((i, _Rule("pattern", pattern=re.compile(f"{_START}{re.escape(inst.ticker)}{_END}"))))
            for alias in (inst.name, *inst.aliases):
                try:
                    rules.append((i, _alias_rule(alias)))
                except re.error as exc:
                    raise TaggingError(f"instruments[{inst.ticker}].aliases: cannot use {alias!r}: {exc}") from None
        phrases: dict[str, list[tuple[re.Pattern[str], int]]] = {}
        for i, rule in rules:
            if rule.kind == "phrase":
                assert rule.pattern is not None
                for key in rule.keys:
                    phrases.setdefault(key, []).append((rule.pattern, i))
        return cls(
            tickers=tuple(tickers),
            exact=_index(rules, "exact"),
            words=_index(rules, "word"),
            stems=_index(rules, "stem"),
            phrases={key: tuple(found) for key, found in phrases.items()},
            patterns=tuple((r.pattern, i) for i, r in rules if r.kind == "pattern" and r.pattern is not None),
        )

    def tag(self, *texts: str) -> tuple[str, ...]:
        """The tickers mentioned in any of ``texts``, in config order."""
        joined = _fold_yo("\n".join(t for t in texts if t))
        words = set(_WORD.findall(joined))
        lower = set(_WORD.findall(joined.lower()))
        found: set[int] = set()
        for word in words & self.exact.keys():
            found |= self.exact[word]
        for word in lower & self.words.keys():
            found |= self.words[word]
        if self.stems:
            for word in lower:
                for cut in range(max(1, len(word) - _STEM_LETTERS), len(word) + 1):
                    found |= self.stems.get(word[:cut], frozenset())
        for word in lower & self.phrases.keys():
            found.update(i for pattern, i in self.phrases[word] if i not in found and pattern.search(joined))
        found.update(i for pattern, i in self.patterns if i not in found and pattern.search(joined))
        return tuple(self.tickers[i] for i in sorted(found))
