"""News feeds: fetch, parse, normalise, tag and store, one feed at a time.

``ingest_feeds(config, engine)`` runs every enabled feed of the config (or the ones named in
``only``) and returns one :class:`FeedResult` each. A feed that fails — network, HTTP error,
not a feed, a bug in our code — is recorded as an ``error`` fetch and the next feed runs.

Per feed, in one transaction: the new entries, their instrument tags, the fetch record
(``feed_fetches``) and the cache validators for the next conditional GET (``feed_states``).
So a crash loses nothing stored, and the validators never run ahead of the data.

Normalisation of an entry:

- ``title`` and ``summary``: HTML stripped, entities decoded, whitespace collapsed; the
  summary is the entry's summary, else its first content block; an entry without a title
  gets the start of its summary; an entry with neither is skipped (counted in the warning).
- ``link`` (resolved against the feed's URL), ``guid`` (the entry id).
- ``published_at``: the feed's claim, from feedparser's ``published_parsed`` /
  ``updated_parsed`` (UTC ``struct_time``, converted with ``calendar.timegm``); ``None``
  when the entry has no date. Point-in-time code must use ``fetched_at`` (our clock), not this.
- ``language``: the feed's configured ``language``, else the entry's, else the feed's own.
- Dedup: by ``(feed, item_key)`` where ``item_key`` is the guid, else the link, else the
  content hash; and across feeds by ``content_hash`` (SHA-256 of title and summary,
  case-folded, punctuation and spacing removed), so the same story syndicated in two feeds
  is stored once, under the feed that delivered it first. An entry with a title but no text
  adds its guid or link to the hash: a bare headline that recurs daily is not one story.
  An entry edited later under the same guid keeps its first stored version: that is what we
  knew at its ``fetched_at``.

Encoding: a declared encoding that fits the bytes is used as declared; an undeclared one is
chardet's guess (feedparser's own fallback), and a declaration that decodes into text chardet
finds implausible is overridden (:mod:`robot_llm.ingest.encoding`), with a warning.

feedparser's ``bozo`` flag (not well-formed XML, an encoding override) is a warning; a
document with no entries at all is a failed fetch.
"""

from __future__ import annotations

import calendar
import hashlib
import io
import logging
import re
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from html.parser import HTMLParser
from typing import Any, Literal

import feedparser
import httpx
from sqlalchemy.engine import Engine
from sqlalchemy.exc import SQLAlchemyError

from robot_llm.config import AppConfig
from robot_llm.config_sections import FeedConfig
from robot_llm.errors import RobotLLMError
from robot_llm.ingest import insert_ignoring_duplicates
from robot_llm.ingest.encoding import better_encoding
from robot_llm.ingest.http import FetchError, FetchResult, fetch, make_client
from robot_llm.ingest.tagging import Tagger
from robot_llm.store.db import FeedFetch, FeedState, NewsItem, NewsTicker, error_line, session_scope, utcnow

__all__ = [
    "FeedError",
    "FeedResult",
    "NewsEntry",
    "ParsedFeed",
    "ingest_feed",
    "ingest_feeds",
    "parse_feed",
    "strip_html",
]

log = logging.getLogger(__name__)

_MAX_TITLE = 1000
_MAX_SUMMARY = 20000
_MAX_KEY = 500
_MAX_GUID = 1000
_MAX_LINK = 2000
_UNTITLED_CHARS = 120


class FeedError(RobotLLMError):
    """The document is not a usable feed (not XML, an HTML page, no entries)."""


@dataclass(frozen=True)
class NewsEntry:
    """One normalised feed entry, ready to store."""

    title: str
    summary: str
    link: str | None
    guid: str | None
    published_at: datetime | None
    language: str | None
    item_key: str
    content_hash: str
    tickers: tuple[str, ...]


@dataclass(frozen=True)
class ParsedFeed:
    """The entries of one document, and what was odd about it."""

    entries: tuple[NewsEntry, ...]
    warnings: tuple[str, ...]


