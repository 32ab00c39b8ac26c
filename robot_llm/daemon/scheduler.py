"""The scheduled daemon: one long-running process that decides *when* each stage runs.

Jobs come from the config's ``schedule`` and ``feeds`` sections: each enabled feed is
polled at its own interval, the signal drop folders on a cron, the nightly plan +
generation on a cron (:mod:`robot_llm.daemon.nightly`), and the morning report on a cron. Every
trigger carries the config's time zone explicitly (an APScheduler trigger object built
without one silently uses the *system* zone).

Design rules, and why:

* **One instance per database**: the lease (:mod:`robot_llm.daemon.lease`), renewed by our heartbeat.
* **Generation runs in a child process** (:mod:`robot_llm.night.child`), so an
  out-of-memory kill or a hang in the model never takes the scheduler down.
* **Missed nights are caught up by us, not by APScheduler**: the in-memory job store
  forgets everything across restarts, so at start-up the daemon looks at the last
  nightly fire time and runs it once if that night is not complete and the morning
  cut-off of the trading day it serves has not passed.
* **Time logic is pure functions** of ``(config, now)`` (:mod:`robot_llm.clock`), so it is
  testable with explicit clocks, DST changes included.

This module must stay free of torch: the model is only ever loaded in the child.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time as _time
import uuid
from collections import Counter
from collections.abc import Callable
from datetime import datetime, timedelta
from types import FrameType
from typing import TYPE_CHECKING, Any

from apscheduler.executors.pool import ThreadPoolExecutor
from apscheduler.jobstores.memory import MemoryJobStore
from apscheduler.schedulers.blocking import BlockingScheduler
from apscheduler.triggers.interval import IntervalTrigger

from robot_llm.clock import cron_trigger, night_as_of, night_cutoff, non_trading_reason, should_catch_up, upcoming_fires
from robot_llm.daemon.jobs import InFlight, JobOutcome, ingest_feed, ingest_signals, morning_report
from robot_llm.daemon.lease import acquire_lease, release_lease, renew_lease
from robot_llm.daemon.nightly import NightlyJob
from robot_llm.errors import RobotLLMError
from robot_llm.store.db import Run, utcnow
from robot_llm.store.runs import (
    NIGHTLY_KIND,
    abort_runs,
    finish_run,
    night_complete,
    night_recorded,
    record_skipped,
    start_run,
)

if TYPE_CHECKING:
    from sqlalchemy.engine import Engine

    from robot_llm.config import AppConfig

__all__ = ["Daemon"]

log = logging.getLogger("robot_llm.daemon.scheduler")

# Per job, not only as scheduler defaults, so the policy is visible on each job object.
_JOB_POLICY: dict[str, Any] = {"coalesce": True, "max_instances": 1, "replace_existing": True}


# --------------------------------------------------------------------------- the daemon


class Daemon:
    """The scheduler process. ``run()`` blocks until SIGTERM/SIGINT (or ``request_stop``).

    ``feed_interval`` overrides every feed's poll interval; it exists for tests, which
    cannot wait the 10 s minimum a config may set. ``install_signals`` is False when the
    daemon does not own the process (a thread in a test). ``log_format`` is passed on to
    the generation child.
    """

    def __init__(
        self,
        config: AppConfig,
        engine: Engine,
        *,
        feed_interval: timedelta | None = None,
        install_signals: bool = True,
        log_format: str = "text",
    ) -> None:
        self._config = config
        self._engine = engine
        self._feed_interval = feed_interval
        self._install_signals = install_signals
        self._log_format = log_format
        self.host = socket.gethostname()
        self.pid = os.getpid()
        self.holder = f"{self.host}:{self.pid}:{uuid.uuid4().hex[:12]}"
        self._scheduler: BlockingScheduler | None = None
        self._config_lock = threading.RLock()
        self._stop = threading.Event()
        self._kill_now = threading.Event()
        self._finished = threading.Event()
        self._beat_stop = threading.Event()
        self._in_flight = InFlight()
        self._stats: Counter[str] = Counter()
        self._stats_lock = threading.Lock()
        self._nightly = NightlyJob(engine, self.host, stop=self._stop, kill_now=self._kill_now, log_format=log_format)
        self._exit_code = 0
        self.started = threading.Event()
        #: True when shutdown gave up waiting for a job (the caller should exit hard).
        self.jobs_left_running = False

    # ----------------------------------------------------------------- public

    @property
    def config(self) -> AppConfig:
        """The config in force (replaced by a successful SIGHUP reload)."""
        with self._config_lock:
            return self._config

    @property
    def child_pid(self) -> int | None:
        """The pid of the running generation child, if any."""
        child = self._nightly.child
        return child.pid if child is not None else None

    def run(self) -> int:
        """Take the lease, catch up a missed night, serve the schedule; return the exit code."""
        config = self.config
        if self._install_signals:
            self._install_handlers()
        lease = acquire_lease(
            self._engine, holder=self.holder, host=self.host, pid=self.pid, ttl=config.daemon.lease_ttl
        )
        log.info("daemon lease acquired (host %s, pid %s, ttl %s)", lease.host, lease.pid, config.daemon.lease_ttl)
        beat = threading.Thread(target=self._heartbeat_loop, name="daemon-heartbeat", daemon=True)
        try:
            self._abort_orphaned_runs()
            self._scheduler = self.build_scheduler(config)
            self._catch_up(self._scheduler, config)
            beat.start()
            if not self._stop.is_set():
                log.info("daemon started; next: %s", self._describe_jobs())
                self.started.set()
                self._scheduler.start()
            self._drain()
        finally:
            self._finished.set()
            self._beat_stop.set()
            if beat.is_alive():
                beat.join(timeout=5)
            try:
                release_lease(self._engine, self.holder)
                log.info("daemon lease released; stopped")
            except Exception:
                log.exception("could not release the daemon lease (it expires by itself)")
        return self._exit_code

    def request_stop(self, reason: str, *, exit_code: int = 0) -> None:
        """Stop taking new work, let running jobs finish, stop the child cleanly. Safe from any thread."""
        if self._stop.is_set():
            if not self._kill_now.is_set():
                log.warning("%s again: killing the generation child now", reason)
                self._kill_now.set()
            return
        log.info("%s: stopping (no new jobs; the running ones finish)", reason)
        self._exit_code = exit_code
        self._stop.set()
        threading.Thread(target=self._shutdown_scheduler, name="daemon-stop", daemon=True).start()

    def fire_now(self, job_id: str) -> None:
        """Run a scheduled job (``feed:NAME``, ``signals``, ``nightly``, ``morning_report``) at once."""
        scheduler = self._scheduler
        if scheduler is None or not scheduler.running:
            raise RobotLLMError("the daemon's scheduler is not running")
        scheduler.modify_job(job_id, next_run_time=datetime.now(self.config.tz))

    def reload(self) -> bool:
        """Re-read the config file and reschedule; keep the old config (and say why) if the new one is invalid."""
        from robot_llm.config import ConfigError, load_config

        old = self.config
        if old.source is None:
            log.error("config reload: the config was not loaded from a file; nothing to reload")
            return False
        try:
            new = load_config(old.source)
        except ConfigError as exc:
            log.error("config reload failed, keeping the old config: %s", exc)
            return False
        if new.database.url != old.database.url:
            log.error("config reload: database.url changed; restart the daemon to switch databases (old config kept)")
            return False
        try:
            self.build_scheduler(new)  # every trigger of the new config builds, before any job is replaced
        except (RobotLLMError, ValueError) as exc:
            log.error("config reload failed, keeping the old config: %s", exc)
            return False
        if self._stop.is_set():
            log.info("config reload ignored: the daemon is stopping")
            return False
        with self._config_lock:
            self._config = new
            scheduler = self._scheduler
            if scheduler is not None:
                scheduler.remove_all_jobs()
                self._add_jobs(scheduler, new)
        log.info("config reloaded from %s; next: %s", new.source, self._describe_jobs())
        return True

    # ----------------------------------------------------------------- scheduling

    def build_scheduler(self, config: AppConfig) -> BlockingScheduler:
        """A (not yet started) scheduler with every job of ``config``, all in ``config.timezone``."""
        if config.report.html_dir is not None:
            from robot_llm.report.html import require_plotly

            require_plotly()  # report.html_dir without the report extra: say so at start, not at 08:45
        scheduler = BlockingScheduler(
            timezone=config.tz,
            jobstores={"default": MemoryJobStore()},
            executors={"default": ThreadPoolExecutor(max_workers=max(4, len(config.feeds) + 3))},
            job_defaults={"coalesce": True, "max_instances": 1},
        )
        self._add_jobs(scheduler, config)
        return scheduler

    def _add_jobs(self, scheduler: BlockingScheduler, config: AppConfig) -> None:
        tz = config.tz
        now = datetime.now(tz)
        for feed in config.feeds:
            if not feed.enabled:
                continue
            interval = self._feed_interval or feed.interval
            scheduler.add_job(
                self._guarded,
                IntervalTrigger(seconds=interval.total_seconds(), timezone=tz),
                args=(f"feed:{feed.name}", "ingest_feeds", self._ingest_feed, feed.name),
                id=f"feed:{feed.name}",
                name=f"feed:{feed.name}",
                next_run_time=now,  # poll once at start-up, then every interval
                misfire_grace_time=max(1, int(interval.total_seconds() / 2)),
                **_JOB_POLICY,
            )
        scheduler.add_job(
            self._guarded,
            cron_trigger(config.schedule.signals, tz),
            args=("signals", "ingest_signals", self._ingest_signals),
            id="signals",
            name="signals",
            misfire_grace_time=300,
            **_JOB_POLICY,
        )
        scheduler.add_job(
            self._guarded,
            cron_trigger(config.schedule.nightly, tz),
            args=("nightly", None, self._run_nightly),  # records its own 'nightly' Run rows
            id="nightly",
            name="nightly",
            # However late it fires, it runs: the job itself refuses to start after the cut-off.
            misfire_grace_time=None,
            **_JOB_POLICY,
        )
        scheduler.add_job(
            self._guarded,
            cron_trigger(config.schedule.morning_report, tz),
            args=("morning_report", None, self._report),  # report_job records its own 'report' Run
            id="morning_report",
            name="morning_report",
            misfire_grace_time=3600,
            **_JOB_POLICY,
        )

    def _catch_up(self, scheduler: BlockingScheduler, config: AppConfig) -> None:
        now = utcnow()
        try:
            as_of = night_as_of(config, now)
        except RobotLLMError as exc:
            log.warning("no nightly run to catch up: %s", exc)
            return
        complete = night_complete(self._engine, as_of)
        if should_catch_up(config, as_of, now, complete=complete):
            log.info("the night of %s was missed or left unfinished; catching up now", as_of.isoformat())
            scheduler.modify_job("nightly", next_run_time=datetime.now(config.tz))
        elif not complete and not night_recorded(self._engine, as_of):
            reason = non_trading_reason(config, as_of)
            if reason is not None:
                reason = f"non-trading day: {reason}"
            else:
                cutoff = night_cutoff(config, as_of)
                reason = f"missed while the daemon was down; its cut-off {cutoff.isoformat()} has passed"
            record_skipped(self._engine, as_of, reason, self.host)
            log.warning("the night of %s was not run: %s", as_of.isoformat(), reason)

    def _describe_jobs(self) -> str:
        now = utcnow()
        tz = self.config.tz
        parts = []
        for fire in upcoming_fires(self.config, now):
            when = f"{fire.next_fire.astimezone(tz):%Y-%m-%d %H:%M %Z}" if fire.next_fire else fire.note
            parts.append(f"{fire.job} {when}")
        return "; ".join(parts)

    # ----------------------------------------------------------------- jobs

    def _guarded(self, name: str, kind: str | None, fn: Callable[..., JobOutcome | None], *args: object) -> None:
        """Run one job: skip it once stopping, record it as a Run of ``kind``, never let it raise."""
        self._in_flight.enter(name)  # before the stop check, so shutdown's drain cannot miss this job
        run_id = None
        try:
            # Queued executions that start after a stop request are dropped: "no new work".
            if self._stop.is_set():
                return
            if kind is not None:
                run_id = start_run(self._engine, kind, host=self.host)
            outcome = fn(*args)
            if run_id is not None and outcome is not None:
                finish_run(self._engine, run_id, outcome.status, error=outcome.error, counts=outcome.counts)
            self._count(f"{name.split(':')[0]}_{outcome.status if outcome else 'done'}")
        except Exception as exc:
            self._count(f"{name.split(':')[0]}_failed")
            log.exception("job %s failed", name)
            if run_id is not None:
                try:
                    finish_run(self._engine, run_id, "failed", error=f"{type(exc).__name__}: {exc}")
                except Exception:
                    log.exception("could not record the failure of job %s", name)
        finally:
            self._in_flight.leave(name)

    def _count(self, key: str) -> None:
        with self._stats_lock:
            self._stats[key] += 1

    def _ingest_feed(self, feed_name: str) -> JobOutcome:
        return ingest_feed(self.config, self._engine, feed_name)

    def _ingest_signals(self) -> JobOutcome:
        return ingest_signals(self.config, self._engine)

    def _report(self) -> None:
        morning_report(self.config, self._engine)

    def _run_nightly(self) -> None:
        self._nightly(self.config)

    def _abort_orphaned_runs(self) -> None:
        # We hold the lease, so nightly rows still 'running' belong to a daemon that died.
        aborted = abort_runs(self._engine, Run.kind == NIGHTLY_KIND, "the daemon running it stopped before it ended")
        if aborted:
            log.warning("marked %d nightly run(s) of a previous daemon as aborted", aborted)

    # ----------------------------------------------------------------- signals, heartbeat, shutdown

    def _install_handlers(self) -> None:
        def on_stop(signum: int, _frame: FrameType | None) -> None:
            self.request_stop(f"received {signal.Signals(signum).name}")

        def on_hup(_signum: int, _frame: FrameType | None) -> None:
            # Reloading takes locks and reads files: not inside a signal handler.
            threading.Thread(target=self.reload, name="daemon-reload", daemon=True).start()

        signal.signal(signal.SIGTERM, on_stop)
        signal.signal(signal.SIGINT, on_stop)
        signal.signal(signal.SIGHUP, on_hup)

    def _shutdown_scheduler(self) -> None:
        # BlockingScheduler.start() may not have reached its loop yet: wait for it, or for run() to end
        # (run() does not start the scheduler once a stop was requested).
        while not self._finished.is_set():
            scheduler = self._scheduler
            if scheduler is not None and scheduler.running:
                scheduler.shutdown(wait=False)
                return
            self._finished.wait(0.05)

    def _drain(self) -> None:
        timeout = self.config.daemon.shutdown_timeout.total_seconds() + 15
        if not self._in_flight.wait_idle(timeout):
            self.jobs_left_running = True
            log.warning("jobs still running after %.0fs, leaving them: %s", timeout, ", ".join(self._in_flight.names()))

    def _state(self) -> str:
        if self._stop.is_set():
            return "stopping"
        if self._nightly.night is not None:
            return "nightly"
        return "running" if self._in_flight.names() else "idle"

    def _heartbeat_loop(self) -> None:
        # The lease is renewed at least three times per TTL, so one slow renewal never loses it.
        next_log = _time.monotonic()
        renewed_at: datetime | None = None
        while True:
            daemon_cfg = self.config.daemon  # re-read: a SIGHUP may have changed it
            every = daemon_cfg.heartbeat.total_seconds()
            if self._beat_stop.wait(min(every, daemon_cfg.lease_ttl.total_seconds() / 3)):
                return
            state = self._state()
            try:
                now = utcnow()
                if not renew_lease(self._engine, self.holder, daemon_cfg.lease_ttl, state, now=now):
                    log.error("the daemon lease was taken over by another daemon; stopping")
                    self.request_stop("lease lost", exit_code=1)
                    return
                renewed_at = now
            except Exception:
                log.exception("could not renew the daemon lease (will retry)")
            if _time.monotonic() >= next_log:
                next_log = _time.monotonic() + every
                lease = f"lease renewed {renewed_at:%H:%M:%SZ}" if renewed_at else "lease NOT renewed"
                log.info("heartbeat: %s %s", self._heartbeat_line(state), lease)

    def _heartbeat_line(self, state: str) -> str:
        with self._stats_lock:
            stats = " ".join(f"{k}={v}" for k, v in sorted(self._stats.items())) or "no jobs finished yet"
        parts = [f"state={state}", f"pid={self.pid}"]
        active = self._in_flight.names()
        if active:
            parts.append(f"active={','.join(active)}")
        night = self._nightly.night
        if night is not None:
            parts.append(f"night={night}")
        child = self.child_pid
        if child is not None:
            parts.append(f"child_pid={child}")
        parts.append(stats)
        return " ".join(parts)
