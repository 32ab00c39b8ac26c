"""Publish the robot's forecasts to robot-llm from Python: ``robot_llm.signals.publish(...)``.

For a robot written in Python (a freqtrade strategy, a script after each bar)::

    from robot_llm.signals import publish

    publish(
        ticker="SBER",
        generated_at=datetime.now(timezone.utc),
        horizon="1d",
        direction="up",          # or +1 / -1 / 0, "down", "flat"
        target=312.5,            # optional when direction is given
        confidence=0.64,
        model="gbm-v7",
        extras={"features": 42},
        config="/etc/robot-llm/robot-llm.yaml",
    )

``config=`` (the robot-llm YAML file, or an already loaded ``AppConfig``) writes straight into
the configured database, in one transaction, and returns at once: the signal is visible to
tonight's plan as soon as ``publish`` returns. The ticker must be one of the config's
instruments. The config and the database engine are cached per file (reloaded when the file
changes), so calling ``publish`` after every bar is cheap; ``close()`` releases the connections.

``drop_dir=`` instead writes a JSONL file into a signal drop folder (atomically: a hidden
``.tmp`` file renamed into place), for a robot that runs on a host without access to the
database; robot-llm's ``ingest signals`` job picks it up. Tickers are checked then.

The fields, their types and the file formats are documented in :mod:`robot_llm.ingest.signals`.
Publishing the same signal twice (same ticker, generated_at, model and horizon) stores it once.

This module imports only the standard library; the database stack is loaded on the first
``publish(config=...)``.
"""

from __future__ import annotations

import json
import math
import numbers
import os
import re
import threading
import uuid
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

from robot_llm.errors import RobotLLMError

if TYPE_CHECKING:
    from sqlalchemy.engine import Engine

    from robot_llm.config import AppConfig

__all__ = ["PublishResult", "SignalError", "SignalRecord", "close", "make_signal", "publish", "publish_many"]

FIELDS = ("ticker", "generated_at", "horizon", "direction", "target", "confidence", "model", "extras")
REQUIRED = ("ticker", "generated_at", "horizon", "model")
# A robot's clock may run slightly ahead of ours; anything further in the future is a bug
# (a local time written as UTC, a wrong zone) that would leak the future into a backtest.
FUTURE_TOLERANCE = timedelta(minutes=5)

_DIRECTIONS = {"up": 1, "down": -1, "flat": 0, "+1": 1, "1": 1, "-1": -1, "0": 0}
_HORIZON_RE = re.compile(r"^\s*\d+(?:\.\d+)?\s*(?:s|sec|m|min|h|d|w)\s*$")


class SignalError(RobotLLMError, ValueError):
    """A signal that does not follow the schema; the message lists every problem."""

    def __init__(self, message: str, *, unknown_ticker: str | None = None) -> None:
        super().__init__(message)
        self.unknown_ticker = unknown_ticker


