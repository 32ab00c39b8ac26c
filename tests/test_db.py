"""The schema on real SQLite and PostgreSQL: UTC times, SQLite pragmas, concurrency, idempotency."""

from __future__ import annotations

import threading
from datetime import datetime, timedelta, timezone
from pathlib import Path
from zoneinfo import ZoneInfo

import pytest
from sqlalchemy import func, select, text
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.engine import Engine
from sqlalchemy.exc import IntegrityError, StatementError

from robot_llm.store import migrate
from robot_llm.store.db import (
    DatabaseError,
    NewsItem,
    NewsTicker,
    Run,
    Signal,
    check_connection,
    make_engine,
    session_scope,
    utcnow,
)


def _news(i: int, fetched_at: datetime, feed: str = "interfax") -> NewsItem:
    return NewsItem(
        feed=feed,
        item_key=f"guid-{i}",
        guid=f"guid-{i}",
        title=f"Сбербанк новость {i}",
        summary="",
        fetched_at=fetched_at,
        content_hash=f"{i:064x}",
    )


def test_utcnow_is_aware_utc() -> None:
    now = utcnow()
    assert now.tzinfo is not None
    assert now.utcoffset() == timedelta(0)


def test_datetimes_round_trip_as_aware_utc(engine: Engine) -> None:
    # 23:30 in Moscow is 20:30 UTC: the stored instant must be the same, read back in UTC.
    moscow = datetime(2026, 3, 2, 23, 30, 15, 123456, tzinfo=ZoneInfo("Europe/Moscow"))
    with session_scope(engine) as s:
        s.add(_news(1, moscow))
    with session_scope(engine) as s:
        got = s.scalars(select(NewsItem.fetched_at)).one()
    assert got.utcoffset() == timedelta(0)
    assert got == moscow
    assert (got.hour, got.minute, got.microsecond) == (20, 30, 123456)


def test_comparisons_use_the_instant(engine: Engine) -> None:
    base = datetime(2026, 3, 2, 20, 0, tzinfo=timezone.utc)
    with session_scope(engine) as s:
        s.add_all([_news(i, base + timedelta(minutes=i)) for i in range(3)])
    # 23:01 Moscow == 20:01 UTC: a point-in-time query given a non-UTC aware time must agree.
    cut = datetime(2026, 3, 2, 23, 1, tzinfo=ZoneInfo("Europe/Moscow"))
    with session_scope(engine) as s:
        n = s.scalar(select(func.count()).select_from(NewsItem).where(NewsItem.fetched_at <= cut))
    assert n == 2


def test_naive_datetime_is_refused(engine: Engine) -> None:
    with pytest.raises(StatementError, match="naive datetime"), session_scope(engine) as s:
        s.add(_news(1, datetime(2026, 3, 2, 20, 0)))
    with pytest.raises(StatementError, match="expected an aware datetime, got str"), session_scope(engine) as s:
        s.add(_news(2, "2026-03-02T20:00:00+00:00"))  # type: ignore[arg-type]
    with session_scope(engine) as s:
        assert s.scalar(select(func.count()).select_from(NewsItem)) == 0


def test_unique_constraints_make_reinserts_idempotent(engine: Engine) -> None:
    at = datetime(2026, 3, 2, 20, 0, tzinfo=timezone.utc)
    row = {
        "ticker": "SBER",
        "generated_at": at,
        "received_at": at,
        "horizon": "1d",
        "direction": 1,
        "model": "gbm-v3",
        "extras": {"комментарий": "рост"},
        "source": "drop/2026-03-02.jsonl",
    }
    insert = pg_insert if engine.dialect.name == "postgresql" else sqlite_insert
    for _ in range(2):
        with engine.begin() as conn:
            conn.execute(insert(Signal).values(**row).on_conflict_do_nothing())
    with session_scope(engine) as s:
        signals = s.scalars(select(Signal)).all()
    assert len(signals) == 1
    assert signals[0].extras == {"комментарий": "рост"}

    # A plain second insert of the same news item is rejected by the constraint, not stored twice.
    with session_scope(engine) as s:
        s.add(_news(1, at))
    with pytest.raises(IntegrityError), session_scope(engine) as s:
        s.add(_news(1, at))
    with session_scope(engine) as s:
        assert s.scalar(select(func.count()).select_from(NewsItem)) == 1


