"""Which character encoding a fetched feed document is really in.

feedparser decodes a document by what it declares (the BOM, the HTTP ``charset``, the XML
declaration) and, when none of those decodes it, by chardet's guess: feedparser calls chardet
itself when it is installed, and it is one of our dependencies. So an undeclared KOI8-R,
TIS-620, Shift_JIS, EUC-KR or GB2312 feed is read right by feedparser alone.

One case is left over: a declaration (or feedparser's default for none) that is wrong but
decodes anyway. Every byte is a character in a single-byte code page, so Russian windows-1251
declared as windows-1252 or iso-8859-1 decodes without error into "Àêöèè Ñáåðáàíêà".
:func:`better_encoding` asks chardet about the bytes themselves and names the encoding to
re-read the document in when the one feedparser used is implausible:

- a document in pure ASCII, or decoded as UTF-8/16/32, is taken as it is (bytes that happen to
  be valid UTF-8 are practically never anything else);
- otherwise the used encoding stands when it decodes the document into the same text as one
  of chardet's plausible candidates (confidence at least half the best one's); a Latin-1
  declaration for French text is "plausible" even where chardet prefers windows-1252;
- otherwise chardet's best candidate is the answer, if it decodes the whole document.
"""

from __future__ import annotations

import codecs
import re

import chardet

__all__ = ["better_encoding"]

# chardet 7 answers a declaration it finds in the first bytes (<?xml encoding=...?>, <meta
# charset=...>) whenever it decodes, with confidence 0.95: exactly the claim we want checked.
# Renaming the attribute hides the claim and leaves every byte chardet weighs in place.
_DECLARATION = re.compile(rb"(?:encoding|charset)(?=\s*=)", re.IGNORECASE)
_UNICODE = frozenset({"utf-8", "utf-16", "utf-16-le", "utf-16-be", "utf-32", "utf-32-le", "utf-32-be"})
_PLAUSIBLE = 0.5  # a candidate counts if its confidence is at least this share of the best one's


def _codec(name: str) -> str | None:
    try:
        return codecs.lookup(name).name
    except LookupError:
        return None


def better_encoding(content: bytes, used: str) -> str | None:
    """The encoding to re-read ``content`` in, or None when ``used`` (feedparser's choice) stands.

    ``used`` is the encoding feedparser decoded the document with (``parsed.encoding``); an
    empty or unknown name counts as implausible.
    """
    used_codec = _codec(used) if used else None
    if content.isascii() or used_codec in _UNICODE:
        return None
    sample = _DECLARATION.sub(b"x", content[: chardet.DEFAULT_MAX_BYTES])
    candidates = chardet.detect_all(sample, prefer_superset=True, ignore_threshold=True)
    best = candidates[0]["confidence"]
    plausible = [c["encoding"] for c in candidates if c["encoding"] and c["confidence"] >= best * _PLAUSIBLE]
    if not plausible:
        return None
    if used_codec is not None:
        as_used = sample.decode(used_codec, errors="replace")
        if any(sample.decode(name, errors="replace") == as_used for name in plausible if _codec(name)):
            return None
    choice = plausible[0]
    try:
        content.decode(choice)
    except (UnicodeDecodeError, LookupError):
        return None  # chardet judged the first DEFAULT_MAX_BYTES; the rest does not fit its answer
    return choice.lower()
