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
import os
import threading
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

from robot_llm.errors import RobotLLMError
from robot_llm.ingest.signal_record import SignalError, SignalRecord, make_signal

if TYPE_CHECKING:
    from sqlalchemy.engine import Engine

    from robot_llm.config import AppConfig

__all__ = ["PublishResult", "SignalError", "SignalRecord", "close", "make_signal", "publish", "publish_many"]

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
    from robot_llm.store.db import make_engine

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
    from robot_llm.ingest.signals import store_signals
    from robot_llm.store.db import session_scope

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
