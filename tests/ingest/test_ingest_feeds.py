"""Feed ingest end to end: loopback HTTP server -> feedparser -> SQLite and PostgreSQL."""

from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path

from ingest_helpers import DEMO, FeedServer, Reply, item, make_config, rss
from sqlalchemy import func, select
from sqlalchemy.engine import Engine

from robot_llm.ingest.feeds import ingest_feeds
from robot_llm.store.db import FeedFetch, FeedState, NewsItem, session_scope

RU_1251 = (DEMO / "feeds" / "ru-news-windows-1251.rss").read_bytes()
RU_ATOM = (DEMO / "feeds" / "ru-markets-utf8.atom").read_bytes()
EN_RSS = (DEMO / "feeds" / "en-markets.rss").read_bytes()


def _news(engine: Engine, feed: str | None = None) -> list[NewsItem]:
    with session_scope(engine) as s:
        stmt = select(NewsItem).order_by(NewsItem.id)
        if feed:
            stmt = stmt.where(NewsItem.feed == feed)
        return list(s.scalars(stmt))


def _fetches(engine: Engine, feed: str) -> list[FeedFetch]:
    with session_scope(engine) as s:
        return list(s.scalars(select(FeedFetch).where(FeedFetch.feed == feed).order_by(FeedFetch.id)))


def _url(engine: Engine) -> str:
    return engine.url.render_as_string(hide_password=False).replace("postgresql+psycopg://", "postgresql://")


def test_demo_feeds_over_http(server: FeedServer, engine: Engine, tmp_path: Path) -> None:
    """windows-1251, UTF-8 Atom and English RSS; zones; no guid / no date; a shared story; tags."""
    # text/xml without a charset: RFC 3023 says us-ascii, the XML declaration must win.
    server.serve("/ru.rss", Reply(200, RU_1251, {"Content-Type": "text/xml"}))
    server.serve("/ru.atom", Reply(200, RU_ATOM, {"Content-Type": "application/atom+xml; charset=utf-8"}))
    server.serve("/en.rss", Reply(200, EN_RSS, {"Content-Type": "application/rss+xml"}))
    config = make_config(
        tmp_path,
        _url(engine),
        feeds=[
            {"name": "ru", "url": server.url("/ru.rss")},
            {"name": "atom", "url": server.url("/ru.atom"), "language": "RU"},
            {"name": "en", "url": server.url("/en.rss")},
        ],
    )
    before = datetime.now(timezone.utc)
    results = {r.feed: r for r in ingest_feeds(config, engine)}
    assert [r.status for r in results.values()] == ["ok", "ok", "ok"]
    # 6 good entries (one empty entry skipped); the Atom feed repeats the Sberbank story.
    assert (results["ru"].new, results["ru"].duplicates) == (6, 0)
    assert "1 entry without title or text skipped" in (results["ru"].warning or "")
    assert (results["atom"].new, results["atom"].duplicates) == (3, 1)
    assert results["en"].new == 5 and "not well-formed" in (results["en"].warning or "")

    ru = {n.title: n for n in _news(engine, "ru")}
    sber = ru["Набсовет Сбербанка рекомендовал дивиденды за девять месяцев"]  # decoded from windows-1251
    assert sber.summary.startswith("Наблюдательный совет Сбербанка рекомендовал")  # HTML stripped
    assert "<" not in sber.summary
    assert sber.published_at == datetime(2026, 11, 27, 15, 40, tzinfo=timezone.utc)  # +0300 -> UTC
    assert sber.guid == "news-example-ru-10451" and sber.item_key == sber.guid
    assert sber.language == "ru" and before <= sber.fetched_at <= datetime.now(timezone.utc)
    assert [t.ticker for t in sber.tickers] == ["SBER"]
    lukoil = ru["ЛУКОЙЛ завершил обратный выкуп акций"]  # no guid: keyed by link
    assert lukoil.guid is None and lukoil.item_key == lukoil.link
    assert "«Лукойл»" in lukoil.summary  # double-escaped entities decoded
    yandex = ru["Яндекс представил новую версию нейросети для бизнеса"]  # no date, no link
    assert yandex.published_at is None and yandex.link is None
    assert [t.ticker for t in yandex.tickers] == ["YDEX"]

    atom = {n.title: n for n in _news(engine, "atom")}
    sibn = atom["«Газпромнефть» отчиталась о добыче за октябрь"]
    assert sibn.tickers == [] and sibn.language == "ru"  # configured language, lower-cased
    assert sibn.published_at == datetime(2026, 11, 26, 6, 0, tzinfo=timezone.utc)
    assert atom["Яндексу одобрили допуск к торгам новых облигаций"].summary.endswith("ставка купона 15,5%.")

    en = {n.title: n for n in _news(engine, "en")}
    assert en["Chipmakers rally; Nvidia & peers extend gains"].published_at == datetime(
        2026, 11, 25, 19, 30, tzinfo=timezone.utc
    )  # +0100
    pine = en["Pineapple prices are on the rise, and so is everyone's snapple habit"]
    assert pine.published_at == datetime(2026, 11, 27, 14, 0, tzinfo=timezone.utc)  # EST
    assert pine.tickers == []
    assert sorted(t.ticker for t in en["Sberbank and Gazprom lead Moscow blue chips higher"].tickers) == [
        "GAZP",
        "LKOH",
        "SBER",
    ]

    # Every fetch is recorded; a second run stores nothing new.
    again = {r.feed: r for r in ingest_feeds(config, engine)}
    assert [again[f].new for f in ("ru", "atom", "en")] == [0, 0, 0]
    assert again["atom"].duplicates == 4
    assert len(_news(engine)) == 14
    assert [f.status for f in _fetches(engine, "ru")] == ["ok", "ok"]
    assert _fetches(engine, "en")[0].new_count == 5 and _fetches(engine, "en")[1].duplicate_count == 5


