"""What a template sees: the render context, and how it is built from the news and signals gathered.

Gathered rows arrive as :class:`NewsEntry` and :class:`SignalEntry`; the views built from
them (:func:`news_view`, :func:`signal_view`) carry only sanitised text and dates in the
configured time zone, so a template cannot be handed raw feed text by mistake.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any
from zoneinfo import ZoneInfo

from robot_llm.prompting.sanitize import sanitize_text

if TYPE_CHECKING:
    from robot_llm.prompting.template import Template

__all__ = [
    "VARIANTS",
    "InstrumentView",
    "NewsEntry",
    "NewsView",
    "RenderContext",
    "SignalEntry",
    "SignalView",
    "example_variant",
    "news_view",
    "signal_view",
]


@dataclass(frozen=True)
class InstrumentView:
    """The instrument as templates see it."""

    ticker: str
    name: str
    aliases: tuple[str, ...]
    exchange: str | None


@dataclass(frozen=True)
class NewsView:
    """One news item as templates see it: sanitised text, local-time dates."""

    id: int
    title: str
    summary: str
    feed: str
    published_at: datetime | None
    fetched_at: datetime
    at: datetime  # when it happened as far as we can tell: published_at unless it claims the future

    @property
    def text(self) -> str:
        """Title and summary as one sentence run (either may be empty)."""
        if not self.summary:
            return self.title
        if not self.title:
            return self.summary
        joiner = " " if self.title[-1] in ".!?…" else ". "
        return self.title + joiner + self.summary


@dataclass(frozen=True)
class SignalView:
    """One forecast of the robot as templates see it; ``text`` says it in the template's language."""

    id: int
    horizon: str
    direction: int | None
    direction_text: str
    target: float | None
    confidence: float | None
    model: str
    generated_at: datetime
    text: str


@dataclass(frozen=True)
class RenderContext:
    """Everything a template may use. ``as_of`` and every date are in ``config.timezone``."""

    instrument: InstrumentView
    as_of: datetime
    language: str
    news: tuple[NewsView, ...]
    signals: tuple[SignalView, ...]
    variant: int = 0  # which order of the worked examples this prompt shows (see example_variant)

    def variables(self) -> dict[str, Any]:
        """The Jinja variables: instrument, as_of, language, news, signals, forecast (latest or None), variant."""
        return {
            "instrument": self.instrument,
            "as_of": self.as_of,
            "language": self.language,
            "news": self.news,
            "signals": self.signals,
            "forecast": self.signals[0] if self.signals else None,
            "variant": self.variant,
        }


#: How many example orders :func:`example_variant` spreads prompts over (a multiple of 2, 3 and 4 examples).
VARIANTS = 12


def example_variant(ticker: str, as_of: datetime) -> int:
    """A stable number in ``[0, VARIANTS)`` from the instrument and the night: the template's example order.

    Templates rotate their worked examples by it (``examples | rotate(variant)``), so no
    verdict always comes last, and an instrument does not see the same order every night.
    """
    key = f"{ticker}|{as_of.astimezone(UTC).isoformat()}".encode()
    return int.from_bytes(hashlib.sha256(key).digest()[:4], "big") % VARIANTS


@dataclass(frozen=True)
class NewsEntry:
    """A news item gathered for an instrument, before sanitising.

    ``mentions`` counts how often the instrument's ticker, name or aliases occur in the
    text; 0 means it was tagged without a textual match (e.g. by the feed's ticker list),
    which makes it the least relevant.
    """

    id: int
    title: str
    summary: str
    feed: str
    published_at: datetime | None
    fetched_at: datetime
    mentions: int = 0
    in_title: bool = False

    @property
    def at(self) -> datetime:
        """When it happened as far as we know: the feed's date unless it claims a time after our fetch."""
        if self.published_at is not None and self.published_at <= self.fetched_at:
            return self.published_at
        return self.fetched_at

    def relevance(self) -> tuple[bool, bool, int, datetime, int]:
        """Sort key, least relevant first: weak match, not in the title, fewer mentions, older."""
        return (self.mentions > 0, self.in_title, self.mentions, self.at, self.id)


@dataclass(frozen=True)
class SignalEntry:
    """A robot forecast gathered for an instrument, before sanitising."""

    id: int
    horizon: str
    direction: int | None
    target: float | None
    confidence: float | None
    model: str
    generated_at: datetime


_DIRECTION_WORDS = {
    "ru": {1: "рост", -1: "падение", 0: "без изменений", None: "направление не указано"},
    "en": {1: "up", -1: "down", 0: "flat", None: "no direction given"},
}
_SIGNAL_PHRASES = {
    "ru": ("{direction} на горизонте {horizon}", ", цель {target}", ", уверенность {confidence:.0%}"),
    "en": ("{direction} over {horizon}", ", target {target}", ", confidence {confidence:.0%}"),
}


def signal_view(entry: SignalEntry, language: str, tz: ZoneInfo, markers: Sequence[str]) -> SignalView:
    """A forecast as a template in ``language`` sees it, with a sentence saying it (English if no words for it)."""
    lang = language.split("-")[0] if language.split("-")[0] in _DIRECTION_WORDS else "en"
    direction = entry.direction if entry.direction in (-1, 0, 1) else None
    words = _DIRECTION_WORDS[lang][direction]
    horizon = sanitize_text(entry.horizon, max_chars=32, markers=markers)
    base, target_part, conf_part = _SIGNAL_PHRASES[lang]
    text = base.format(direction=words, horizon=horizon)
    if entry.target is not None:
        text += target_part.format(target=f"{entry.target:g}")
    if entry.confidence is not None and 0.0 <= entry.confidence <= 1.0:
        text += conf_part.format(confidence=entry.confidence)
    return SignalView(
        id=entry.id,
        horizon=horizon,
        direction=direction,
        direction_text=words,
        target=entry.target,
        confidence=entry.confidence,
        model=sanitize_text(entry.model, max_chars=64, markers=markers),
        generated_at=entry.generated_at.astimezone(tz),
        text=text,
    )


def news_view(entry: NewsEntry, template: Template, tz: ZoneInfo, markers: Sequence[str]) -> NewsView:
    """A news item as ``template`` sees it: only the fields it shows, sanitised and cut to its ``max_chars``."""
    limit = template.news.max_chars
    fields = template.news.fields
    return NewsView(
        id=entry.id,
        title=sanitize_text(entry.title, max_chars=limit, markers=markers) if "title" in fields else "",
        summary=sanitize_text(entry.summary, max_chars=limit, markers=markers) if "summary" in fields else "",
        feed=sanitize_text(entry.feed, max_chars=64, markers=markers),
        published_at=entry.published_at.astimezone(tz) if entry.published_at else None,
        fetched_at=entry.fetched_at.astimezone(tz),
        at=entry.at.astimezone(tz),
    )
