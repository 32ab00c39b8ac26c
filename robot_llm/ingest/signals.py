"""The robot's own forecasts: drop-folder files (JSONL, CSV) into the ``signals`` table.

Signal schema
=============

One signal is one forecast of one of the robot's models for one instrument:

============  ========  =======================================================================
field         required  meaning
============  ========  =======================================================================
ticker        yes       an instrument of the config (``instruments[].ticker``); matched
                        case-insensitively, stored as configured. Unknown tickers are rejected.
generated_at  yes       when the model made the forecast: ISO 8601 *with a zone*
                        (``2026-11-27T18:40:00+03:00``, ``2026-11-27T15:40:00Z``). A time
                        without a zone is refused, and so is one more than 5 minutes in the
                        future (a local time written as UTC would leak the future into a
                        backtest). Stored in UTC.
horizon       yes       how far ahead it looks, a duration: ``30m``, ``4h``, ``1d``, ``1w``.
direction     one of    ``up`` / ``down`` / ``flat`` (any case) or ``+1`` / ``-1`` / ``0``.
target        these     the forecast value (a price, a return — the robot's convention), a
                        finite number; in CSV a decimal comma is accepted.
confidence    no        a number from 0 to 1.
model         yes       the model's name (up to 200 characters), e.g. ``gbm-v7``.
extras        no        JSON: an object of free-form values. CSV: every other column
                        (non-empty cells, as text), or a column ``extras`` holding a JSON object.
============  ========  =======================================================================

A signal is identified by (ticker, generated_at, model, horizon): the same signal delivered
twice — the same file dropped again, a retried ``publish`` — is stored once.

Files
=====

- **JSONL** (``*.jsonl``, ``*.ndjson``): one JSON object per line, UTF-8; blank lines are
  skipped; a field not in the schema is an error (put it in ``extras``)::

    {"ticker": "SBER", "generated_at": "2026-11-27T18:40:00+03:00", "horizon": "1d",
     "direction": "up", "target": 312.5, "confidence": 0.64, "model": "gbm-v7",
     "extras": {"features": 42}}

- **CSV** (``*.csv``): UTF-8 (a BOM is fine), a header row naming the columns (any order,
  any case); the delimiter is sniffed among ``,`` ``;`` and tab::

    ticker,generated_at,horizon,direction,target,confidence,model,regime
    SBER,2026-11-27T18:40:00+03:00,1d,up,312.5,0.64,gbm-v7,trend

The drop folder
===============

Each ``signals.sources[]`` entry names a ``drop_dir``. The robot writes a file under a name
that ends in ``.tmp`` (or starts with a dot) and renames it to its final ``.jsonl`` / ``.csv``
name when it is complete; a rename is atomic, so robot-llm never reads half a file. Files
ending in ``.tmp``, hidden files, empty files and any other extension (``.part``, ``.rejects``,
...) are left alone.

Each complete file is processed on its own: its good rows are stored in one transaction, then
the file is moved to ``processed/`` inside the drop folder (with a time stamp added if that
name is already there). Bad rows do not stop the good ones: each is written as
``file:line: reason`` to ``<name>.rejects`` next to the dropped file (a fresh drop of the same
name replaces it; a clean one removes it). A crash before the move leaves the file in place
and the next run stores nothing twice.
"""

from __future__ import annotations

import csv
import io
import json
import logging
import os
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from sqlalchemy.engine import Engine
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session

from robot_llm.config import AppConfig
from robot_llm.config_sections import SignalSourceConfig
from robot_llm.ingest import insert_ignoring_duplicates
from robot_llm.ingest.signal_record import FIELDS, REQUIRED, SignalError, SignalRecord, make_signal
from robot_llm.store.db import Signal, error_line, session_scope, utcnow

__all__ = [
    "Reject",
    "SignalFileResult",
    "ingest_signal_file",
    "ingest_signals",
    "pending_files",
    "read_signal_file",
    "store_signals",
]

log = logging.getLogger(__name__)

JSONL_SUFFIXES = (".jsonl", ".ndjson")
CSV_SUFFIXES = (".csv",)
PROCESSED = "processed"


@dataclass(frozen=True)
class Reject:
    """A row that was not stored, and why."""

    line: int
    reason: str
    unknown_ticker: str | None = None


_Parsed = tuple[list[tuple[int, SignalRecord]], list[Reject]]


@dataclass(frozen=True)
class SignalFileResult:
    """What happened to one dropped file."""

    source: str
    path: Path
    """Where the file was dropped."""
    moved_to: Path | None
    rows: int
    stored: int
    duplicates: int
    rejects: tuple[Reject, ...]
    rejects_path: Path | None
    error: str | None = None
    """Set when the file could not be processed (it is left in place; see the counts for what was stored)."""

    @property
    def unknown_tickers(self) -> tuple[str, ...]:
        """Distinct unknown tickers among the rejected rows."""
        return tuple(dict.fromkeys(r.unknown_ticker for r in self.rejects if r.unknown_ticker))


