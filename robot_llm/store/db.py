"""Persistence: the SQLAlchemy 2.x schema, engines and sessions.

The database is the hand-off between the pipeline's stages (and between hosts): ingest
writes news and signals, the planner writes generation requests, the worker writes theses,
strategies read theses. Every table has the unique constraints that make re-running a
stage idempotent. Every schema change is an Alembic revision in ``migrations/``.

Time contract: every timestamp is timezone-aware UTC in Python, on SQLite too (which
drops the zone: ``UTCDateTime`` stores naive UTC and re-attaches UTC on read).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Text,
    TypeDecorator,
    UniqueConstraint,
    create_engine,
    event,
    func,
    literal_column,
    text,
)
from sqlalchemy.engine import Engine
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column, relationship, sessionmaker
from sqlalchemy.sql import ColumnElement

from robot_llm.errors import RobotLLMError

__all__ = [
    "THESIS_KINDS",
    "Base",
    "DaemonLease",
    "DatabaseError",
    "FeedFetch",
    "FeedState",
    "GenerationRequest",
    "NewsItem",
    "NewsTicker",
    "Price",
    "Run",
    "Signal",
    "Thesis",
    "UTCDateTime",
    "check_connection",
    "db_clock",
    "error_line",
    "make_engine",
    "session_scope",
    "utcnow",
]

# Set before the first migration so constraint names are identical on SQLite and
# PostgreSQL, and SQLite batch migrations can find them.
NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


def utcnow() -> datetime:
    """The current time, aware, in UTC."""
    return datetime.now(timezone.utc)


class UTCDateTime(TypeDecorator[datetime]):
    """An aware-UTC datetime on every backend; naive datetimes are refused on write."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Any) -> datetime | None:
        if value is None:
            return None
        if not isinstance(value, datetime):
            raise TypeError(f"expected an aware datetime, got {type(value).__name__} {value!r}")
        if value.tzinfo is None or value.utcoffset() is None:
            raise ValueError(f"naive datetime {value!r}: robot-llm stores aware UTC times only")
        value = value.astimezone(timezone.utc)
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value: datetime | None, dialect: Any) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            return value.replace(tzinfo=timezone.utc)
        return value.astimezone(timezone.utc)


class Base(DeclarativeBase):
    """Declarative base with the naming convention."""

    metadata = MetaData(naming_convention=NAMING_CONVENTION)
    type_annotation_map = {  # noqa: RUF012
        datetime: UTCDateTime(),
        dict[str, Any]: JSON(),
        list[int]: JSON(),
        list[str]: JSON(),
    }


# --------------------------------------------------------------------------- ingest


class FeedState(Base):
    """Per-feed HTTP cache validators (ETag / Last-Modified) for conditional GET."""

    __tablename__ = "feed_states"

    feed: Mapped[str] = mapped_column(String(200), primary_key=True)
    etag: Mapped[str | None] = mapped_column(String(500))
    last_modified: Mapped[str | None] = mapped_column(String(200))
    last_fetch_at: Mapped[datetime | None]
    last_status: Mapped[str | None] = mapped_column(String(32))


class FeedFetch(Base):
    """One fetch of one feed: what came back and what it stored."""

    __tablename__ = "feed_fetches"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    feed: Mapped[str] = mapped_column(String(200), index=True)
    started_at: Mapped[datetime]
    finished_at: Mapped[datetime | None]
    status: Mapped[str] = mapped_column(String(32))  # ok | not_modified | error
    http_status: Mapped[int | None]
    new_count: Mapped[int] = mapped_column(default=0)
    duplicate_count: Mapped[int] = mapped_column(default=0)
    warning: Mapped[str | None] = mapped_column(Text)
    error: Mapped[str | None] = mapped_column(Text)


