"""parse_feed on documents as they come in the wild (no database, no network)."""

from __future__ import annotations

import pytest
from ingest_helpers import INSTRUMENTS, item, rss

from robot_llm.config_sections import FeedConfig, InstrumentConfig
from robot_llm.ingest.feeds import FeedError, parse_feed, strip_html
from robot_llm.ingest.tagging import Tagger

TAGGER = Tagger.from_instruments(InstrumentConfig(**i) for i in INSTRUMENTS)
FEED = FeedConfig(name="t", url="https://example.org/feed")


def test_atom_relative_links_title_from_summary_and_feed_tickers() -> None:
    doc = b"""<?xml version="1.0" encoding="utf-8"?>
<feed xmlns="http://www.w3.org/2005/Atom"><title>t</title><id>urn:x</id><updated>2026-11-27T10:00:00Z</updated>
<entry><id>urn:1</id><link href="/news/1"/><updated>2026-11-27T10:00:00+05:00</updated>
<summary type="html">&lt;p&gt;Board approves a&amp;nbsp;buyback &amp;amp; a split. Further details follow in a long text
that goes on and on and on, well past the length a title may have, so that it must be cut at a word.&lt;/p&gt;</summary>
</entry></feed>"""
    feed = FeedConfig(name="ir", url="https://ir.example.org/atom", tickers=("AAPL",))
    headers = {"content-type": "application/atom+xml", "content-location": "https://ir.example.org/atom"}
    (entry,) = parse_feed(doc, headers, feed=feed, tagger=TAGGER).entries
    assert entry.link == "https://ir.example.org/news/1"
    assert entry.summary.startswith("Board approves a buyback & a split.")  # nbsp and entities decoded
    assert entry.title.endswith("…") and len(entry.title) <= 121 and entry.title.startswith("Board approves")
    assert entry.tickers == ("AAPL",)  # the feed's own subject, though the text never names it
    assert entry.published_at is not None and entry.published_at.hour == 5


def test_bare_headlines_are_told_apart_by_identity_stories_by_text() -> None:
    doc = rss(
        item("Итоги торгов", guid="mon"),
        item("Итоги торгов", guid="tue"),
        item("Same story", guid="x1", text="Identical text."),
        item("SAME   story!", guid="x2", text="identical text"),
    )
    hashes = [e.content_hash for e in parse_feed(doc, {}, feed=FEED, tagger=TAGGER).entries]
    assert hashes[0] != hashes[1] and hashes[2] == hashes[3]


def test_strip_html() -> None:
    assert strip_html("<p>A&nbsp;&amp;&#160;B<br/>C<script>alert(1)</script></p><style>p{}</style>") == "A & B C"
    assert strip_html("P/E &lt; 5") == "P/E < 5"


@pytest.mark.parametrize(
    ("body", "content_type", "message"),
    [
        (b"<html><body>Login</body></html>", "text/html; charset=utf-8", "HTML page"),
        (b"\x00\x01binary", "application/octet-stream", "not a feed"),
        (rss(), "application/rss+xml", "the feed has no entries"),
        (rss(item("", text="")), "application/rss+xml", "none of the 1 entries has a title or text"),
    ],
)
def test_not_a_feed(body: bytes, content_type: str, message: str) -> None:
    with pytest.raises(FeedError, match=message):
        parse_feed(body, {"content-type": content_type}, feed=FEED, tagger=TAGGER)
