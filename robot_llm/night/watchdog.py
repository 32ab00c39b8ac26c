"""The worker's watchdog: heartbeat, lease renewal and the stall detector of one ``batch run``."""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from typing import TYPE_CHECKING

from sqlalchemy import update
from sqlalchemy.engine import Connection
from sqlalchemy.exc import SQLAlchemyError

from robot_llm.store.db import GenerationRequest, error_line, make_engine, utcnow
from robot_llm.store.runs import beat_run, finish_run

if TYPE_CHECKING:
    from robot_llm.config import AppConfig
    from robot_llm.night.queue import RequestQueue

__all__ = ["ABORT_RECORD_TIMEOUT_S", "WATCHDOG_EXIT_CODE", "Watchdog"]

log = logging.getLogger("robot_llm.night.worker")

#: Exit status of a process the watchdog ended (a stalled batch).
WATCHDOG_EXIT_CODE = 3
#: The longest the watchdog waits for the database while recording an abort.
ABORT_RECORD_TIMEOUT_S = 15.0


class Watchdog(threading.Thread):
    """Heartbeat, lease renewal and the stall detector of one worker.

    Every tick it updates the run's ``heartbeat_at`` and extends the leases this worker
    holds (a long batch on a 100B model can outlast one lease). When the batch in flight
    has made no progress for ``stall_timeout`` it records the run as ``aborted`` with the
    reason and ends the process with ``os._exit``.

    Why ``os._exit`` and nothing gentler: a stalled main thread is stuck inside
    something no Python exception reaches: a CUDA kernel, a read from a dying disk, a
    database driver waiting on a lock. ``sys.exit`` in this thread would end only this
    thread; raising in the main thread would wait for the stuck call to return. Ending
    the process releases its memory, files and database connections at once. The
    requests it held are *not* released here: the stuck thread might still write, and
    their leases simply stop being renewed, expire, and the next run claims them again
    (with their attempt already counted, so a request that stalls every time ends up
    failed instead of stalling every night).

    Its database writes use their own engine with short lock timeouts, so a database
    that blocks the main thread cannot also silence the watchdog.
    """

    def __init__(self, config: AppConfig, url: str, queue: RequestQueue, tick_s: float) -> None:
        super().__init__(name="robot-llm-watchdog", daemon=True)
        self.config = config
        self.queue = queue
        self.engine = make_engine(url)
        self.tick_s = tick_s
        self.stall_s = config.batch.stall_timeout.total_seconds()
        self._lock = threading.Lock()
        self._last_progress = time.monotonic()
        self._batch: list[int] = []
        self._halt = threading.Event()

    def progress(self, batch: list[int] | None = None) -> None:
        """Note that the worker moved on; ``batch`` replaces the ids of the batch in flight."""
        with self._lock:
            self._last_progress = time.monotonic()
            if batch is not None:
                self._batch = list(batch)

    def halt(self) -> None:
        """Stop the thread (the run ended normally)."""
        self._halt.set()
        self.join(timeout=self.tick_s * 4 + ABORT_RECORD_TIMEOUT_S)
        self.engine.dispose()

    def _bounded(self, conn: Connection, seconds: float) -> None:
        if conn.dialect.name == "sqlite":
            conn.exec_driver_sql(f"PRAGMA busy_timeout = {int(seconds * 1000)}")
        else:
            conn.exec_driver_sql(f"SET lock_timeout = {int(seconds * 1000)}")
            conn.exec_driver_sql(f"SET statement_timeout = {int(seconds * 1000)}")

    def _beat(self) -> None:
        now = utcnow()
        with self.engine.connect() as conn:
            self._bounded(conn, max(self.tick_s, 1.0))
            # Separate transactions, heartbeat first: a lock on the queue (another worker's
            # claim) must not stop this run from looking alive, and the main thread's store
            # locks requests then the run, so holding both here could deadlock with it.
            beat_run(conn, self.queue.run_id, now=now)
            conn.commit()
            conn.execute(
                update(GenerationRequest)
                .where(GenerationRequest.lease_owner == self.queue.worker_id, GenerationRequest.status == "running")
                # Dated after the heartbeat's commit, which may have waited on a lock.
                .values(lease_expires_at=utcnow() + self.config.batch.lease)
            )
            conn.commit()

    def _abort(self, idle_s: float, batch: list[int]) -> None:
        what = f"the batch of {len(batch)} request(s) {batch[:20]}" if batch else "the worker (between batches)"
        reason = (
            f"watchdog: {what} made no progress for {idle_s:.1f}s "
            f"(batch.stall_timeout {self.stall_s:.0f}s); the process was ended, its leases expire and the next "
            "run resumes"
        )
        recorded = "recorded in the runs table"
        try:
            with self.engine.connect() as conn:
                self._bounded(conn, ABORT_RECORD_TIMEOUT_S)
                finish_run(conn, self.queue.run_id, "aborted", error=reason)
                conn.commit()
        except SQLAlchemyError as exc:
            recorded = f"NOT recorded in the runs table ({error_line(exc)})"
        print(f"error: {reason} ({recorded})", file=sys.stderr, flush=True)
        logging.shutdown()
        os._exit(WATCHDOG_EXIT_CODE)

    def run(self) -> None:
        while not self._halt.wait(self.tick_s):
            with self._lock:
                idle = time.monotonic() - self._last_progress
                batch = list(self._batch)
            if idle > self.stall_s:
                self._abort(idle, batch)
            try:
                self._beat()
            except SQLAlchemyError as exc:
                log.warning("watchdog: heartbeat not written: %s", error_line(exc))
