"""Closing prices into the ``prices`` table: a CSV drop folder, freqtrade's data folder, the robot's signals.

Every source becomes rows ``(ticker, time, close)`` where ``time`` is the moment the close
was known, in UTC; the track record (:mod:`robot_llm.track.outcomes`) joins theses to them.

Sources (the ``prices:`` section of the config):

- ``csv: FOLDER``: one file per ticker, ``TICKER.csv``, with a header naming at least
  ``time`` and ``close`` (any case; extra columns such as open, high, low, volume are
  ignored). ``time`` is ISO 8601 with a zone (``2026-11-30T18:50:00+03:00``, ``...Z``), or a
  date ``2026-11-30`` meaning that day's close: at ``prices.market_close`` (default 18:50) in
  the config's ``timezone``, or at the ticker's ``prices.close_times`` entry (``"16:00
  America/New_York"``). A time without a zone is refused: read in the wrong zone it would
  move a close across a thesis.
- ``freqtrade: {data_dir, timeframe, pairs}``: what ``freqtrade download-data`` writes,
  ``<data_dir>/<PAIR>-<timeframe>.feather`` (needs pandas and pyarrow) or ``.json`` (a list
  of ``[ms, open, high, low, close, volume]`` candles). freqtrade dates a candle by its
  *open* (UTC); its close is known only when the candle ends, so it is stored at
  ``date + timeframe``.
- ``signal_price: KEY``: a robot signal whose ``extras[KEY]`` is a number is a close of its
  ticker at its ``generated_at``.

Ingest is idempotent: ``(ticker, time)`` is unique and a rerun stores nothing twice. A close
that differs from the one already stored for the same moment is kept as stored and reported
(prices are facts a past ledger read may rest on; fix them by hand, deliberately). Bad rows
are reported as ``file:line: reason`` and the good rows of the file are stored.
"""

from __future__ import annotations

import csv
import json
import logging
import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import date, datetime, timedelta, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sqlalchemy import select
from sqlalchemy.exc import SQLAlchemyError

from robot_llm.errors import RobotLLMError
from robot_llm.ingest import insert_ignoring_duplicates
from robot_llm.store.db import Price, Signal, error_line, session_scope, utcnow

if TYPE_CHECKING:
    from sqlalchemy.engine import Engine

    from robot_llm.config import AppConfig
    from robot_llm.config_sections import FreqtradePricesConfig

__all__ = [
    "PriceRow",
    "PriceSourceResult",
    "freqtrade_path",
    "ingest_prices",
    "read_csv_prices",
    "read_freqtrade_prices",
    "store_prices",
    "timeframe_delta",
]

log = logging.getLogger(__name__)

FEATHER_HINT = "pip install 'robot-llm[feather]'"
_DATE_RE = re.compile(r"^\d{4}-\d{2}-\d{2}$")
_TIMEFRAME_UNITS = {"m": 60, "h": 3600, "d": 86400, "w": 604800}


@dataclass(frozen=True)
class PriceRow:
    """One close read from a source; ``line`` is where it came from (file line, candle or signal id)."""

    ticker: str
    time: datetime
    close: float
    line: int


@dataclass
class PriceSourceResult:
    """What one file (or the signals) gave: stored, already there, refused and why."""

    source: str
    path: str
    ticker: str | None
    read: int = 0
    stored: int = 0
    duplicates: int = 0
    conflicts: list[str] = field(default_factory=list)
    rejects: list[str] = field(default_factory=list)
    error: str | None = None

    @property
    def ok(self) -> bool:
        """True unless the whole source failed (bad rows alone do not fail it)."""
        return self.error is None


# --------------------------------------------------------------------------- reading


def _close(value: Any) -> float:
    number = float(value)
    if not math.isfinite(number) or number <= 0:
        raise ValueError(f"close must be a positive number, got {value!r}")
    return number


