"""The daemon's nightly job: decide whether tonight runs, plan it, run the generation child, record the night.

One ``nightly`` Run row per night says how it ended: ``ok``, ``skipped`` (a non-trading
day, or started after its cut-off), ``aborted`` (the daemon was stopped) or ``failed``
(planning failed, the child crashed or left requests behind). A stalled child (its
watchdog ended it) is retried up to ``batch.max_attempts`` before the cut-off; an OOM
kill or a crash would most likely repeat, so those wait for the next run.
"""

from __future__ import annotations

import logging
import signal
import subprocess
import threading
from datetime import datetime
from typing import TYPE_CHECKING

from sqlalchemy import and_

from robot_llm.clock import night_as_of, night_cutoff, non_trading_reason
from robot_llm.night.child import ChildOutcome, generate_command, start_child, supervise_child
from robot_llm.store.db import Run, utcnow
from robot_llm.store.runs import (
    NIGHTLY_KIND,
    beat_run,
    fail_runs,
    finish_run,
    night_complete,
    queue_counts,
    record_skipped,
    start_run,
)

if TYPE_CHECKING:
    from sqlalchemy.engine import Engine

    from robot_llm.config import AppConfig

__all__ = ["NightlyJob"]

log = logging.getLogger("robot_llm.daemon.scheduler")