@dataclass(frozen=True)
class FeedResult:
    """The outcome of one feed's fetch, as recorded in ``feed_fetches``."""

    feed: str
    status: Literal["ok", "not_modified", "error"]
    http_status: int | None
    new: int
    duplicates: int
    warning: str | None
    error: str | None
    fetch_id: int | None

    @property
    def ok(self) -> bool:
        """False only for a failed fetch."""
        return self.status != "error"


# --------------------------------------------------------------------------- text


class _TextExtractor(HTMLParser):
    _SKIP = frozenset({"script", "style", "head", "title"})
    _BREAK = frozenset({"br", "p", "div", "li", "tr", "h1", "h2", "h3", "h4", "h5", "h6", "blockquote"})

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.parts: list[str] = []
        self._skipping = 0

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag in self._SKIP:
            self._skipping += 1
        elif tag in self._BREAK:
            self.parts.append(" ")

    def handle_endtag(self, tag: str) -> None:
        if tag in self._SKIP and self._skipping:
            self._skipping -= 1
        elif tag in self._BREAK:
            self.parts.append(" ")

    def handle_data(self, data: str) -> None:
        if not self._skipping:
            self.parts.append(data)


def strip_html(value: str) -> str:
    """Plain text of an HTML fragment: tags removed, entities decoded, whitespace collapsed."""
    if not value:
        return ""
    parser = _TextExtractor()
    parser.feed(value)
    parser.close()
    return " ".join("".join(parser.parts).split())


_NON_WORD = re.compile(r"[\W_]+")


def content_hash(title: str, summary: str) -> str:
    """SHA-256 of the story's words: case, punctuation, spacing and ё/е do not count."""
    text = f"{title}\n{summary}".casefold().replace("ё", "е")
    return hashlib.sha256(_NON_WORD.sub(" ", text).strip().encode("utf-8")).hexdigest()