def read_csv_prices(path: Path, ticker: str, *, zone: Any, close_time: Any) -> tuple[list[PriceRow], list[str]]:
    """The closes of one ``TICKER.csv`` and its rejected rows (``file:line: reason``).

    Raises RobotLLMError (``file:1: ...``) when the file cannot be read or has no ``time``
    and ``close`` columns.
    """
    try:
        text = path.read_text(encoding="utf-8-sig")
    except (OSError, UnicodeDecodeError) as exc:
        raise RobotLLMError(f"{path}: cannot read: {exc}") from None
    reader = csv.reader(text.splitlines())
    header = next(reader, None)
    names = [h.strip().lower() for h in header or []]
    if "time" not in names or "close" not in names:
        raise RobotLLMError(f"{path}:1: the header must name the columns time and close, got {header!r}")
    t_col, c_col = names.index("time"), names.index("close")
    rows: list[PriceRow] = []
    rejects: list[str] = []
    seen: dict[datetime, tuple[int, float]] = {}
    for cells in reader:
        line = reader.line_num
        if not any(c.strip() for c in cells):
            continue
        try:
            if len(cells) <= max(t_col, c_col):
                raise ValueError(f"expected at least {max(t_col, c_col) + 1} columns, got {len(cells)}")
            stamp = _csv_time(cells[t_col].strip(), zone, close_time)
            close = _close(cells[c_col].strip())
        except ValueError as exc:
            rejects.append(f"{path}:{line}: {exc}")
            continue
        if stamp in seen:
            first_line, first_close = seen[stamp]
            if first_close != close:
                rejects.append(
                    f"{path}:{line}: {stamp.isoformat()} is also on line {first_line} with another close "
                    f"({first_close!r}); kept line {first_line}"
                )
            continue
        seen[stamp] = (line, close)
        rows.append(PriceRow(ticker, stamp, close, line))
    return rows, rejects


def _csv_time(raw: str, zone: Any, close_time: Any) -> datetime:
    if _DATE_RE.match(raw):
        try:
            day = date.fromisoformat(raw)
        except ValueError as exc:
            raise ValueError(f"invalid date {raw!r}: {exc}") from None
        return datetime.combine(day, close_time, tzinfo=zone).astimezone(timezone.utc)
    try:
        stamp = datetime.fromisoformat(raw.replace("z", "Z").replace("Z", "+00:00"))
    except ValueError:
        raise ValueError(f"time {raw!r} is neither ISO 8601 nor a date") from None
    if stamp.tzinfo is None or stamp.utcoffset() is None:
        raise ValueError(f"time {raw!r} has no zone (add +03:00 or Z, or give a date for that day's close)")
    return stamp.astimezone(timezone.utc)


def timeframe_delta(timeframe: str) -> timedelta:
    """A freqtrade timeframe (``5m``, ``1h``, ``1d``, ``1w``) as a timedelta."""
    m = re.fullmatch(r"(\d+)([mhdw])", timeframe)
    if not m:
        raise RobotLLMError(f"unsupported freqtrade timeframe {timeframe!r} (use minutes, hours, days or weeks)")
    return timedelta(seconds=int(m.group(1)) * _TIMEFRAME_UNITS[m.group(2)])


def _pair_stem(pair: str) -> str:
    # freqtrade's own file naming (misc.pair_to_filename): BTC/USDT -> BTC_USDT.
    return re.sub(r"[/ .@$+:]", "_", pair)


def freqtrade_path(data_dir: Path, pair: str, timeframe: str) -> Path | None:
    """The candle file of ``pair`` (feather first, then json), named as freqtrade names it; None if absent."""
    stem = _pair_stem(pair)
    for suffix in (".feather", ".json"):
        path = data_dir / f"{stem}-{timeframe}{suffix}"
        if path.is_file():
            return path
    return None


