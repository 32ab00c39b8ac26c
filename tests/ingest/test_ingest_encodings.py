"""Feeds in the encodings they come in: declared, undeclared, declared wrongly.

The documents are built here, in the scripts of the news they carry, and served by the real
loopback server where the HTTP headers are part of the case.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from ingest_helpers import INSTRUMENTS, FeedServer, Reply, item, make_config, rss
from sqlalchemy import select
from sqlalchemy.engine import Engine

from robot_llm.config_sections import FeedConfig, InstrumentConfig
from robot_llm.ingest.encoding import better_encoding
from robot_llm.ingest.feeds import ingest_feeds, parse_feed
from robot_llm.ingest.tagging import Tagger
from robot_llm.store.db import NewsItem, session_scope

TAGGER = Tagger.from_instruments(InstrumentConfig(**i) for i in INSTRUMENTS)
FEED = FeedConfig(name="t", url="https://example.org/feed")

RUSSIAN = (
    ("Как пережить новогоднюю ночь", "Советы врачей и психологов."),
    ("Акции Сбербанка выросли на новостях о дивидендах", "Набсовет рекомендовал 35 рублей на акцию."),
    ("Газпром увеличил экспорт газа в Китай", "По итогам ноября поставки выросли на 12%."),
)
NEWS = {
    "koi8-r": RUSSIAN,
    "windows-1251": (
        ("Набсовет Сбербанка рекомендовал дивиденды", "Выплата составит 35 рублей на акцию."),
        ("Лукойл завершил обратный выкуп акций", "Компания выкупила 5% капитала."),
        ("Яндекс представил новую модель", "Выручка компании выросла на треть."),
    ),
    "tis-620": (
        ("ตลาดหุ้นไทยปิดบวกตามตลาดต่างประเทศ", "นักลงทุนต่างชาติซื้อสุทธิ"),
        ("ธนาคารแห่งประเทศไทยคงอัตราดอกเบี้ยนโยบาย", "คณะกรรมการนโยบายการเงินมีมติเอกฉันท์"),
        ("ราคาน้ำมันดิบปรับตัวสูงขึ้นในวันนี้", "ตลาดกังวลเรื่องอุปทาน"),
    ),
    "shift_jis": (
        ("日経平均株価は続伸、半導体関連が買われる", "東京証券取引所の終値。"),
        ("日本銀行は金融政策の現状維持を決定", "市場の予想通りだった。"),
        ("トヨタ自動車が過去最高益を発表した", "円安が追い風となった。"),
    ),
    "euc-kr": (
        ("코스피 지수가 외국인 매수에 힘입어 상승했다", "거래량은 평소 수준이었다."),
        ("한국은행은 기준금리를 동결했다", "물가 상승률은 둔화됐다."),
        ("삼성전자 주가가 사상 최고치를 기록했다", "반도체 수요가 늘었다."),
    ),
    "gb2312": (
        ("上证指数今日收涨，银行板块领涨", "两市成交额超过一万亿元。"),
        ("中国人民银行宣布下调存款准备金率", "释放长期资金约一万亿元。"),
        ("人民币兑美元汇率小幅走高", "市场情绪有所改善。"),
    ),
    "windows-1252": (
        ("Les actions de la Société Générale ont progressé après les résultats", "Le titre a gagné 4 € à Paris."),
        ("Die Börse in Frankfurt schloss mit einem Plus", "Der DAX stieg um 1,2 % – ein „guter“ Tag."),
        ("El índice bursátil español cerró al alza", "La banca lideró las subidas."),
    ),
}
WILD = ["koi8-r", "windows-1251", "tis-620", "shift_jis", "euc-kr", "gb2312"]


def _document(encoding: str, *, declare: str | None) -> bytes:
    items = [item(title, guid=str(i), text=text) for i, (title, text) in enumerate(NEWS[encoding])]
    return rss(*items, encoding=encoding, declare=declare)


def _titles(content: bytes, headers: dict[str, str]) -> tuple[list[str], tuple[str, ...]]:
    parsed = parse_feed(content, headers, feed=FEED, tagger=TAGGER)
    return [e.title for e in parsed.entries], parsed.warnings


def _expected(encoding: str) -> list[str]:
    return [title for title, _ in NEWS[encoding]]


@pytest.mark.parametrize(
    "headers",
    [
        {"content-type": "application/xml"},  # RFC 3023: utf-8 unless declared
        {"content-type": "text/xml"},  # RFC 3023: us-ascii unless declared
        {"content-type": "application/octet-stream"},  # not an XML type at all
        {"content-location": "https://example.org/feed"},  # headers, but no content type: iso-8859-1
        {},
    ],
    ids=["application-xml", "text-xml", "octet-stream", "no-content-type", "no-headers"],
)
@pytest.mark.parametrize("encoding", [*WILD, "windows-1252"])
def test_undeclared_encoding_is_detected(encoding: str, headers: dict[str, str]) -> None:
    titles, _ = _titles(_document(encoding, declare=None), headers)
    assert titles == _expected(encoding)


@pytest.mark.parametrize("encoding", [*WILD, "windows-1252", "utf-8"])
def test_declared_and_consistent_is_used_as_declared(encoding: str) -> None:
    news = NEWS.get(encoding, RUSSIAN)
    doc = rss(*(item(t, guid=str(i), text=x) for i, (t, x) in enumerate(news)), encoding=encoding)
    for headers in ({"content-type": "application/rss+xml"}, {"content-type": f"text/xml; charset={encoding}"}):
        titles, warnings = _titles(doc, headers)
        assert titles == [t for t, _ in news]
        assert not any("decoded as" in w for w in warnings), warnings


def test_declared_windows_1251_with_a_wrong_http_charset() -> None:
    doc = rss(item("«Газпром» и ЛУКОЙЛ", guid="1"), encoding="windows-1251")
    parsed = parse_feed(doc, {"content-type": "text/xml; charset=utf-8"}, feed=FEED, tagger=TAGGER)
    assert parsed.entries[0].title == "«Газпром» и ЛУКОЙЛ"
    assert parsed.entries[0].tickers == ("GAZP", "LKOH")


def test_latin_1_declared_for_windows_1252_text_stays() -> None:
    """chardet prefers windows-1252 for this text; the declaration reads the letters alike, so it stands."""
    title = "Les actions de la Société Générale ont progressé après les résultats"
    titles, warnings = _titles(rss(item(title, guid="1"), encoding="iso-8859-1"), {"content-type": "application/xml"})
    assert titles == [title]
    assert warnings == ()


@pytest.mark.parametrize(
    ("encoding", "declare", "http_charset", "detected"),
    [
        ("windows-1251", "windows-1252", None, "windows-1251"),  # the classic: Russian declared as Western
        ("windows-1251", None, "iso-8859-1", "windows-1251"),
        ("koi8-r", "windows-1251", None, "koi8-r"),  # the "лБЛ РЕТЕЦЙФШ ОПЧПЗПДОАА ОПЮШ"
        ("tis-620", "windows-1252", None, "cp874"),
        ("euc-kr", "iso-8859-1", None, "cp949"),
    ],
)
def test_contradicted_declaration_is_overridden(
    encoding: str, declare: str | None, http_charset: str | None, detected: str
) -> None:
    content_type = "application/xml" + (f"; charset={http_charset}" if http_charset else "")
    titles, warnings = _titles(_document(encoding, declare=declare), {"content-type": content_type})
    assert titles == _expected(encoding)
    said = declare or http_charset
    assert any(w.startswith(f"decoded as {detected} (detected; the document said or implied {said}") for w in warnings)


@pytest.mark.parametrize("encoding", WILD)
def test_declared_utf_8_that_is_not(encoding: str) -> None:
    """UTF-8 fails to decode, so feedparser falls back to chardet and says so."""
    titles, warnings = _titles(_document(encoding, declare="utf-8"), {"content-type": "application/rss+xml"})
    assert titles == _expected(encoding)
    assert any(w.startswith("encoding: document declared as utf-8, but parsed as") for w in warnings)


def test_better_encoding_keeps_what_is_plausible() -> None:
    russian = _document("windows-1251", declare=None)
    assert better_encoding(russian, "windows-1251") is None
    assert better_encoding(russian, "windows-1252") == "windows-1251"
    assert better_encoding(russian, "") == "windows-1251"  # feedparser could not decode it at all
    assert better_encoding(b"<rss>plain ASCII</rss>", "windows-1252") is None
    assert better_encoding("<rss>Газпром</rss>".encode(), "utf-8") is None


def test_wild_encodings_over_http(server: FeedServer, engine: Engine, tmp_path: Path) -> None:
    """Undeclared documents, each with the kind of Content-Type servers send, stored as the text they are."""
    content_types = {
        "koi8-r": "text/xml",
        "windows-1251": None,  # no Content-Type header at all
        "tis-620": "application/rss+xml",
        "shift_jis": "application/xml",
        "euc-kr": "text/xml",
        "gb2312": "application/octet-stream",
    }
    for encoding, content_type in content_types.items():
        headers = {"Content-Type": content_type} if content_type else {}
        server.serve(f"/{encoding}", Reply(200, _document(encoding, declare=None), headers))
    url = engine.url.render_as_string(hide_password=False).replace("postgresql+psycopg://", "postgresql://")
    config = make_config(tmp_path, url, feeds=[{"name": e, "url": server.url(f"/{e}")} for e in content_types])
    results = ingest_feeds(config, engine)
    assert [(r.status, r.new) for r in results] == [("ok", 3)] * len(content_types)
    with session_scope(engine) as s:
        rows = s.execute(select(NewsItem.feed, NewsItem.title, NewsItem.summary).order_by(NewsItem.id)).all()
    for encoding in content_types:
        assert [(t, x) for f, t, x in rows if f == encoding] == list(NEWS[encoding])
    with session_scope(engine) as s:
        tagged = {n.title: [t.ticker for t in n.tickers] for n in s.scalars(select(NewsItem))}
    assert tagged["Акции Сбербанка выросли на новостях о дивидендах"] == ["SBER"]  # koi8-r
    assert tagged["Газпром увеличил экспорт газа в Китай"] == ["GAZP"]
    assert tagged["Лукойл завершил обратный выкуп акций"] == ["LKOH"]  # windows-1251