# --------------------------------------------------------------------------- reading


def _decode(content: bytes) -> tuple[str | None, Reject | None]:
    try:
        return content.decode("utf-8-sig"), None
    except UnicodeDecodeError as exc:
        line = content[: exc.start].count(b"\n") + 1
        return None, Reject(line, f"not UTF-8 text ({exc.reason} at byte {exc.start}); save the file as UTF-8")


def _read_jsonl(text: str, known: Collection[str], now: datetime) -> _Parsed:
    good: list[tuple[int, SignalRecord]] = []
    bad: list[Reject] = []
    # Split on "\n" only: str.splitlines would also break inside a JSON string holding U+2028.
    for number, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        try:
            data = json.loads(line)
        except json.JSONDecodeError as exc:
            bad.append(Reject(number, f"not valid JSON: {exc.msg} (column {exc.colno})"))
            continue
        if not isinstance(data, dict):
            bad.append(Reject(number, f"expected a JSON object, got {type(data).__name__}"))
            continue
        try:
            good.append((number, make_signal(data, known_tickers=known, now=now)))
        except SignalError as exc:
            bad.append(Reject(number, str(exc), exc.unknown_ticker))
    return good, bad


def _read_csv(text: str, known: Collection[str], now: datetime) -> _Parsed:
    first_line = text.split("\n", 1)[0]
    try:
        dialect: type[csv.Dialect] | csv.Dialect = csv.Sniffer().sniff(first_line, delimiters=",;\t")
    except csv.Error:
        dialect = csv.excel
    reader = csv.reader(io.StringIO(text, newline=""), dialect)
    try:
        header = [h.strip().lower() for h in next(reader)]
    except StopIteration:
        return [], []
    missing = [c for c in REQUIRED if c not in header]
    dupes = sorted({h for h in header if header.count(h) > 1})
    if missing or dupes or "" in header:
        reasons = []
        if missing:
            reasons.append(f"the header lacks column(s) {', '.join(missing)}")
        if dupes:
            reasons.append(f"duplicate column(s) {', '.join(dupes)}")
        if "" in header:
            reasons.append("a column without a name")
        return [], [Reject(1, "; ".join(reasons) + "; no row of this file was read")]
    good: list[tuple[int, SignalRecord]] = []
    bad: list[Reject] = []
    previous_end = reader.line_num
    while True:
        try:
            row = next(reader)
        except StopIteration:
            break
        except csv.Error as exc:
            bad.append(Reject(previous_end + 1, f"cannot read CSV: {exc}"))
            break
        number = previous_end + 1
        previous_end = reader.line_num
        if not any(cell.strip() for cell in row):
            continue
        if len(row) != len(header):
            bad.append(Reject(number, f"{len(row)} fields, but the header has {len(header)}"))
            continue
        data: dict[str, object] = {}
        extras: dict[str, object] = {}
        for column, cell in zip(header, row, strict=True):
            if column == "extras":
                continue
            if column in FIELDS:
                data[column] = cell
            elif cell.strip():
                extras[column] = cell.strip()
        cell = row[header.index("extras")].strip() if "extras" in header else ""
        if cell:
            try:
                explicit = json.loads(cell)
            except json.JSONDecodeError as exc:
                bad.append(Reject(number, f"extras: not valid JSON: {exc.msg}"))
                continue
            # make_signal rejects a non-object; the explicit JSON wins over loose columns.
            extras = {**extras, **explicit} if isinstance(explicit, dict) else explicit
        if extras:
            data["extras"] = extras
        try:
            good.append((number, make_signal(data, known_tickers=known, now=now)))
        except SignalError as exc:
            bad.append(Reject(number, str(exc), exc.unknown_ticker))
    return good, bad


def read_signal_file(path: Path, *, known_tickers: Collection[str], now: datetime | None = None) -> _Parsed:
    """Parse a JSONL or CSV signal file into (line, record) pairs and rejects; nothing is stored."""
    now = now or datetime.now(timezone.utc)
    text, problem = _decode(path.read_bytes())
    if problem is not None:
        return [], [problem]
    assert text is not None
    if path.suffix.lower() in CSV_SUFFIXES:
        return _read_csv(text, known_tickers, now)
    return _read_jsonl(text, known_tickers, now)


# --------------------------------------------------------------------------- storing


