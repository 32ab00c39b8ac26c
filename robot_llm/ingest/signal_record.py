"""One robot forecast as robot-llm stores it: :class:`SignalRecord`, and :func:`make_signal`,
which validates a mapping (a JSONL line, a CSV row, ``publish`` arguments) into one.

Shared by the publishing API (:mod:`robot_llm.signals`) and the drop-folder ingest
(:mod:`robot_llm.ingest.signals`); standard library only, so a robot importing
``robot_llm.signals`` loads nothing heavy.
"""

from __future__ import annotations

import json
import math
import numbers
import re
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any

from robot_llm.errors import RobotLLMError

__all__ = ["FIELDS", "FUTURE_TOLERANCE", "REQUIRED", "SignalError", "SignalRecord", "make_signal"]

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