def read_freqtrade_prices(path: Path, ticker: str, timeframe: str) -> tuple[list[PriceRow], list[str]]:
    """The closes of one freqtrade candle file, each at its candle's end; rejects as ``file:candle: reason``."""
    step = timeframe_delta(timeframe)
    candles: list[tuple[Any, Any]] = []
    if path.suffix == ".feather":
        try:
            import pandas as pd
        except ImportError:
            raise RobotLLMError(f"{path}: reading feather needs pandas and pyarrow: {FEATHER_HINT}") from None
        try:
            frame = pd.read_feather(path, columns=["date", "close"])
        except ImportError:
            raise RobotLLMError(f"{path}: reading feather needs pyarrow: {FEATHER_HINT}") from None
        except Exception as exc:  # pyarrow's errors have no common base worth naming
            raise RobotLLMError(f"{path}: cannot read the feather file: {exc}") from None
        candles = list(zip(frame["date"].tolist(), frame["close"].tolist(), strict=True))
    else:
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ValueError) as exc:
            raise RobotLLMError(f"{path}: cannot read the candles: {exc}") from None
        if not isinstance(data, list):
            raise RobotLLMError(f"{path}: expected a JSON list of [ms, open, high, low, close, volume] candles")
        for item in data:
            ok = isinstance(item, list) and len(item) >= 5
            candles.append((item[0], item[4]) if ok else (None, None))
    rows: list[PriceRow] = []
    rejects: list[str] = []
    for index, (opened, close) in enumerate(candles, start=1):
        try:
            stamp = _candle_open(opened)
            rows.append(PriceRow(ticker, stamp + step, _close(close), index))
        except (ValueError, TypeError, OverflowError) as exc:
            rejects.append(f"{path}:candle {index}: {exc}")
    return rows, rejects


def _candle_open(value: Any) -> datetime:
    if hasattr(value, "to_pydatetime"):  # a pandas Timestamp from a feather file
        value = value.to_pydatetime()
    if isinstance(value, datetime):
        if value.tzinfo is None:
            return value.replace(tzinfo=timezone.utc)  # freqtrade's dates are UTC
        return value.astimezone(timezone.utc)
    if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
        return datetime.fromtimestamp(value / 1000, tz=timezone.utc)
    raise ValueError(f"expected a candle as [ms, open, high, low, close, volume], got a date {value!r}")


def signal_prices(engine: Engine, key: str, tickers: Iterable[str]) -> tuple[list[PriceRow], list[str]]:
    """Closes carried by stored signals (``extras[key]``), at each signal's ``generated_at``."""
    wanted = set(tickers)
    rows: list[PriceRow] = []
    rejects: list[str] = []
    with engine.connect() as conn:
        found = conn.execute(select(Signal.id, Signal.ticker, Signal.generated_at, Signal.extras).order_by(Signal.id))
        for sid, ticker, generated_at, extras in found:
            if ticker not in wanted or not isinstance(extras, dict) or key not in extras:
                continue
            try:
                close = _close(extras[key])
            except (ValueError, TypeError):
                rejects.append(f"signal {sid}: extras.{key} must be a positive number, got {extras[key]!r}")
                continue
            rows.append(PriceRow(ticker, generated_at, close, sid))
    # One moment, two signals (two models): the first stored wins, like a re-ingest.
    unique: dict[tuple[str, datetime], PriceRow] = {}
    for row in rows:
        unique.setdefault((row.ticker, row.time), row)
    return list(unique.values()), rejects


# --------------------------------------------------------------------------- storing


