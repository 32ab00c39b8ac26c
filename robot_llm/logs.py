"""Logging set-up shared by the CLI and the daemon.

Text by default (for a person at a terminal), or one JSON object per line (for journald,
Loki, Elasticsearch...). Timestamps are UTC in both, so logs from the daemon, the GPU worker
and a strategy host line up.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Literal

__all__ = ["JsonFormatter", "setup_logging"]

LogFormat = Literal["text", "json"]

# Attributes every LogRecord has; anything else came in through ``extra=`` and is data.
_RECORD_FIELDS = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime"}

# Marks the handlers we installed, so calling setup_logging again replaces them
# instead of stacking a second copy (and leaves handlers others installed alone).
_OURS = "_robot_llm_handler"


class _UTCTextFormatter(logging.Formatter):
    converter = time.gmtime

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)-7s %(name)s: %(message)s", "%Y-%m-%dT%H:%M:%SZ")


class JsonFormatter(logging.Formatter):
    """One JSON object per record: ts, level, logger, msg, any ``extra=`` fields, exc."""

    def format(self, record: logging.LogRecord) -> str:
        data: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, timezone.utc).isoformat(timespec="milliseconds"),
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


def setup_logging(
    level: int | str = logging.INFO, fmt: LogFormat = "text", file: str | os.PathLike[str] | None = None
) -> None:
    """Send robot-llm's logs (and its libraries') to stderr, or to ``file``, as text or JSON.

    Safe to call again (e.g. the daemon after reading its config): the previous handler
    installed here is replaced.
    """
    if fmt not in ("text", "json"):
        raise ValueError(f"log format must be 'text' or 'json', got {fmt!r}")
    if isinstance(level, str):
        level = logging.getLevelName(level.upper())
        if not isinstance(level, int):
            raise ValueError(f"unknown log level {level!r}")
    if file is not None:
        Path(file).parent.mkdir(parents=True, exist_ok=True)
        handler: logging.Handler = logging.FileHandler(file, encoding="utf-8")
    else:
        handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else _UTCTextFormatter())
    setattr(handler, _OURS, True)
    root = logging.getLogger()
    for old in [h for h in root.handlers if getattr(h, _OURS, False)]:
        root.removeHandler(old)
        old.close()
    root.addHandler(handler)
    root.setLevel(level)