def store_signals(session: Session, records: Sequence[SignalRecord], *, source: str) -> tuple[list[int], int]:
    """Insert validated signals, skipping ones already stored; returns (new ids, duplicate count)."""
    received_at = utcnow()
    ids: list[int] = []
    duplicates = 0
    for rec in records:
        stmt = (
            insert_ignoring_duplicates(session, Signal)
            .values(
                ticker=rec.ticker,
                generated_at=rec.generated_at,
                received_at=received_at,
                horizon=rec.horizon,
                direction=rec.direction,
                target=rec.target,
                confidence=rec.confidence,
                model=rec.model,
                extras=dict(rec.extras),
                source=source[:500],
            )
            .returning(Signal.id)
        )
        new_id = session.execute(stmt).scalar_one_or_none()
        if new_id is None:
            duplicates += 1
        else:
            ids.append(new_id)
    return ids, duplicates


def pending_files(drop_dir: Path) -> list[Path]:
    """Complete signal files waiting in ``drop_dir``, oldest first (see the module docstring)."""
    out = []
    for entry in os.scandir(drop_dir):
        name = entry.name
        if name.startswith(".") or name.lower().endswith(".tmp") or not entry.is_file(follow_symlinks=False):
            continue
        if not name.lower().endswith(JSONL_SUFFIXES + CSV_SUFFIXES):
            continue
        st = entry.stat(follow_symlinks=False)
        if st.st_size == 0:
            continue  # created but not yet written: the robot broke the rename convention
        out.append((st.st_mtime_ns, name, Path(entry.path)))
    return [p for _, _, p in sorted(out)]


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def _processed_name(folder: Path, name: str) -> Path:
    target = folder / name
    if not target.exists():
        return target
    stamp = utcnow().strftime("%Y%m%dT%H%M%S%fZ")
    stem, dot, suffix = name.rpartition(".")
    return folder / (f"{stem}.{stamp}.{suffix}" if dot else f"{name}.{stamp}")


def ingest_signal_file(
    path: Path, source: SignalSourceConfig, engine: Engine, *, known_tickers: Collection[str]
) -> SignalFileResult:
    """Store one complete drop file, write its rejects, move it to ``processed/``."""
    rejects_path = path.with_name(path.name + ".rejects")
    try:
        good, bad = read_signal_file(path, known_tickers=known_tickers)
    except OSError as exc:  # unreadable, or taken meanwhile by another ingest process
        return SignalFileResult(source.name, path, None, 0, 0, 0, (), None, error=f"{path}: cannot read: {exc}")
    try:
        with session_scope(engine) as session:
            ids: list[int] = []
            duplicates = 0
            for line, rec in good:
                new, dup = store_signals(session, [rec], source=f"{source.name}:{path.name}:{line}")
                ids += new
                duplicates += dup
    except SQLAlchemyError as exc:
        log.error("signals %s: cannot store %s: %s", source.name, path, exc)
        return SignalFileResult(
            source.name,
            path,
            None,
            len(good) + len(bad),
            0,
            0,
            (),
            None,
            error=f"{path}: cannot store: {error_line(exc)}",
        )
    moved_to: Path | None = None
    error = None
    try:
        if bad:
            _write_atomically(rejects_path, "".join(f"{path.name}:{r.line}: {r.reason}\n" for r in bad))
        elif rejects_path.exists():
            rejects_path.unlink()  # from an earlier drop of the same name, now fixed
        processed = path.parent / PROCESSED
        processed.mkdir(exist_ok=True)
        moved_to = _processed_name(processed, path.name)
        os.replace(path, moved_to)
    except OSError as exc:
        # The rows are stored; a file left in place is only read again, storing nothing twice.
        moved_to = None
        error = f"{path}: stored, but cannot write its rejects or move it to {PROCESSED}/: {exc}"
        log.error("signals %s: %s", source.name, error)
    for r in bad:
        log.warning("signals %s: %s:%d: %s", source.name, path, r.line, r.reason)
    log.info(
        "signals %s: %s: %d stored, %d duplicate, %d rejected", source.name, path.name, len(ids), duplicates, len(bad)
    )
    return SignalFileResult(
        source=source.name,
        path=path,
        moved_to=moved_to,
        rows=len(good) + len(bad),
        stored=len(ids),
        duplicates=duplicates,
        rejects=tuple(bad),
        rejects_path=rejects_path if bad and error is None else None,
        error=error,
    )


def ingest_signals(config: AppConfig, engine: Engine) -> list[SignalFileResult]:
    """Process every complete file in every configured drop folder; one result per file.

    A missing drop folder or an unprocessable file is reported in its result (``error``)
    and does not stop the other files.
    """
    known = [inst.ticker for inst in config.instruments]
    results: list[SignalFileResult] = []
    for source in config.signals.sources:
        folder = source.drop_dir
        if not folder.is_dir():
            log.error("signals %s: the drop folder %s does not exist", source.name, folder)
            results.append(
                SignalFileResult(
                    source.name, folder, None, 0, 0, 0, (), None, error=f"{folder}: the drop folder does not exist"
                )
            )
            continue
        for path in pending_files(folder):
            results.append(ingest_signal_file(path, source, engine, known_tickers=known))
    return results
