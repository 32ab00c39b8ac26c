"""Logging set-up shared by the CLI and the daemon.

Text by default (for a person at a terminal), or one JSON object per line (for journald,
Loki, Elasticsearch...). Timestamps are in the config's zone once it is loaded (UTC before),
like every other time robot-llm prints, and always carry their UTC offset, so logs from the
daemon, the GPU worker and a strategy host still line up.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from datetime import datetime, timezone, tzinfo
from pathlib import Path
from typing import Any, Literal

__all__ = ["JsonFormatter", "add_log_file", "setup_logging"]

LogFormat = Literal["text", "json"]

# Attributes every LogRecord has; anything else came in through ``extra=`` and is data.
_RECORD_FIELDS = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime"}

# Marks the handlers we installed, so calling setup_logging again replaces them
# instead of stacking a second copy (and leaves handlers others installed alone).
_OURS = "_robot_llm_handler"


class _TextFormatter(logging.Formatter):
    def __init__(self, tz: tzinfo = timezone.utc) -> None:
        super().__init__("%(asctime)s %(levelname)-7s %(name)s: %(message)s")
        self.tz = tz

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:
        return datetime.fromtimestamp(record.created, self.tz).isoformat(timespec="seconds")


class JsonFormatter(logging.Formatter):
    """One JSON object per record: ts, level, logger, msg, any ``extra=`` fields, exc."""

    def __init__(self, tz: tzinfo = timezone.utc) -> None:
        super().__init__()
        self.tz = tz

    def format(self, record: logging.LogRecord) -> str:
        data: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, self.tz).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in _RECORD_FIELDS and not key.startswith("_"):
                data[key] = value
        if record.exc_info:
            data["exc"] = self.formatException(record.exc_info)
        return json.dumps(data, ensure_ascii=False, default=str)


def _level(level: int | str) -> int:
    if isinstance(level, str):
        number = logging.getLevelName(level.upper())
        if not isinstance(number, int):
            raise ValueError(f"unknown log level {level!r}")
        return number
    return level


def _handler(level: int | str, fmt: LogFormat, file: str | os.PathLike[str] | None, tz: tzinfo) -> logging.Handler:
    if fmt not in ("text", "json"):
        raise ValueError(f"log format must be 'text' or 'json', got {fmt!r}")
    if file is not None:
        Path(file).parent.mkdir(parents=True, exist_ok=True)
        handler: logging.Handler = logging.FileHandler(file, encoding="utf-8")
    else:
        handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter(tz) if fmt == "json" else _TextFormatter(tz))
    handler.setLevel(_level(level))
    setattr(handler, _OURS, True)
    return handler


def setup_logging(
    level: int | str = logging.INFO,
    fmt: LogFormat = "text",
    file: str | os.PathLike[str] | None = None,
    *,
    tz: tzinfo = timezone.utc,
) -> None:
    """Send robot-llm's logs (and its libraries') to stderr, or to ``file``, as text or JSON, times in ``tz``.

    Safe to call again (e.g. after reading the config): every handler installed here before
    (including :func:`add_log_file`'s) is replaced.
    """
    handler = _handler(level, fmt, file, tz)
    root = logging.getLogger()
    for old in [h for h in root.handlers if getattr(h, _OURS, False)]:
        root.removeHandler(old)
        old.close()
    root.addHandler(handler)
    root.setLevel(handler.level)
    _quiet_libraries()


def add_log_file(level: int | str, fmt: LogFormat, file: str | os.PathLike[str], *, tz: tzinfo = timezone.utc) -> None:
    """Also write log lines to ``file`` at ``level`` (next to what :func:`setup_logging` installed)."""
    handler = _handler(level, fmt, file, tz)
    root = logging.getLogger()
    root.addHandler(handler)
    root.setLevel(min(root.level, handler.level))
    _quiet_libraries()


class _AlembicChatter(logging.Filter):
    """Drops the lines Alembic logs on every schema check ("Context impl ...", "Will assume ... DDL")."""

    def filter(self, record: logging.LogRecord) -> bool:
        if logging.getLogger().level <= logging.DEBUG:
            return True
        return not str(record.msg).startswith(("Context impl", "Will assume"))


_CHATTER = _AlembicChatter()


def _quiet_libraries() -> None:
    """Alembic's chatter only at DEBUG (-vv): a "setup plugin" line per plugin and two context lines on every
    command that checks the schema (half of a day's log file); the migrations it runs stay at INFO."""
    quiet = logging.getLogger().level > logging.DEBUG
    logging.getLogger("alembic.runtime.plugins").setLevel(logging.WARNING if quiet else logging.NOTSET)
    migration = logging.getLogger("alembic.runtime.migration")
    if _CHATTER not in migration.filters:
        migration.addFilter(_CHATTER)