def _shorten(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    cut = text[:limit].rsplit(" ", 1)[0] or text[:limit]
    return cut + "…"


def _struct_to_utc(value: Any) -> datetime | None:
    if not value:
        return None
    try:
        return datetime.fromtimestamp(calendar.timegm(value), tz=timezone.utc)
    except (OverflowError, ValueError, OSError, TypeError):
        return None


def _language(value: Any) -> str | None:
    if not isinstance(value, str) or not value.strip():
        return None
    return value.strip().lower()[:16]


# --------------------------------------------------------------------------- parsing


def parse_feed(
    content: bytes,
    headers: Mapping[str, str],
    *,
    feed: FeedConfig,
    tagger: Tagger,
) -> ParsedFeed:
    """Parse and normalise one fetched document; FeedError when it holds no entries.

    ``headers`` are the response headers (lower-case names); ``content-type`` decides the
    encoding together with the XML declaration, ``content-location`` resolves relative links.
    The bytes are wrapped in a stream: feedparser would treat a *str* as a URL or a path.
    """
    parsed = feedparser.parse(io.BytesIO(content), response_headers=dict(headers))
    warnings: list[str] = []
    used = str(parsed.get("encoding") or "").lower()
    detected = better_encoding(content, used)
    if detected:
        # A declaration (or feedparser's default for none) that decodes, wrongly: re-read the
        # document in what chardet finds; an HTTP charset outranks every other claim.
        fixed = dict(headers, **{"content-type": f"application/xml; charset={detected}"})
        parsed = feedparser.parse(io.BytesIO(content), response_headers=fixed)
        warnings.append(f"decoded as {detected} (detected; the document said or implied {used or 'nothing usable'})")
    bozo = None
    if parsed.get("bozo"):
        exc = parsed.get("bozo_exception")
        if isinstance(exc, feedparser.CharacterEncodingOverride):
            bozo = f"encoding: {exc}"
        else:
            bozo = f"not well-formed ({type(exc).__name__}: {exc})" if exc else "not well-formed"
        warnings.append(bozo)
    raw_entries = parsed.get("entries") or []
    if not raw_entries:
        content_type = headers.get("content-type", "")
        if "html" in content_type.lower() or content.lstrip()[:200].lower().startswith((b"<!doctype html", b"<html")):
            raise FeedError(f"got an HTML page ({content_type or 'no content type'}), not a feed")
        if bozo:
            raise FeedError(f"not a feed: {bozo}")
        raise FeedError("the feed has no entries")

    feed_language = _language(parsed.get("feed", {}).get("language"))
    entries: list[NewsEntry] = []
    skipped = 0
    for raw in raw_entries:
        entry = _normalise(raw, feed=feed, tagger=tagger, feed_language=feed_language)
        if entry is None:
            skipped += 1
        else:
            entries.append(entry)
    if skipped:
        warnings.append(f"{skipped} entr{'y' if skipped == 1 else 'ies'} without title or text skipped")
    if not entries:
        raise FeedError(f"none of the {len(raw_entries)} entries has a title or text")
    return ParsedFeed(tuple(entries), tuple(warnings))


def _normalise(raw: Any, *, feed: FeedConfig, tagger: Tagger, feed_language: str | None) -> NewsEntry | None:
    title = strip_html(raw.get("title", ""))
    summary_html = raw.get("summary") or ""
    if not summary_html and raw.get("content"):
        summary_html = raw["content"][0].get("value", "")
    summary = _shorten(strip_html(summary_html), _MAX_SUMMARY)
    if not title and not summary:
        return None
    if not title:
        title = _shorten(summary, _UNTITLED_CHARS)
    title = _shorten(title, _MAX_TITLE)

    link = (raw.get("link") or "").strip() or None
    guid = (raw.get("id") or "").strip() or None
    # A headline without text ("Итоги торгов") may recur every day: then the entry's own
    # identity joins the fingerprint, so only a re-post of the same item counts as a duplicate.
    digest = content_hash(title, summary or guid or link or "")
    key = guid or link or f"sha256:{digest}"
    if len(key) > _MAX_KEY:
        key = "sha256:" + hashlib.sha256(key.encode("utf-8")).hexdigest()

    published = _struct_to_utc(raw.get("published_parsed")) or _struct_to_utc(raw.get("updated_parsed"))
    language = _language(feed.language) or _language((raw.get("title_detail") or {}).get("language")) or feed_language
    found = tagger.tag(title, summary)
    tickers = tuple(dict.fromkeys((*found, *(feed.tickers or ()))))
    return NewsEntry(
        title=title,
        summary=summary,
        link=link[:_MAX_LINK] if link else None,
        guid=guid[:_MAX_GUID] if guid else None,
        published_at=published,
        language=language,
        item_key=key,
        content_hash=digest,
        tickers=tickers,
    )


# --------------------------------------------------------------------------- storing


def _record(
    engine: Engine,
    feed: FeedConfig,
    started_at: datetime,
    *,
    status: Literal["ok", "not_modified", "error"],
    http_status: int | None,
    fetched: FetchResult | None = None,
    entries: Sequence[NewsEntry] = (),
    warning: str | None = None,
    error: str | None = None,
) -> FeedResult:
    """Store the entries, the fetch record and the feed state in one transaction."""
    finished_at = utcnow()
    new = duplicates = 0
    with session_scope(engine) as session:
        for entry in entries:
            stmt = (
                insert_ignoring_duplicates(session, NewsItem)
                .values(
                    feed=feed.name,
                    item_key=entry.item_key,
                    guid=entry.guid,
                    link=entry.link,
                    title=entry.title,
                    summary=entry.summary,
                    language=entry.language,
                    published_at=entry.published_at,
                    fetched_at=finished_at,
                    content_hash=entry.content_hash,
                )
                .returning(NewsItem.id)
            )
            news_id = session.execute(stmt).scalar_one_or_none()
            if news_id is None:
                duplicates += 1
                continue
            new += 1
            for ticker in entry.tickers:
                session.execute(insert_ignoring_duplicates(session, NewsTicker).values(news_id=news_id, ticker=ticker))
        row = FeedFetch(
            feed=feed.name,
            started_at=started_at,
            finished_at=finished_at,
            status=status,
            http_status=http_status,
            new_count=new,
            duplicate_count=duplicates,
            warning=warning,
            error=error,
        )
        session.add(row)
        session.execute(insert_ignoring_duplicates(session, FeedState).values(feed=feed.name))
        state = session.get(FeedState, feed.name, with_for_update=True, populate_existing=True)
        assert state is not None  # inserted just above if it was missing
        if fetched is not None and status == "ok":
            # A feed served without validators must not keep stale ones from an earlier fetch.
            state.etag = fetched.etag
            state.last_modified = fetched.last_modified
        state.last_fetch_at = finished_at
        state.last_status = status
        session.flush()
        fetch_id = row.id
    return FeedResult(feed.name, status, http_status, new, duplicates, warning, error, fetch_id)


def ingest_feed(
    feed: FeedConfig,
    config: AppConfig,
    engine: Engine,
    *,
    tagger: Tagger | None = None,
    client: httpx.Client | None = None,
) -> FeedResult:
    """Fetch, parse and store one feed; never raises for a problem with the feed itself.

    Network, HTTP and parse failures become an ``error`` result (and fetch record). A
    database failure is raised: without the database nothing can be recorded.
    """
    tagger = tagger or Tagger.from_instruments(config.instruments)
    started_at = utcnow()
    with session_scope(engine) as session:
        state = session.get(FeedState, feed.name)
        etag = state.etag if state else None
        last_modified = state.last_modified if state else None
    try:
        fetched = fetch(feed.url, config.http, etag=etag, last_modified=last_modified, client=client)
    except FetchError as exc:
        log.warning("feed %s: %s", feed.name, exc)
        return _record(engine, feed, started_at, status="error", http_status=exc.http_status, error=str(exc))
    if fetched.not_modified:
        log.info("feed %s: not modified", feed.name)
        return _record(engine, feed, started_at, status="not_modified", http_status=fetched.http_status)
    try:
        parsed = parse_feed(fetched.content, fetched.headers, feed=feed, tagger=tagger)
    except FeedError as exc:
        log.warning("feed %s: %s", feed.name, exc)
        return _record(engine, feed, started_at, status="error", http_status=fetched.http_status, error=str(exc))
    except Exception as exc:  # feedparser has raised on some malformed inputs; one feed must not stop the rest
        log.exception("feed %s: cannot parse", feed.name)
        return _record(
            engine,
            feed,
            started_at,
            status="error",
            http_status=fetched.http_status,
            error=f"cannot parse: {type(exc).__name__}: {exc}",
        )
    warning = "; ".join(parsed.warnings) or None
    if warning:
        log.warning("feed %s: %s", feed.name, warning)
    try:
        result = _record(
            engine,
            feed,
            started_at,
            status="ok",
            http_status=fetched.http_status,
            fetched=fetched,
            entries=parsed.entries,
            warning=warning,
        )
    except SQLAlchemyError as exc:
        # Something in this feed's data the database refused; the transaction rolled back,
        # so record the failure (if the database itself is gone, this raises in turn).
        log.exception("feed %s: cannot store", feed.name)
        return _record(
            engine,
            feed,
            started_at,
            status="error",
            http_status=fetched.http_status,
            error=f"cannot store: {type(exc).__name__}: {error_line(exc)}",
        )
    log.info("feed %s: %d new, %d duplicate", feed.name, result.new, result.duplicates)
    return result


def ingest_feeds(
    config: AppConfig,
    engine: Engine,
    only: str | Collection[str] | None = None,
    *,
    client: httpx.Client | None = None,
) -> list[FeedResult]:
    """Ingest every enabled feed, or just those named in ``only`` (named feeds run even if disabled).

    Returns one result per feed, in config order. Raises RobotLLMError for an unknown name
    in ``only``; a failing feed is reported in its result and never stops the others.
    """
    if isinstance(only, str):
        only = (only,)
    if only is not None:
        known = {f.name for f in config.feeds}
        unknown = [name for name in only if name not in known]
        if unknown:
            raise RobotLLMError(
                f"unknown feed {', '.join(map(repr, unknown))}; the config has: {', '.join(sorted(known)) or 'none'}"
            )
        feeds = [f for f in config.feeds if f.name in set(only)]
    else:
        feeds = [f for f in config.feeds if f.enabled]
    tagger = Tagger.from_instruments(config.instruments)
    own = client is None
    if client is None:
        client = make_client(config.http)
    try:
        return [ingest_feed(feed, config, engine, tagger=tagger, client=client) for feed in feeds]
    finally:
        if own:
            client.close()