def store_prices(engine: Engine, rows: Sequence[PriceRow], source: str, result: PriceSourceResult) -> None:
    """Insert ``rows`` (one transaction); count what was new, already there, or there with another close."""
    result.read += len(rows)
    if not rows:
        return
    now = utcnow()
    by_ticker: dict[str, list[PriceRow]] = {}
    for row in rows:
        by_ticker.setdefault(row.ticker, []).append(row)
    with session_scope(engine) as session:
        for ticker, group in by_ticker.items():
            lo, hi = min(r.time for r in group), max(r.time for r in group)
            stored = dict(
                session.execute(
                    select(Price.time, Price.close).where(Price.ticker == ticker, Price.time >= lo, Price.time <= hi)
                ).all()
            )
            fresh = []
            for row in group:
                old = stored.get(row.time)
                if old is None:
                    fresh.append({"ticker": ticker, "time": row.time, "close": row.close, "source": source[:500]})
                elif old == row.close:
                    result.duplicates += 1
                else:
                    result.conflicts.append(
                        f"{result.path}:{row.line}: {ticker} {row.time.isoformat()} is stored with close {old!r}, "
                        f"not {row.close!r}; kept the stored one"
                    )
            if fresh:
                for item in fresh:
                    item["ingested_at"] = now
                # A concurrent ingest may have stored some meanwhile: ON CONFLICT skips those, and
                # RETURNING counts what this one stored. Chunks stay under SQLite's variable limit.
                inserted = 0
                for start in range(0, len(fresh), 1000):
                    stmt = insert_ignoring_duplicates(session, Price).values(fresh[start : start + 1000])
                    inserted += len(session.execute(stmt.returning(Price.id)).all())
                result.stored += inserted
                result.duplicates += len(fresh) - inserted


def _price_tickers(config: AppConfig) -> list[str]:
    tickers = [inst.ticker for inst in config.instruments]
    if config.prices.benchmark and config.prices.benchmark not in tickers:
        tickers.append(config.prices.benchmark)
    return tickers


def _ingest_file(engine: Engine, source: str, path: Path, ticker: str, read: Any) -> PriceSourceResult:
    result = PriceSourceResult(source, str(path), ticker)
    try:
        rows, rejects = read()
        result.rejects.extend(rejects)
        store_prices(engine, rows, f"{source}:{path}", result)
    except RobotLLMError as exc:
        result.error = str(exc)
    except SQLAlchemyError as exc:
        result.error = f"{path}: database error, nothing of this file stored: {error_line(exc)}"
    return result


def ingest_prices(config: AppConfig, engine: Engine) -> list[PriceSourceResult]:
    """Read every configured price source and store what is new; one result per file (and one for signals)."""
    prices = config.prices
    tickers = _price_tickers(config)
    results: list[PriceSourceResult] = []
    if prices.csv is not None:
        folder = prices.csv
        if not folder.is_dir():
            results.append(PriceSourceResult("csv", str(folder), None, error=f"{folder}: prices.csv is not a folder"))
        else:
            for ticker in tickers:
                path = folder / f"{ticker}.csv"
                if not path.is_file():
                    continue

                def read(path: Path = path, ticker: str = ticker) -> tuple[list[PriceRow], list[str]]:
                    clock, zone = prices.close_time(ticker, config.timezone)
                    return read_csv_prices(path, ticker, zone=zone, close_time=clock)

                results.append(_ingest_file(engine, "csv", path, ticker, read))
    if prices.freqtrade is not None:
        results.extend(_ingest_freqtrade(engine, prices.freqtrade))
    if prices.signal_price is not None:
        result = PriceSourceResult("signals", "signals", None)
        try:
            rows, rejects = signal_prices(engine, prices.signal_price, tickers)
            result.rejects.extend(rejects)
            store_prices(engine, rows, "signals", result)
        except SQLAlchemyError as exc:
            result.error = f"signals: database error: {error_line(exc)}"
        results.append(result)
    for r in results:
        for line in r.rejects + r.conflicts:
            log.warning("prices: %s", line)
    return results


def _ingest_freqtrade(engine: Engine, ft: FreqtradePricesConfig) -> list[PriceSourceResult]:
    results = []
    for ticker, pair in ft.pairs.items():
        path = freqtrade_path(ft.data_dir, pair, ft.timeframe)
        if path is None:
            missing = ft.data_dir / f"{_pair_stem(pair)}-{ft.timeframe}.feather|.json"
            results.append(
                PriceSourceResult("freqtrade", str(missing), ticker, error=f"{missing}: no candle file for {pair}")
            )
            continue
        results.append(
            _ingest_file(
                engine,
                "freqtrade",
                path,
                ticker,
                lambda path=path, ticker=ticker: read_freqtrade_prices(path, ticker, ft.timeframe),
            )
        )
    return results
