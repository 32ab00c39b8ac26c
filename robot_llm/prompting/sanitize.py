"""Sanitising data for a prompt: news and signal text reaches a template only through :func:`sanitize_text`.

Templates are operator-owned code; news and signal text is *data*. It is passed to Jinja as
variables, never as template source, and first loses what could still act on the prompt:
control characters, template syntax, the tokenizer's special pieces and lines that imitate
the template's own section markers.
"""

from __future__ import annotations

import functools
import re
import unicodedata
from collections.abc import Sequence

__all__ = ["ALWAYS_MARKERS", "sanitize_text"]

#: Section markers data may never imitate, whatever a template declares (see ``Template.section_markers``).
ALWAYS_MARKERS = ("Тезис", "Thesis")

# The tokenizer maps these literal strings to special tokens: in data they must not.
_ANSI_ESCAPES = re.compile(r"\x1b(?:\[[0-?]*[ -/]*[@-~]|\][^\x07\x1b]*(?:\x07|\x1b\\)?|[@-Z\\-_])")
_SPECIAL_PIECES = re.compile(r"\[(NL|MASK)\]|</?s>|<unk>", re.IGNORECASE)
_TEMPLATE_OPEN = re.compile(r"\{(?=[{%#])")
_TEMPLATE_CLOSE = re.compile(r"(?<=[}%#])\}")
_RULES = re.compile(r"([#=*_~`>|-])\1{1,}")
# Leading heading/quote/bullet markup; a lone "-" before a digit (a negative number) stays.
_LEADING_MARKUP = re.compile(r"^(?:[\s#>*|=~`]|-(?!\d))+")


def _control_to_space(text: str) -> str:
    # Cc (C0/C1 controls incl. newlines, tabs, ESC), Cf (zero-width, bidi overrides), Cs, Co,
    # Cn and the Unicode line/paragraph separators become spaces, then whitespace collapses.
    return "".join(
        " " if unicodedata.category(ch)[0] == "C" or unicodedata.category(ch) in ("Zl", "Zp") else ch for ch in text
    )


@functools.lru_cache(maxsize=64)
def _marker_pattern(markers: tuple[str, ...]) -> re.Pattern[str]:
    alternatives = "|".join(re.escape(m) for m in sorted(set(markers), key=len, reverse=True))
    return re.compile(rf"(?i)(?<!\w)({alternatives})\s*:")


def sanitize_text(text: str | None, *, max_chars: int, markers: Sequence[str] = ALWAYS_MARKERS) -> str:
    """Make feed or signal text safe to show inside a prompt, as one line of at most ``max_chars``.

    NFKC-normalises (so full-width look-alikes of ``{`` or ``:`` become plain), turns
    terminal escape sequences, control and format characters into spaces, defuses the tokenizer's special pieces
    (``[NL]`` → ``(NL)``), breaks template delimiters apart (``{{`` → ``{ {``, ``%}`` → ``% }``),
    turns ``Marker:`` (any of ``markers``, case-insensitive) into ``Marker —`` so data cannot
    open a section of the prompt, shortens runs like ``###`` or ``---`` to one character,
    drops leading markup, collapses whitespace and cuts at a word boundary with ``…``.
    """
    if not text:
        return ""
    out = unicodedata.normalize("NFKC", text)
    out = _ANSI_ESCAPES.sub(" ", out)
    out = _control_to_space(out)
    out = _SPECIAL_PIECES.sub(lambda m: "(" + m.group(0).strip("[]<>/") + ")", out)
    out = _TEMPLATE_OPEN.sub("{ ", out)
    out = _TEMPLATE_CLOSE.sub(" }", out)
    if markers:
        out = _marker_pattern(tuple(markers)).sub(r"\1 —", out)
    out = _RULES.sub(r"\1", out)
    out = " ".join(out.split())
    out = _LEADING_MARKUP.sub("", out)
    if len(out) > max_chars:
        cut = out[: max_chars - 1]
        space = cut.rfind(" ")
        if space >= max_chars * 0.6:
            cut = cut[:space]
        out = cut.rstrip(" ,.;:—-") + "…"
    return out
