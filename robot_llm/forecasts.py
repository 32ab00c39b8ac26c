"""The read API for strategies: theses and the robot's signals, point-in-time.

A strategy (live, or in a backtest) asks "what did robot-llm know at moment T?" and gets
only rows that had been committed by T (``available_at <= T`` for theses, ``received_at
<= T`` for signals), so a backtest cannot see a thesis before it existed. This module is
the only thing strategy code needs; it never has to know table names.

It is light on purpose: it imports SQLAlchemy and the ORM schema, never torch, the
scheduler or the template engine, so a strategy host without a GPU stack starts fast.
pandas is optional and imported only by the functions that return DataFrames.

Semantics, stated once:

* **latest** is the most recently *available* thesis (replay order, like NautilusTrader's
  ``ts_init``); ties go to the later ``as_of``, then the higher id. Pass ``template=`` when
  several templates write theses for one instrument.
* **stale**: a thesis is valid while ``moment < valid_until``. When the latest available
  thesis is stale, ``latest`` returns ``None`` — the thesis *abstains*; it is not a neutral
  view, and an older thesis does not stand in for it.
* **history** returns every thesis that became available in ``[start, end]`` (both ends
  included), ordered as it became available — what a replay would have received.
* Every moment passed in must be an aware datetime (any zone); naive ones are refused.
  Records carry aware UTC datetimes.

Example::

    from datetime import datetime
    from zoneinfo import ZoneInfo
    from robot_llm.forecasts import Forecasts

    with Forecasts.from_config("config/demo.yaml") as fc:
        thesis = fc.latest("SBER", datetime(2026, 11, 30, 9, 0, tzinfo=ZoneInfo("Europe/Moscow")))
        if thesis is None:
            ...  # no valid thesis: abstain
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from datetime import date, datetime, time, timedelta, timezone, tzinfo
from pathlib import Path
from typing import TYPE_CHECKING, Any
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from sqlalchemy import Select, and_, inspect, select
from sqlalchemy.engine import Engine
from sqlalchemy.exc import DBAPIError

# The records and errors strategies use live in forecast_records; they are imported from here.
from robot_llm.forecast_records import (
    SIGNAL_COLUMNS,
    THESIS_COLUMNS,
    THESIS_FIELDS,
    ForecastsError,
    ItemStance,
    NaiveDatetimeError,
    SignalRecord,
    ThesisRecord,
    require_aware,
    thesis_record,
    to_dataframe,
)
from robot_llm.store.db import DatabaseError, Signal, Thesis, check_connection, error_line, make_engine
from robot_llm.store.migrate import SchemaOutOfDateError, ensure_current
from robot_llm.track.figures import LedgerSettings

if TYPE_CHECKING:
    import pandas as pd

    from robot_llm.track.ledger import LedgerRow

__all__ = [
    "THESIS_FIELDS",
    "Forecasts",
    "ForecastsError",
    "ItemStance",
    "NaiveDatetimeError",
    "SignalRecord",
    "ThesisRecord",
    "parse_moment",
    "require_aware",
    "to_dataframe",
]

# The default morning cut-off, the same as ``schedule.cutoff`` in the config; repeated here
# so that opening by URL does not import the config layer (pydantic, yaml).
DEFAULT_CUTOFF = time(9, 30)


def _zone(tz: tzinfo | str) -> tzinfo:
    if isinstance(tz, tzinfo):
        return tz
    try:
        return ZoneInfo(tz)
    except (ZoneInfoNotFoundError, ValueError):
        raise ForecastsError(f"unknown time zone {tz!r} (use an IANA name like 'Europe/Moscow')") from None


# --------------------------------------------------------------------------- the reader


class Forecasts:
    """Point-in-time reads of theses and signals from robot-llm's database.

    Open with :meth:`open` (a database URL) or :meth:`from_config` (the YAML config); use
    as a context manager or call :meth:`close`. Every query runs in its own short read
    transaction, so it sees only committed rows, each whole, even while the nightly batch
    is writing. Safe to share between threads.
    """

    def __init__(
        self,
        engine: Engine,
        *,
        tz: tzinfo | str = "UTC",
        cutoff: time = DEFAULT_CUTOFF,
        owns_engine: bool = False,
    ) -> None:
        """Wrap an existing engine; ``tz`` and ``cutoff`` define trading days for :meth:`for_day`."""
        self._engine = engine
        self._owns_engine = owns_engine
        self.timezone = _zone(tz)
        self.cutoff = cutoff
        self.tickers: tuple[str, ...] = ()
        # The track record's horizons, benchmark and limits (the config's ``prices:`` section).
        self.ledger_settings = LedgerSettings()

    @classmethod
    def open(cls, url: str, *, tz: tzinfo | str = "UTC", cutoff: time = DEFAULT_CUTOFF) -> Forecasts:
        """Open the database at ``url``; raise DatabaseError when it is missing, unreachable or not migrated."""
        if url.startswith("sqlite:///") and url != "sqlite:///:memory:":
            # Connecting would silently create an empty file: a typo must not look like "no theses".
            path = Path(url[len("sqlite:///") :].split("?", 1)[0])
            if not path.is_file():
                raise DatabaseError(f"no database file at {path} (check database.url, or run `robot-llm db upgrade`)")
        engine = make_engine(url)
        try:
            check_connection(engine)
            if not inspect(engine).has_table(Thesis.__tablename__):
                raise DatabaseError(
                    f"the database {engine.url.render_as_string()} has no theses table; run `robot-llm db upgrade`"
                )
        except BaseException:
            engine.dispose()
            raise
        return cls(engine, tz=tz, cutoff=cutoff, owns_engine=True)

    @classmethod
    def from_config(cls, path: str | os.PathLike[str]) -> Forecasts:
        """Open the database named by a robot-llm YAML config, with its time zone, cut-off and tickers."""
        from robot_llm.config import load_config

        config = load_config(path)
        forecasts = cls.open(config.database.url, tz=config.timezone, cutoff=config.schedule.cutoff)
        forecasts.tickers = tuple(inst.ticker for inst in config.instruments)
        forecasts.ledger_settings = LedgerSettings.from_config(config.prices)
        return forecasts

    def close(self) -> None:
        """Release the database connections (only when this object opened them)."""
        if self._owns_engine:
            self._engine.dispose()

    def __enter__(self) -> Forecasts:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _rows(self, stmt: Select[Any]) -> list[Any]:
        try:
            with self._engine.connect() as conn:
                return list(conn.execute(stmt))
        except DBAPIError as exc:
            raise self._read_failed(exc) from None

    def _read_failed(self, exc: DBAPIError) -> ForecastsError:
        """The error for a failed read; one against a schema older than this robot-llm (a column that a later
        revision adds is missing) says to upgrade it, as the daemon does (:func:`store.migrate.ensure_current`)."""
        message = f"reading {self._engine.url.render_as_string()} failed: {error_line(exc)}"
        try:
            ensure_current(self._engine)
        except SchemaOutOfDateError as stale:
            message += f" ({stale})"
        except DBAPIError:
            pass  # the database itself is the problem: the read's own error says so
        return ForecastsError(message)

    # ----------------------------------------------------------------------- theses

    def latest(
        self,
        ticker: str,
        as_of: datetime,
        *,
        template: str | None = None,
        include_stale: bool = False,
    ) -> ThesisRecord | None:
        """The latest thesis for ``ticker`` available at ``as_of``; ``None`` when there is none or it is stale.

        Among the rows with ``available_at <= as_of``, the latest is the one with the newest data
        cut-off (its ``as_of``), then the newest commit: a thesis backfilled for an older night
        and committed later does not hide tonight's. When that latest thesis is past its
        ``valid_until`` the answer is ``None`` (abstain; an older thesis does not stand in for
        it), unless ``include_stale=True``.
        """
        moment = require_aware(as_of, "as_of")
        stmt = select(*THESIS_COLUMNS).where(Thesis.ticker == ticker, Thesis.available_at <= moment)
        if template is not None:
            stmt = stmt.where(Thesis.template_name == template)
        stmt = stmt.order_by(Thesis.as_of.desc(), Thesis.available_at.desc(), Thesis.id.desc()).limit(1)
        rows = self._rows(stmt)
        if not rows:
            return None
        record = thesis_record(rows[0])
        if not include_stale and record.valid_until <= moment:
            return None
        return record

    def latest_many(
        self,
        tickers: Iterable[str],
        as_of: datetime,
        *,
        template: str | None = None,
        include_stale: bool = False,
    ) -> dict[str, ThesisRecord | None]:
        """:meth:`latest` for each ticker, in the order given."""
        moment = require_aware(as_of, "as_of")
        return {t: self.latest(t, moment, template=template, include_stale=include_stale) for t in tickers}

    def day_window(self, trading_day: date, tz: tzinfo | str | None = None) -> tuple[datetime, datetime]:
        """The ``[start, end)`` of ``as_of`` moments whose theses belong to ``trading_day``.

        A trading day's theses are those written from data cut between the previous day's
        morning cut-off and this day's (``schedule.cutoff`` in the config, 09:30 by default),
        in ``tz`` (default: the config's zone, UTC when opened by URL). The nightly batch
        before Monday's open therefore belongs to Monday.
        """
        if isinstance(trading_day, datetime) or not isinstance(trading_day, date):
            raise ForecastsError(f"trading_day: expected a date, got {type(trading_day).__name__} {trading_day!r}")
        zone = self.timezone if tz is None else _zone(tz)
        end = datetime.combine(trading_day, self.cutoff, tzinfo=zone)
        start = datetime.combine(trading_day - timedelta(days=1), self.cutoff, tzinfo=zone)
        return start.astimezone(timezone.utc), end.astimezone(timezone.utc)

    def for_day(
        self,
        trading_day: date,
        tz: tzinfo | str | None = None,
        *,
        tickers: Iterable[str] | None = None,
    ) -> list[ThesisRecord]:
        """All theses for ``trading_day`` (see :meth:`day_window`), ordered by ticker, template, availability.

        This is the morning listing, not a backtest query: it does not filter on
        ``available_at``; use :meth:`latest` or :meth:`history` to ask what was known when.
        """
        start, end = self.day_window(trading_day, tz)
        stmt = select(*THESIS_COLUMNS).where(Thesis.as_of >= start, Thesis.as_of < end)
        if tickers is not None:
            stmt = stmt.where(Thesis.ticker.in_(list(tickers)))
        stmt = stmt.order_by(Thesis.ticker, Thesis.template_name, Thesis.available_at, Thesis.id)
        return [thesis_record(r) for r in self._rows(stmt)]

    def history(
        self,
        ticker: str | None,
        start: datetime,
        end: datetime,
        *,
        template: str | None = None,
    ) -> list[ThesisRecord]:
        """Every thesis that became available in ``[start, end]``, in the order it became available.

        ``ticker=None`` means all instruments. Replaying these rows in order, a backtest at
        moment T has seen exactly the rows with ``available_at <= T``. To know the thesis
        in force at ``start``, ask :meth:`latest` for ``start`` too.
        """
        lo = require_aware(start, "start")
        hi = require_aware(end, "end")
        if hi < lo:
            raise ForecastsError(f"history: end {hi.isoformat()} is before start {lo.isoformat()}")
        stmt = select(*THESIS_COLUMNS).where(Thesis.available_at >= lo, Thesis.available_at <= hi)
        if ticker is not None:
            stmt = stmt.where(Thesis.ticker == ticker)
        if template is not None:
            stmt = stmt.where(Thesis.template_name == template)
        stmt = stmt.order_by(Thesis.available_at, Thesis.as_of, Thesis.id)
        return [thesis_record(r) for r in self._rows(stmt)]

    def history_frame(
        self,
        ticker: str | None,
        start: datetime,
        end: datetime,
        *,
        template: str | None = None,
    ) -> pd.DataFrame:
        """:meth:`history` as a pandas DataFrame (see :func:`to_dataframe`)."""
        return to_dataframe(self.history(ticker, start, end, template=template))

    # ----------------------------------------------------------------------- track record

    def track_record(
        self,
        as_of: datetime,
        *,
        horizon: timedelta | None = None,
        ticker: str | None = None,
        template: str | None = None,
        model: str | None = None,
        settings: LedgerSettings | None = None,
    ) -> list[LedgerRow]:
        """How the theses available at ``as_of`` fared against the closes known at ``as_of``.

        One :class:`~robot_llm.track.ledger.LedgerRow` per model × template × instrument and
        per model × template over all instruments (``ticker`` None), for ``horizon`` (default:
        every horizon of ``prices.horizons``), each over all time and the rolling window.
        Definitions are in :mod:`robot_llm.track.ledger`; nothing after ``as_of`` is used.
        Needs numpy.
        """
        from robot_llm.track.ledger import track_record

        moment = require_aware(as_of, "as_of")
        try:
            return track_record(
                self._engine,
                moment,
                settings or self.ledger_settings,
                horizons=None if horizon is None else (horizon,),
                ticker=ticker,
                template=template,
                model=model,
            )
        except DBAPIError as exc:
            raise self._read_failed(exc) from None

    # ----------------------------------------------------------------------- signals

    def latest_signal(
        self,
        ticker: str,
        as_of: datetime,
        *,
        horizon: str | None = None,
        model: str | None = None,
        max_age: timedelta | None = None,
    ) -> SignalRecord | None:
        """The robot's most recently generated forecast for ``ticker`` that had been received by ``as_of``.

        Point-in-time on ``received_at``: a signal generated earlier but delivered after
        ``as_of`` is not seen. With ``max_age``, a signal generated more than ``max_age``
        before ``as_of`` counts as none.
        """
        moment = require_aware(as_of, "as_of")
        conditions = [Signal.ticker == ticker, Signal.received_at <= moment]
        if horizon is not None:
            conditions.append(Signal.horizon == horizon)
        if model is not None:
            conditions.append(Signal.model == model)
        if max_age is not None:
            conditions.append(Signal.generated_at >= moment - max_age)
        stmt = (
            select(*SIGNAL_COLUMNS)
            .where(and_(*conditions))
            .order_by(Signal.generated_at.desc(), Signal.received_at.desc(), Signal.id.desc())
            .limit(1)
        )
        rows = self._rows(stmt)
        return SignalRecord(**rows[0]._asdict()) if rows else None


# --------------------------------------------------------------------------- parsing moments

_RELATIVE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|m|h|d|w)\s*(?:ago)?\s*$")
_RELATIVE_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def parse_moment(text: str, *, tz: tzinfo | str = "UTC", now: datetime | None = None) -> datetime:
    """Parse a moment typed by a user into an aware UTC datetime.

    Accepted, and nothing else:

    * ``now``;
    * ISO 8601 with a zone: ``2026-11-30T09:30:00+03:00``, ``2026-11-30T06:30Z``;
    * a date ``2026-11-30``: the start of that day (00:00) in ``tz``;
    * a relative time ago: ``90s``, ``15m``, ``2h``, ``1d``, ``1w`` (optionally followed by ``ago``).

    An ISO time without a zone is refused (it would be ambiguous).
    """
    current = require_aware(now, "now") if now is not None else datetime.now(timezone.utc)
    raw = text.strip()
    if raw.lower() == "now":
        return current
    m = _RELATIVE_RE.match(raw)
    if m:
        return current - timedelta(seconds=float(m.group(1)) * _RELATIVE_UNITS[m.group(2)])
    if re.fullmatch(r"\d{4}-\d{2}-\d{2}", raw):
        try:
            day = date.fromisoformat(raw)
        except ValueError as exc:
            raise ForecastsError(f"invalid date {text!r}: {exc}") from None
        return datetime.combine(day, time(0, 0), tzinfo=_zone(tz)).astimezone(timezone.utc)
    try:
        value = datetime.fromisoformat(raw.replace("z", "Z").replace("Z", "+00:00"))
    except ValueError:
        raise ForecastsError(
            f"cannot read the time {text!r}: use ISO 8601 with a zone (2026-11-30T09:30+03:00), "
            f"a date (2026-11-30, midnight in {_zone(tz)}), 'now', or a relative time like '1d' (ago)"
        ) from None
    if value.tzinfo is None:
        raise NaiveDatetimeError(
            f"the time {text!r} has no zone; add one (e.g. {raw}+03:00 or {raw}Z), or give a date or a relative time"
        )
    return value.astimezone(timezone.utc)