class NewsItem(Base):
    """A normalised news entry. ``fetched_at`` (our clock) is what point-in-time uses."""

    __tablename__ = "news_items"
    __table_args__ = (
        UniqueConstraint("feed", "item_key"),
        UniqueConstraint("content_hash"),
        Index("ix_news_items_fetched_at", "fetched_at"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    feed: Mapped[str] = mapped_column(String(200))
    item_key: Mapped[str] = mapped_column(String(500))  # guid, else link, else content hash
    guid: Mapped[str | None] = mapped_column(String(1000))
    link: Mapped[str | None] = mapped_column(String(2000))
    title: Mapped[str] = mapped_column(Text)
    summary: Mapped[str] = mapped_column(Text, default="")
    language: Mapped[str | None] = mapped_column(String(16))
    published_at: Mapped[datetime | None]
    fetched_at: Mapped[datetime]
    content_hash: Mapped[str] = mapped_column(String(64))

    tickers: Mapped[list[NewsTicker]] = relationship(
        back_populates="news", cascade="all, delete-orphan", lazy="selectin"
    )


class NewsTicker(Base):
    """Which instruments a news item mentions."""

    __tablename__ = "news_tickers"

    news_id: Mapped[int] = mapped_column(ForeignKey("news_items.id", ondelete="CASCADE"), primary_key=True)
    ticker: Mapped[str] = mapped_column(String(32), primary_key=True, index=True)

    news: Mapped[NewsItem] = relationship(back_populates="tickers")


class Signal(Base):
    """One forecast of the robot's own models."""

    __tablename__ = "signals"
    __table_args__ = (
        UniqueConstraint("ticker", "generated_at", "model", "horizon"),
        Index("ix_signals_ticker_generated_at", "ticker", "generated_at"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    ticker: Mapped[str] = mapped_column(String(32))
    generated_at: Mapped[datetime]
    received_at: Mapped[datetime]
    horizon: Mapped[str] = mapped_column(String(32))
    direction: Mapped[int | None]  # -1 down, 0 flat, +1 up
    target: Mapped[float | None] = mapped_column(Float)
    confidence: Mapped[float | None] = mapped_column(Float)
    model: Mapped[str] = mapped_column(String(200))
    extras: Mapped[dict[str, Any]] = mapped_column(default=dict)
    source: Mapped[str] = mapped_column(String(500))


# --------------------------------------------------------------------------- jobs


class Run(Base):
    """One execution of a job (ingest, plan, generate, report...): its outcome and progress."""

    __tablename__ = "runs"
    __table_args__ = (Index("ix_runs_kind_started_at", "kind", "started_at"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    kind: Mapped[str] = mapped_column(String(64))
    status: Mapped[str] = mapped_column(String(32))  # running | ok | failed | aborted | skipped
    as_of: Mapped[datetime | None]
    started_at: Mapped[datetime]
    finished_at: Mapped[datetime | None]
    heartbeat_at: Mapped[datetime | None]
    done: Mapped[int] = mapped_column(default=0)
    total: Mapped[int] = mapped_column(default=0)
    tokens_per_s: Mapped[float | None] = mapped_column(Float)
    counts: Mapped[dict[str, Any]] = mapped_column(default=dict)
    host: Mapped[str | None] = mapped_column(String(255))
    pid: Mapped[int | None]
    error: Mapped[str | None] = mapped_column(Text)


class GenerationRequest(Base):
    """A rendered prompt waiting for (or done with) the model: the nightly work queue.

    One row per (night, instrument, template, redo): a redo of a night adds rows, it never
    rewrites one, so the history keeps what each attempt produced.
    """

    __tablename__ = "generation_requests"
    __table_args__ = (
        UniqueConstraint("as_of", "ticker", "template_name", "redo"),
        Index("ix_generation_requests_status_as_of", "status", "as_of"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    as_of: Mapped[datetime]
    ticker: Mapped[str] = mapped_column(String(32))
    template_name: Mapped[str] = mapped_column(String(200))
    template_version: Mapped[str] = mapped_column(String(64))
    prompt: Mapped[str] = mapped_column(Text)
    prompt_sha256: Mapped[str] = mapped_column(String(64))
    prompt_tokens: Mapped[int]
    news_ids: Mapped[list[int]] = mapped_column(default=list)
    signal_ids: Mapped[list[int]] = mapped_column(default=list)
    params: Mapped[dict[str, Any]] = mapped_column(default=dict)
    valid_until: Mapped[datetime]
    status: Mapped[str] = mapped_column(String(32), default="pending")  # pending|running|done|failed
    attempts: Mapped[int] = mapped_column(default=0)
    lease_owner: Mapped[str | None] = mapped_column(String(255))
    lease_expires_at: Mapped[datetime | None]
    last_error: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime]
    updated_at: Mapped[datetime]
    #: 0 as planned; each ``batch redo`` of the night queues the request again one higher (a new row).
    redo: Mapped[int] = mapped_column(default=0, server_default="0")


class Thesis(Base):
    """A generated thesis and its time contract.

    ``as_of`` is the data cut-off, ``available_at`` the moment it was committed (a backtest
    may see it only from then on), ``valid_until`` when it goes stale.
    """

    __tablename__ = "theses"
    __table_args__ = (
        UniqueConstraint("request_id"),
        Index("ix_theses_ticker_available_at", "ticker", "available_at"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    request_id: Mapped[int] = mapped_column(ForeignKey("generation_requests.id"))
    ticker: Mapped[str] = mapped_column(String(32))
    template_name: Mapped[str] = mapped_column(String(200))
    template_version: Mapped[str] = mapped_column(String(64))
    text: Mapped[str] = mapped_column(Text)
    stance: Mapped[float | None] = mapped_column(Float)  # -1 (bearish) .. +1 (bullish)
    stance_label: Mapped[str | None] = mapped_column(String(64))
    score: Mapped[float | None] = mapped_column(Float)  # confidence of the stance, 0..1
    label_logprobs: Mapped[dict[str, Any]] = mapped_column(default=dict)
    model_id: Mapped[str] = mapped_column(String(200))
    params: Mapped[dict[str, Any]] = mapped_column(default=dict)
    seed: Mapped[int | None] = mapped_column(BigInteger)
    prompt_sha256: Mapped[str] = mapped_column(String(64))
    prompt_tokens: Mapped[int]
    completion_tokens: Mapped[int]
    finish_reason: Mapped[str] = mapped_column(String(16))
    generation_seconds: Mapped[float] = mapped_column(Float)
    news_ids: Mapped[list[int]] = mapped_column(default=list)
    signal_ids: Mapped[list[int]] = mapped_column(default=list)
    as_of: Mapped[datetime]
    available_at: Mapped[datetime]
    valid_until: Mapped[datetime]
    # Stance quality (revision 0004): what kind of row this is, and how its stance was read.
    kind: Mapped[str] = mapped_column(String(16), default="thesis", server_default="thesis")  # see THESIS_KINDS
    flags: Mapped[list[str]] = mapped_column(default=list, server_default="[]")  # robot_llm.thesis.checks
    stance_probs: Mapped[dict[str, Any]] = mapped_column(default=dict, server_default="{}")  # label -> p
    text_stance: Mapped[float | None] = mapped_column(Float)  # the stance read after the thesis
    news_stance: Mapped[float | None] = mapped_column(Float)  # the news items' stances, aggregated
    # Revision 0005: which reading ``stance`` is, one of STANCE_SOURCES (None: stored before it was recorded).
    stance_source: Mapped[str | None] = mapped_column(String(16))


#: ``Thesis.kind``: a generated thesis, a stance asked without a thesis (``max_new_tokens: 0``),
#: or the explicit abstention of a prompt that had no news and no signals (no text, no stance).
THESIS_KINDS = ("thesis", "stance_only", "no_inputs")

#: ``Thesis.stance_source``: the label words after the thesis, after the news, or a stance head
#: (:mod:`robot_llm.night.stance_head`) on the model's hidden state where the news stance is read.
STANCE_SOURCES = ("thesis", "news", "head")


class DaemonLease(Base):
    """The single-instance lock of the daemon: who holds it, and until when."""

    __tablename__ = "daemon_leases"

    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    holder: Mapped[str] = mapped_column(String(255))  # an opaque token unique to the holder
    host: Mapped[str] = mapped_column(String(255))
    pid: Mapped[int]
    acquired_at: Mapped[datetime]
    heartbeat_at: Mapped[datetime]
    expires_at: Mapped[datetime]
    state: Mapped[str] = mapped_column(String(64), default="starting")
    released: Mapped[bool] = mapped_column(Boolean, default=False)


# --------------------------------------------------------------------------- prices


class Price(Base):
    """One close of one instrument: ``time`` is the moment the close was known (the bar's end)."""

    __tablename__ = "prices"
    __table_args__ = (UniqueConstraint("ticker", "time"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    ticker: Mapped[str] = mapped_column(String(32))
    time: Mapped[datetime]
    close: Mapped[float] = mapped_column(Float)
    source: Mapped[str] = mapped_column(String(500))
    ingested_at: Mapped[datetime]


# --------------------------------------------------------------------------- engines


class DatabaseError(RobotLLMError):
    """The database cannot be reached or is not usable; the message is for the user."""


def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
    # WAL lets strategies read while the worker writes; a busy timeout makes a writer wait
    # for the other instead of failing at once.
    cur = dbapi_conn.cursor()
    cur.execute("PRAGMA journal_mode=WAL")
    cur.execute("PRAGMA foreign_keys=ON")
    cur.execute("PRAGMA busy_timeout=30000")
    cur.execute("PRAGMA synchronous=NORMAL")
    cur.close()


def make_engine(url: str, *, echo: bool = False) -> Engine:
    """Create an engine with robot-llm's defaults (SQLite: WAL, foreign keys, busy timeout)."""
    if url.startswith("sqlite"):
        engine = create_engine(
            url,
            echo=echo,
            connect_args={"check_same_thread": False, "timeout": 30},
            json_serializer=lambda o: json.dumps(o, ensure_ascii=False),
        )
        event.listen(engine, "connect", _sqlite_pragmas)
        return engine
    if url.startswith("postgresql://") or url.startswith("postgres://"):
        # psycopg 3 is the driver we install; the bare scheme would ask for psycopg2.
        url = "postgresql+psycopg://" + url.split("://", 1)[1]
    return create_engine(
        url,
        echo=echo,
        pool_pre_ping=True,
        connect_args={"connect_timeout": 10} if "psycopg" in url else {},
        json_serializer=lambda o: json.dumps(o, ensure_ascii=False),
    )


def db_clock(dialect: str) -> ColumnElement[datetime]:
    """The database's own current time inside a statement, stored like any :class:`UTCDateTime`.

    PostgreSQL: ``clock_timestamp()`` (the moment the statement runs, not the start of its
    transaction). SQLite: ``'now'`` in SQLAlchemy's text layout with microseconds.
    """
    if dialect == "postgresql":
        return func.clock_timestamp().cast(DateTime(timezone=True))
    if dialect == "sqlite":
        return literal_column("strftime('%Y-%m-%d %H:%M:%f', 'now') || '000'", DateTime())
    raise DatabaseError(f"robot-llm needs PostgreSQL or SQLite, not {dialect}")


def error_line(exc: BaseException) -> str:
    """The first line of a database error: the driver's own message, without SQLAlchemy's SQL echo."""
    orig = getattr(exc, "orig", None)
    text = str(orig if orig is not None else exc).strip()
    return (text.splitlines() or [type(exc).__name__])[0]


def check_connection(engine: Engine) -> None:
    """Connect once; raise DatabaseError with a one-line reason when that fails."""
    from sqlalchemy.exc import DBAPIError, OperationalError

    try:
        with engine.connect() as conn:
            conn.execute(text("SELECT 1"))
    except (OperationalError, DBAPIError) as exc:
        raise DatabaseError(
            f"cannot connect to the database {engine.url.render_as_string()}: {error_line(exc)}"
        ) from None


@contextmanager
def session_scope(engine: Engine) -> Iterator[Session]:
    """One unit of work: commit on success, roll back on error."""
    factory = sessionmaker(engine, expire_on_commit=False)
    with factory.begin() as session:
        yield session