class NightlyJob:
    """Runs nights for one daemon; ``stop`` and ``kill_now`` are the daemon's shutdown events.

    ``verbosity`` is handed to the generation child (:func:`~robot_llm.night.child.generate_command`).
    """

    def __init__(
        self,
        engine: Engine,
        host: str,
        *,
        stop: threading.Event,
        kill_now: threading.Event,
        log_format: str = "text",
        verbosity: int | None = None,
    ) -> None:
        self._engine = engine
        self._verbosity = verbosity
        self.host = host
        self._stop = stop
        self._kill_now = kill_now
        self._log_format = log_format
        #: The running generation child, if any.
        self.child: subprocess.Popen[bytes] | None = None
        #: The night being run (ISO as_of), if any.
        self.night: str | None = None

    def __call__(self, config: AppConfig) -> None:
        """The scheduled job: run tonight's night unless it is complete, not a trading night, or too late."""
        now = utcnow()
        as_of = night_as_of(config, now)
        if night_complete(self._engine, as_of):
            log.info("night %s is already complete; nothing to do", as_of.isoformat())
            return
        reason = non_trading_reason(config, as_of)
        if reason is not None:
            record_skipped(self._engine, as_of, f"non-trading day: {reason}", self.host)
            log.info("night %s skipped: %s", as_of.isoformat(), reason)
            return
        cutoff = night_cutoff(config, as_of)
        if now >= cutoff:
            record_skipped(self._engine, as_of, f"started after its cut-off {cutoff.isoformat()}", self.host)
            log.warning("night %s not started: its cut-off %s has passed", as_of.isoformat(), cutoff.isoformat())
            return
        self.run_night(config, as_of)

    def run_night(self, config: AppConfig, as_of: datetime) -> None:
        """Plan the night of ``as_of`` and run its generation child until the queue is done."""
        run_id = start_run(self._engine, NIGHTLY_KIND, as_of=as_of, host=self.host)
        self.night = as_of.isoformat()
        try:
            from robot_llm.night.plan import plan_night

            try:
                plan = plan_night(config, self._engine, as_of)
            except Exception as exc:
                finish_run(self._engine, run_id, "failed", error=f"planning failed: {exc}")
                raise
            counts: dict[str, int | str | None] = {
                "planned_created": plan.created,
                "planned_existing": plan.existing,
                "planned_skipped": len(plan.skipped),
            }
            log.info(
                "night %s planned: %d new, %d existing, %d skipped",
                as_of.isoformat(),
                plan.created,
                plan.existing,
                len(plan.skipped),
            )
            if self._stop.is_set():
                finish_run(self._engine, run_id, "aborted", error="the daemon stopped before generation", counts=counts)
                return
            queue = queue_counts(self._engine, as_of)
            if not queue.get("pending") and not queue.get("running"):
                finish_run(self._engine, run_id, "ok", counts={**counts, **queue}, done=queue.get("done", 0))
                return
            attempts = 1
            outcome = self._run_child(config, as_of, run_id)
            # A stalled batch (the worker's watchdog ended it) is worth another child; an
            # OOM kill or a crash would most likely repeat, so those wait for the next run.
            while (
                outcome.stalled
                and attempts < config.batch.max_attempts
                and not self._stop.is_set()
                and utcnow() < night_cutoff(config, as_of)
            ):
                attempts += 1
                log.warning("%s; starting another (attempt %d)", outcome.describe(), attempts)
                self._fail_orphaned_worker_runs(outcome.pid, outcome.describe())
                outcome = self._run_child(config, as_of, run_id)
            counts["child_attempts"] = attempts
            self._finish_night(run_id, as_of, outcome, counts)
        finally:
            self.night = None

    def _run_child(self, config: AppConfig, as_of: datetime, run_id: int) -> ChildOutcome:
        cmd = generate_command(config, as_of, log_format=self._log_format, verbosity=self._verbosity)
        log.info(
            "starting the generation child: %s (its config: the daemon's, in force since it was loaded from %s, "
            "handed over by value on stdin)",
            " ".join(cmd),
            config.source,
        )
        proc = start_child(config, cmd)
        self.child = proc
        try:
            return supervise_child(
                proc,
                timeout_s=config.batch.child_timeout.total_seconds(),
                grace_s=config.daemon.shutdown_timeout.total_seconds(),
                stop=self._stop,
                kill_now=self._kill_now,
                beat=lambda: self._beat(run_id, as_of),
            )
        finally:
            self.child = None

    def _beat(self, run_id: int, as_of: datetime) -> None:
        queue = queue_counts(self._engine, as_of)
        beat_run(self._engine, run_id, done=queue.get("done", 0), total=sum(queue.values()))

    def _finish_night(
        self, run_id: int, as_of: datetime, outcome: ChildOutcome, counts: dict[str, int | str | None]
    ) -> None:
        queue = queue_counts(self._engine, as_of)
        left = queue.get("pending", 0) + queue.get("running", 0)
        counts = {**counts, **{f"requests_{k}": v for k, v in queue.items()}, "child_returncode": outcome.returncode}
        done, total = queue.get("done", 0), sum(queue.values())
        # SIGTERM before the child installed its handler (still importing) kills it outright;
        # that is still the clean stop we asked for, not a failure.
        stopped = outcome.stop_requested and outcome.returncode in (0, -signal.SIGTERM, 128 + signal.SIGTERM)
        if outcome.returncode != 0 and not stopped:
            error = outcome.describe()
            self._fail_orphaned_worker_runs(outcome.pid, error)
            finish_run(self._engine, run_id, "failed", error=error, counts=counts, done=done, total=total)
            log.error("night %s failed: %s; %d requests left for the next run", as_of.isoformat(), error, left)
        elif left and stopped:
            error = f"stopped by the daemon's shutdown; {left} requests left for the next run"
            finish_run(self._engine, run_id, "aborted", error=error, counts=counts, done=done, total=total)
            log.info("night %s stopped cleanly: %d of %d done", as_of.isoformat(), done, total)
        elif left:
            error = f"the generation child exited 0 but {left} requests are still pending or running"
            finish_run(self._engine, run_id, "failed", error=error, counts=counts, done=done, total=total)
            log.error("night %s: %s", as_of.isoformat(), error)
        else:
            finish_run(self._engine, run_id, "ok", counts=counts, done=done, total=total)
            log.info("night %s complete: %d done, %d failed", as_of.isoformat(), done, queue.get("failed", 0))

    def _fail_orphaned_worker_runs(self, child_pid: int, error: str) -> None:
        # A killed worker cannot close its own Run row; close it for it so status does not lie.
        fail_runs(self._engine, and_(Run.pid == child_pid, Run.host == self.host, Run.kind != NIGHTLY_KIND), error)