@dataclass(frozen=True)
class SignalRecord:
    """One validated forecast (build it with :func:`make_signal`, which checks every field)."""

    ticker: str
    generated_at: datetime
    horizon: str
    model: str
    direction: int | None = None
    target: float | None = None
    confidence: float | None = None
    extras: Mapping[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        """The record as one JSONL object of the drop-folder format."""
        out: dict[str, Any] = {
            "ticker": self.ticker,
            "generated_at": self.generated_at.isoformat(),
            "horizon": self.horizon,
            "model": self.model,
        }
        for name in ("direction", "target", "confidence"):
            value = getattr(self, name)
            if value is not None:
                out[name] = value
        if self.extras:
            out["extras"] = dict(self.extras)
        return out


# --------------------------------------------------------------------------- validation


def _blank(value: Any) -> bool:
    return value is None or (isinstance(value, str) and not value.strip())


def _number(name: str, value: Any, problems: list[str]) -> float | None:
    if _blank(value):
        return None
    if isinstance(value, bool):
        problems.append(f"{name}: expected a number, got {value!r}")
        return None
    try:
        number = float(value.strip().replace(",", ".") if isinstance(value, str) else value)
    except (TypeError, ValueError):
        problems.append(f"{name}: expected a number, got {value!r}")
        return None
    if not math.isfinite(number):
        problems.append(f"{name}: expected a finite number, got {value!r}")
        return None
    return number


def _text(name: str, value: Any, limit: int, problems: list[str]) -> str | None:
    if not isinstance(value, str) or not value.strip():
        problems.append(f"{name}: expected non-empty text, got {value!r}")
        return None
    value = value.strip()
    if len(value) > limit:
        problems.append(f"{name}: longer than {limit} characters")
        return None
    return value


def _timestamp(value: Any, now: datetime, problems: list[str]) -> datetime | None:
    if isinstance(value, datetime):
        stamp = value
    elif isinstance(value, str) and value.strip():
        raw = value.strip()
        # Python 3.10's fromisoformat does not know the "Z" suffix.
        if raw[-1:] in ("Z", "z"):
            raw = raw[:-1] + "+00:00"
        try:
            stamp = datetime.fromisoformat(raw)
        except ValueError:
            problems.append(f"generated_at: expected an ISO 8601 time like 2026-11-27T18:40:00+03:00, got {value!r}")
            return None
    else:
        problems.append(f"generated_at: expected an ISO 8601 time like 2026-11-27T18:40:00+03:00, got {value!r}")
        return None
    if stamp.tzinfo is None or stamp.utcoffset() is None:
        problems.append(
            f"generated_at: {value!s} has no time zone; add one (e.g. +03:00 or Z) — naive times are refused"
        )
        return None
    stamp = stamp.astimezone(timezone.utc)
    if stamp > now + FUTURE_TOLERANCE:
        problems.append(
            f"generated_at: {stamp.isoformat()} is in the future (now is {now.isoformat(timespec='seconds')})"
        )
        return None
    return stamp


def _direction(value: Any, problems: list[str]) -> int | None:
    if _blank(value):
        return None
    if isinstance(value, bool):
        problems.append(f"direction: expected up/down/flat or +1/-1/0, got {value!r}")
        return None
    if isinstance(value, numbers.Real) and value in (-1, 0, 1):  # numpy scalars too (np.sign)
        return int(value)
    if isinstance(value, str) and value.strip().lower() in _DIRECTIONS:
        return _DIRECTIONS[value.strip().lower()]
    problems.append(f"direction: expected up/down/flat or +1/-1/0, got {value!r}")
    return None


def make_signal(
    data: Mapping[str, Any],
    *,
    known_tickers: Collection[str] | None = None,
    now: datetime | None = None,
) -> SignalRecord:
    """Validate one signal given as a mapping of the schema's fields; raise SignalError listing every problem.

    Values may be Python objects or the strings of a CSV cell. ``known_tickers`` are the
    config's instruments; a ticker is matched case-insensitively and stored as configured.
    """
    now = now or datetime.now(timezone.utc)
    problems: list[str] = []
    unknown = sorted(str(k) for k in data if k not in FIELDS)
    if unknown:
        problems.append(f"unknown field(s) {', '.join(map(repr, unknown))} (put free-form values in extras)")
    missing = [k for k in REQUIRED if _blank(data.get(k))]
    if missing:
        problems.append(f"missing {', '.join(missing)}")

    unknown_ticker = None
    ticker = _text("ticker", data["ticker"], 32, problems) if "ticker" not in missing else None
    if ticker is not None and known_tickers is not None:
        canonical = {t.upper(): t for t in known_tickers}.get(ticker.upper())
        if canonical is None:
            unknown_ticker = ticker
            problems.append(f"unknown ticker {ticker!r} (not in the config's instruments)")
        ticker = canonical
    generated_at = _timestamp(data["generated_at"], now, problems) if "generated_at" not in missing else None
    horizon = None
    if "horizon" not in missing:
        horizon = _text("horizon", data["horizon"], 32, problems)
        if horizon is not None and not _HORIZON_RE.match(horizon):
            problems.append(f"horizon: expected a duration like '4h', '1d' or '1w', got {horizon!r}")
    model = _text("model", data["model"], 200, problems) if "model" not in missing else None
    direction = _direction(data.get("direction"), problems)
    target = _number("target", data.get("target"), problems)
    confidence = _number("confidence", data.get("confidence"), problems)
    if confidence is not None and not 0 <= confidence <= 1:
        problems.append(f"confidence: must be between 0 and 1, got {data.get('confidence')!r}")
    if _blank(data.get("direction")) and _blank(data.get("target")):
        problems.append("give a direction, a target or both")
    extras = data.get("extras") or {}
    if not isinstance(extras, Mapping) or not all(isinstance(k, str) for k in extras):
        problems.append(f"extras: expected an object with text keys, got {extras!r}")
    else:
        try:
            extras = json.loads(json.dumps(dict(extras), allow_nan=False))
        except (TypeError, ValueError) as exc:
            problems.append(f"extras: not storable as JSON ({exc})")

    if problems:
        raise SignalError("; ".join(problems), unknown_ticker=unknown_ticker)
    assert ticker is not None and generated_at is not None and horizon is not None and model is not None
    return SignalRecord(
        ticker=ticker,
        generated_at=generated_at,
        horizon=horizon.replace(" ", ""),
        model=model,
        direction=direction,
        target=target,
        confidence=confidence,
        extras=extras,
    )


# --------------------------------------------------------------------------- publishing


@dataclass(frozen=True)
class PublishResult:
    """What ``publish`` did: ids of the rows it stored, duplicates skipped, or the file it wrote."""

    stored: int
    duplicates: int
    ids: tuple[int, ...] = ()
    path: Path | None = None


_CONFIGS: dict[Path, tuple[int, AppConfig]] = {}
_ENGINES: dict[str, Engine] = {}
_CACHE_LOCK = threading.Lock()


def _context(config: str | os.PathLike[str] | AppConfig) -> tuple[AppConfig, Engine]:
    """The config (reloaded when its file changes) and one engine per database URL, both cached."""
    from robot_llm.config import AppConfig, load_config
    from robot_llm.db import make_engine

    with _CACHE_LOCK:
        if isinstance(config, AppConfig):
            app = config
        else:
            path = Path(config).resolve()
            try:
                mtime = path.stat().st_mtime_ns
            except FileNotFoundError:
                raise RobotLLMError(f"{path}: config file not found") from None
            cached = _CONFIGS.get(path)
            if cached is not None and cached[0] == mtime:
                app = cached[1]
            else:
                app = load_config(path)
                _CONFIGS[path] = (mtime, app)
        engine = _ENGINES.get(app.database.url)
        if engine is None:
            engine = _ENGINES[app.database.url] = make_engine(app.database.url, echo=app.database.echo)
        return app, engine


def close() -> None:
    """Close the database connections ``publish`` keeps open (call it when the robot shuts down)."""
    with _CACHE_LOCK:
        for engine in _ENGINES.values():
            engine.dispose()
        _ENGINES.clear()
        _CONFIGS.clear()


def _write_drop_file(records: list[SignalRecord], drop_dir: str | os.PathLike[str]) -> Path:
    folder = Path(drop_dir)
    if not folder.is_dir():
        raise RobotLLMError(f"{folder}: the signal drop folder does not exist")
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S%fZ")
    final = folder / f"signals-{stamp}-{uuid.uuid4().hex[:8]}.jsonl"
    # Hidden and ending in .tmp: the ingest job never takes it before the rename below.
    tmp = folder / f".{final.name}.tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        for rec in records:
            fh.write(json.dumps(rec.to_json(), ensure_ascii=False) + "\n")
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, final)
    return final


