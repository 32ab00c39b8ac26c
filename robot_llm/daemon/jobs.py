"""The daemon's short jobs (feed polls, signal drop folders, the morning report) and its job bookkeeping.

Each job is a plain function of ``(config, engine)`` returning what its Run row records;
the long nightly job is :mod:`robot_llm.daemon.nightly`.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sqlalchemy.engine import Engine

    from robot_llm.config import AppConfig

__all__ = ["InFlight", "JobOutcome", "ingest_feed", "ingest_signals", "morning_report"]

log = logging.getLogger("robot_llm.daemon.scheduler")


@dataclass(frozen=True)
class JobOutcome:
    """What a job reports back for its Run row."""

    status: str  # ok | failed
    counts: dict[str, Any]
    error: str | None = None


class InFlight:
    """Counts running jobs so shutdown can wait for them (APScheduler's own wait is unbounded)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._active: Counter[str] = Counter()

    def enter(self, name: str) -> None:
        """A job named ``name`` started."""
        with self._cond:
            self._active[name] += 1

    def leave(self, name: str) -> None:
        """A job named ``name`` ended."""
        with self._cond:
            self._active[name] -= 1
            if self._active[name] <= 0:
                del self._active[name]
            self._cond.notify_all()

    def names(self) -> list[str]:
        """The jobs running now."""
        with self._cond:
            return sorted(self._active)

    def wait_idle(self, timeout: float) -> bool:
        """Wait until no job runs; False when ``timeout`` seconds passed first."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._active, timeout)


def ingest_feed(config: AppConfig, engine: Engine, feed_name: str) -> JobOutcome:
    """Poll one feed."""
    from robot_llm.ingest.feeds import ingest_feeds

    (result,) = ingest_feeds(config, engine, only=[feed_name])
    counts = {
        "feed": result.feed,
        "fetch": result.status,
        "http_status": result.http_status,
        "new": result.new,
        "duplicates": result.duplicates,
    }
    return JobOutcome("ok" if result.ok else "failed", counts, result.error)


def ingest_signals(config: AppConfig, engine: Engine) -> JobOutcome:
    """Take the files waiting in the signal drop folders."""
    from robot_llm.ingest.signals import ingest_signals as ingest

    results = ingest(config, engine)
    errors = [r.error for r in results if r.error]
    counts = {
        "files": len(results),
        "stored": sum(r.stored for r in results),
        "duplicates": sum(r.duplicates for r in results),
        "rejected": sum(len(r.rejects) for r in results),
        "errors": len(errors),
    }
    return JobOutcome("failed" if errors else "ok", counts, "; ".join(errors) or None)


def morning_report(config: AppConfig, engine: Engine) -> None:
    """Log the morning report (``report_job`` records its own 'report' Run)."""
    from robot_llm.report.summary import format_report, report_job

    report = report_job(config, engine)
    log.info("morning report:\n%s", format_report(report, config))
    if config.report.html_dir is not None:
        from robot_llm.report.html import write_morning

        log.info("morning report page: %s", write_morning(config, engine, report.day))