def test_conditional_get_and_changing_etag(server: FeedServer, engine: Engine, tmp_path: Path) -> None:
    state = {"etag": '"v1"', "body": rss(item("First story", guid="a"))}

    def route(seen):
        if seen.headers.get("if-none-match") == state["etag"]:
            return Reply(304)
        return Reply(200, state["body"], {"ETag": state["etag"], "Last-Modified": "Fri, 27 Nov 2026 10:00:00 GMT"})

    server.routes["/feed"] = route
    config = make_config(tmp_path, _url(engine), feeds=[{"name": "f", "url": server.url("/feed")}])

    assert ingest_feeds(config, engine)[0].new == 1
    second = ingest_feeds(config, engine)[0]
    assert (second.status, second.http_status, second.new) == ("not_modified", 304, 0)
    assert server.requests[1].headers["if-none-match"] == '"v1"'
    assert server.requests[1].headers["if-modified-since"] == "Fri, 27 Nov 2026 10:00:00 GMT"

    state.update(etag='"v2"', body=rss(item("First story", guid="a"), item("Second story", guid="b")))
    third = ingest_feeds(config, engine)[0]
    assert (third.status, third.new, third.duplicates) == ("ok", 1, 1)
    assert ingest_feeds(config, engine)[0].status == "not_modified"
    assert server.requests[3].headers["if-none-match"] == '"v2"'

    assert [f.status for f in _fetches(engine, "f")] == ["ok", "not_modified", "ok", "not_modified"]
    assert [f.http_status for f in _fetches(engine, "f")] == [200, 304, 200, 304]
    with session_scope(engine) as s:
        fs = s.get(FeedState, "f")
        assert fs is not None and fs.etag == '"v2"' and fs.last_status == "not_modified"
    assert [n.title for n in _news(engine)] == ["First story", "Second story"]


def test_broken_feeds_are_recorded_and_do_not_stop_the_others(
    server: FeedServer, engine: Engine, tmp_path: Path
) -> None:
    good = rss(
        item("Dated in Moscow", guid="m", date="Fri, 27 Nov 2026 18:40:00 +0300"),
        item("Dated in New York", link="https://example.org/ny", date="Fri, 27 Nov 2026 10:40:00 -0500"),
        item("Undated, no guid, no link", text="just text"),
    )
    server.serve(
        "/html", Reply(200, b"<!DOCTYPE html><html><body><h1>Welcome</h1></body></html>", {"Content-Type": "text/html"})
    )
    server.serve("/garbage", Reply(200, b"<rss><channel><title>cut off", {"Content-Type": "application/xml"}))
    server.serve("/down", Reply(500, b"oops"))
    server.serve("/good", Reply(200, good, {"Content-Type": "application/rss+xml"}))
    config = make_config(
        tmp_path,
        _url(engine),
        feeds=[
            {"name": "html", "url": server.url("/html")},
            {"name": "garbage", "url": server.url("/garbage")},
            {"name": "down", "url": server.url("/down")},
            {"name": "missing-file", "url": str(tmp_path / "nope.xml")},
            {"name": "good", "url": server.url("/good")},
            {"name": "off", "url": server.url("/good"), "enabled": False},
        ],
    )
    results = {r.feed: r for r in ingest_feeds(config, engine)}
    assert "off" not in results
    assert "HTML page (text/html)" in (results["html"].error or "")
    assert results["garbage"].status == "error" and "not a feed" in (results["garbage"].error or "")
    assert results["down"].http_status == 500 and "after 3 attempts" in (results["down"].error or "")
    assert "no such file" in (results["missing-file"].error or "")
    assert results["good"].status == "ok" and results["good"].new == 3

    for name in ("html", "garbage", "down", "missing-file"):
        (fetch,) = _fetches(engine, name)
        assert fetch.status == "error" and fetch.error and fetch.new_count == 0
    news = {n.title: n for n in _news(engine)}
    assert news["Dated in Moscow"].published_at == news["Dated in New York"].published_at  # 15:40 UTC both
    undated = news["Undated, no guid, no link"]
    assert undated.published_at is None and undated.item_key == f"sha256:{undated.content_hash}"

    # A feed named explicitly runs even when disabled; the same entries are duplicates there.
    (off,) = ingest_feeds(config, engine, only="off")
    assert (off.feed, off.new, off.duplicates) == ("off", 0, 3)
    with session_scope(engine) as s:
        assert s.scalar(select(func.count()).select_from(FeedFetch)) == 6
