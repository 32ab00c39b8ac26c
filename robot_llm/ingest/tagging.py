"""Which instruments a news text mentions, from the ``instruments`` section of the config.

Rules (the example config repeats them next to ``aliases``):

- **The ticker** matches only exactly as written in the config (normally upper case) and as a
  whole word: ``SBER`` finds "SBER" and "$SBER" and "SBER:" but not "Sber", "SBERP" or
  "ASBER"; a ticker ``ON`` finds "ON" but not "on", "ONE" or "MOON".
- **The name and every plain alias** match case-insensitively, as whole words: ``Яндекс``
  finds "ЯНДЕКС" and "яндекс" but not "Яндексу" (use a stem for that); an alias of several
  words matches them separated by any run of spaces.
- **A stem** is an alias ending in ``*``: it matches the stem followed by at most three more
  letters — a Russian case ending. ``Сбербанк*`` finds "Сбербанк", "Сбербанка", "Сбербанку",
  "Сбербанком", "Сбербанками"; ``Газпром*`` finds "Газпрома" but not "Газпромнефть" (another
  company) nor "Газпромбанк".
- **A pattern** is an alias starting with ``re:``: a Python regular expression, matched
  case-insensitively, which must still start and end on a word boundary (we add the
  boundaries). ``re:лукойл\\w{0,3}|lukoil`` is the stem rule spelt out by hand.
- "Whole word" means: not preceded or followed by a letter, digit or underscore of any
  script, so Cyrillic words are bounded correctly (Python's ``\\w`` is Unicode-aware).
- "ё" and "е" are the same letter for matching (Russian texts mostly write "е").
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from robot_llm.config import InstrumentConfig
from robot_llm.errors import RobotLLMError

__all__ = ["Tagger", "TaggingError", "alias_pattern"]

# Not preceded / not followed by a word character of any script.
_START = r"(?<!\w)"
_END = r"(?!\w)"
_STEM_ENDING = r"\w{0,3}"


class TaggingError(RobotLLMError):
    """An alias in the config cannot be compiled."""


def _fold_yo(text: str) -> str:
    return text.replace("ё", "е").replace("Ё", "Е")


def _words(text: str) -> str:
    """An escaped literal whose inner whitespace matches any run of whitespace."""
    return r"\s+".join(re.escape(part) for part in text.split())


def alias_pattern(alias: str) -> str:
    """The regular expression (case-insensitive use) for one name or alias, boundaries included."""
    alias = _fold_yo(alias.strip())
    if alias.startswith("re:"):
        body = alias[3:]
        re.compile(body)  # raises re.error for the caller to report
        return f"{_START}(?:{body}){_END}"
    if alias.endswith("*"):
        stem = alias[:-1].rstrip()
        if not stem:
            raise re.error("a stem needs at least one letter before '*'")
        return f"{_START}{_words(stem)}{_STEM_ENDING}{_END}"
    if not alias:
        raise re.error("empty alias")
    return f"{_START}{_words(alias)}{_END}"


@dataclass(frozen=True)
class _Matcher:
    ticker: str
    exact: re.Pattern[str]  # the ticker, case-sensitive
    words: re.Pattern[str] | None  # name and aliases, case-insensitive


@dataclass(frozen=True)
class Tagger:
    """Finds instrument tickers in text; build once per ingest run with :meth:`from_instruments`."""

    matchers: tuple[_Matcher, ...]

    @classmethod
    def from_instruments(cls, instruments: Iterable[InstrumentConfig]) -> Tagger:
        """Compile every instrument's ticker, name and aliases; TaggingError names a bad alias."""
        matchers = []
        for inst in instruments:
            exact = re.compile(f"{_START}{re.escape(inst.ticker)}{_END}")
            parts = []
            for alias in (inst.name, *inst.aliases):
                try:
                    parts.append(alias_pattern(alias))
                except re.error as exc:
                    raise TaggingError(f"instruments[{inst.ticker}].aliases: cannot use {alias!r}: {exc}") from None
            words = re.compile("|".join(parts), re.IGNORECASE) if parts else None
            matchers.append(_Matcher(inst.ticker, exact, words))
        return cls(tuple(matchers))

    def tag(self, *texts: str) -> tuple[str, ...]:
        """The tickers mentioned in any of ``texts``, in config order."""
        joined = _fold_yo("\n".join(t for t in texts if t))
        found = []
        for m in self.matchers:
            if m.exact.search(joined) or (m.words is not None and m.words.search(joined)):
                found.append(m.ticker)
        return tuple(found)