def test_foreign_keys_cascade(engine: Engine) -> None:
    at = utcnow()
    with session_scope(engine) as s:
        item = _news(1, at)
        item.tickers = [NewsTicker(ticker="SBER"), NewsTicker(ticker="ON")]
        s.add(item)
    with engine.begin() as conn:
        conn.execute(text("DELETE FROM news_items"))
    with session_scope(engine) as s:
        assert s.scalar(select(func.count()).select_from(NewsTicker)) == 0
    with pytest.raises(IntegrityError), engine.begin() as conn:
        conn.execute(text("INSERT INTO news_tickers (news_id, ticker) VALUES (12345, 'SBER')"))


def test_sqlite_pragmas_in_effect(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'p.sqlite'}"
    migrate.upgrade(url)
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
            assert conn.exec_driver_sql("PRAGMA foreign_keys").scalar() == 1
            assert conn.exec_driver_sql("PRAGMA busy_timeout").scalar() == 30000
    finally:
        engine.dispose()


def test_sqlite_writer_and_reader_at_the_same_moment(tmp_path: Path) -> None:
    """A strategy holds a read transaction open while the daemon writes and commits: both proceed.

    Without WAL the writer's commit would wait for the reader to finish (and the reader here
    waits for the commit), so this deadlocks into a failure instead of passing.
    """
    url = f"sqlite:///{tmp_path / 'c.sqlite'}"
    migrate.upgrade(url)
    writer_engine, reader_engine = make_engine(url), make_engine(url)
    at = datetime(2026, 3, 2, 20, 0, tzinfo=timezone.utc)
    with session_scope(writer_engine) as s:
        s.add(_news(0, at))
    reading = threading.Event()
    committed = threading.Event()
    seen: list[int] = []
    errors: list[BaseException] = []

    def reader() -> None:
        try:
            with reader_engine.connect() as conn:
                conn.exec_driver_sql("BEGIN")  # pysqlite opens no transaction for a SELECT by itself
                count = "SELECT count(*) FROM news_items"
                seen.append(conn.exec_driver_sql(count).scalar() or 0)
                reading.set()
                assert committed.wait(15), "the writer could not commit while a reader was open"
                seen.append(conn.exec_driver_sql(count).scalar() or 0)  # still its own snapshot
                conn.exec_driver_sql("COMMIT")
                seen.append(conn.exec_driver_sql(count).scalar() or 0)
        except BaseException as exc:
            errors.append(exc)
            reading.set()

    def writer() -> None:
        try:
            assert reading.wait(15)
            with session_scope(writer_engine) as s:
                s.add_all([_news(i, at) for i in range(1, 50)])
            committed.set()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=reader), threading.Thread(target=writer)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    writer_engine.dispose()
    reader_engine.dispose()
    assert not errors, errors
    assert seen == [1, 1, 50]


def test_sqlite_second_writer_waits_instead_of_failing(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'w.sqlite'}"
    migrate.upgrade(url)
    engines = [make_engine(url), make_engine(url)]
    holding = threading.Event()
    release = threading.Event()
    errors: list[BaseException] = []

    def first() -> None:
        try:
            with session_scope(engines[0]) as s:
                s.add(Run(kind="ingest", status="running", started_at=utcnow()))
                s.flush()
                holding.set()
                release.wait(30)
        except BaseException as exc:
            errors.append(exc)

    t = threading.Thread(target=first)
    t.start()
    try:
        assert holding.wait(30)
        timer = threading.Timer(0.5, release.set)
        timer.start()
        # Without the busy timeout this would raise "database is locked" at once.
        with session_scope(engines[1]) as s:
            s.add(Run(kind="plan", status="running", started_at=utcnow()))
        t.join(60)
        timer.join()
        assert not errors, errors
        with session_scope(engines[1]) as s:
            assert sorted(s.scalars(select(Run.kind))) == ["ingest", "plan"]
    finally:
        release.set()
        for e in engines:
            e.dispose()


def test_unreachable_postgres_is_one_clear_error() -> None:
    engine = make_engine("postgresql://robot:s3cret@127.0.0.1:1/nope")
    try:
        with pytest.raises(DatabaseError) as err:
            check_connection(engine)
    finally:
        engine.dispose()
    msg = str(err.value)
    assert "cannot connect to the database" in msg
    assert "127.0.0.1:1" in msg
    assert "s3cret" not in msg
    assert "\n" not in msg