def publish_many(
    signals: Iterable[SignalRecord | Mapping[str, Any]],
    *,
    config: str | os.PathLike[str] | AppConfig | None = None,
    drop_dir: str | os.PathLike[str] | None = None,
) -> PublishResult:
    """Validate and publish several signals at once (one transaction, or one file); see the module docstring.

    Give exactly one of ``config`` (write to the database) or ``drop_dir`` (write a JSONL file).
    Any invalid signal raises SignalError before anything is written, naming its position.
    """
    if (config is None) == (drop_dir is None):
        raise TypeError("publish needs exactly one of config= (write to the database) or drop_dir= (write a file)")
    engine = None
    known = None
    if config is not None:
        app, engine = _context(config)
        known = [inst.ticker for inst in app.instruments]
    records: list[SignalRecord] = []
    for i, item in enumerate(signals):
        data = item.to_json() if isinstance(item, SignalRecord) else item
        try:
            records.append(make_signal(data, known_tickers=known))
        except SignalError as exc:
            raise SignalError(f"signal #{i + 1}: {exc}", unknown_ticker=exc.unknown_ticker) from None
    if drop_dir is not None:
        return PublishResult(stored=0, duplicates=0, path=_write_drop_file(records, drop_dir))
    assert engine is not None
    from robot_llm.db import session_scope
    from robot_llm.ingest.signals import store_signals

    with session_scope(engine) as session:
        ids, duplicates = store_signals(session, records, source="publish")
    return PublishResult(stored=len(ids), duplicates=duplicates, ids=tuple(ids))


def publish(
    ticker: str,
    generated_at: datetime | str,
    *,
    horizon: str,
    model: str,
    direction: int | str | None = None,
    target: float | None = None,
    confidence: float | None = None,
    extras: Mapping[str, Any] | None = None,
    config: str | os.PathLike[str] | AppConfig | None = None,
    drop_dir: str | os.PathLike[str] | None = None,
) -> PublishResult:
    """Validate and publish one signal; see the module docstring (and ``publish_many`` for batches)."""
    data: dict[str, Any] = {"ticker": ticker, "generated_at": generated_at, "horizon": horizon, "model": model}
    for name, value in (("direction", direction), ("target", target), ("confidence", confidence)):
        if value is not None:
            data[name] = value
    if extras:
        data["extras"] = extras
    return publish_many([data], config=config, drop_dir=drop_dir)
