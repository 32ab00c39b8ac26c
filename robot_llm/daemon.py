"""The scheduled daemon: one long-running process that decides *when* each stage runs.

Jobs come from the config's ``schedule`` and ``feeds`` sections: each enabled feed is
polled at its own interval, the signal drop folders on a cron, the nightly plan +
generation on a cron, and the morning report on a cron. Every trigger carries the
config's time zone explicitly (an APScheduler trigger object built without one silently
uses the *system* zone).

Design rules, and why:

* **One instance per database.** A row in ``daemon_leases`` is taken atomically
  (insert, or take over a row whose holder let it expire) and renewed by a heartbeat.
  It works across hosts sharing one PostgreSQL, which a pidfile cannot.
* **Generation runs in a child process** (``python -m robot_llm.cli batch run``), so an
  out-of-memory kill or a hang in the model never takes the scheduler down; the daemon
  records how the child ended and the next run resumes the same night's queue (the
  queue lives in the database, and planning is idempotent).
* **Missed nights are caught up by us, not by APScheduler**: the in-memory job store
  forgets everything across restarts, so at start-up the daemon looks at the last
  nightly fire time and runs it once if that night is not complete and the morning
  cut-off of the trading day it serves has not passed.
* **Time logic is pure functions** of ``(config, now)`` so it is testable with explicit
  clocks, DST changes included.

This module must stay free of torch: the model is only ever loaded in the child.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time as _time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from datetime import date, datetime, timedelta, timezone, tzinfo
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

from apscheduler.executors.pool import ThreadPoolExecutor
from apscheduler.jobstores.memory import MemoryJobStore
from apscheduler.schedulers.blocking import BlockingScheduler
from apscheduler.triggers.interval import IntervalTrigger
from sqlalchemy import func, or_, select, update

from robot_llm.db import DaemonLease, DatabaseError, GenerationRequest, Run, session_scope, utcnow
from robot_llm.errors import RobotLLMError

if TYPE_CHECKING:
    from apscheduler.triggers.cron import CronTrigger
    from sqlalchemy.engine import Engine

    from robot_llm.config import AppConfig

__all__ = [
    "LEASE_NAME",
    "NIGHTLY_KIND",
    "ChildOutcome",
    "Daemon",
    "LeaseHeldError",
    "LeaseInfo",
    "ScheduledFire",
    "acquire_lease",
    "generate_command",
    "next_nightly_fire",
    "night_complete",
    "night_cutoff",
    "non_trading_reason",
    "read_lease",
    "release_lease",
    "renew_lease",
    "served_trading_day",
    "should_catch_up",
    "upcoming_fires",
]

log = logging.getLogger("robot_llm.daemon")

LEASE_NAME = "daemon"
# The Run kind the daemon records for one night's plan + generation (the child's own
# worker records its 'generate' rows; this row says how the child as a whole ended).
NIGHTLY_KIND = "nightly"
_WEEKDAY_NAMES = ("mon", "tue", "wed", "thu", "fri", "sat", "sun")
_DONE_STATUSES = ("ok", "skipped")
# Per job, not only as scheduler defaults, so the policy is visible on each job object.
_JOB_POLICY: dict[str, Any] = {"coalesce": True, "max_instances": 1, "replace_existing": True}


def _aware(value: datetime, name: str) -> datetime:
    if value.tzinfo is None or value.utcoffset() is None:
        raise ValueError(f"{name} must be an aware datetime, got naive {value!r}")
    return value.astimezone(timezone.utc)


# --------------------------------------------------------------------------- time logic (pure)
#
# The cron expressions are read by robot_llm.plan.cron_trigger (crontab weekdays, 0 = Sunday,
# which APScheduler's own from_crontab gets wrong) and the night identity is
# robot_llm.plan.night_as_of, so the daemon and `batch plan` always agree on which night it is.
# robot_llm.plan is imported inside the functions: it pulls in Jinja2 and the prompt code,
# which `robot-llm status` and a fresh daemon do not need at import time.


def _cron(expression: str, tz: tzinfo) -> CronTrigger:
    from robot_llm.plan import cron_trigger

    return cron_trigger(expression, tz)


def _night_as_of(config: AppConfig, now: datetime) -> datetime:
    from robot_llm.plan import night_as_of

    return night_as_of(config, now)


def next_nightly_fire(config: AppConfig, now: datetime) -> datetime | None:
    """The first ``schedule.nightly`` fire at or after ``now`` (aware UTC), in the config's zone."""
    fire = _cron(config.schedule.nightly, config.tz).get_next_fire_time(None, _aware(now, "now"))
    return fire.astimezone(timezone.utc) if fire is not None else None


def served_trading_day(config: AppConfig, as_of: datetime) -> date:
    """The local date whose morning the night of ``as_of`` serves: the first cut-off after it."""
    local = _aware(as_of, "as_of").astimezone(config.tz)
    day = local.date()
    if datetime.combine(day, config.schedule.cutoff, tzinfo=config.tz) <= local:
        day += timedelta(days=1)
    return day


def night_cutoff(config: AppConfig, as_of: datetime) -> datetime:
    """The moment (aware UTC) after which the night of ``as_of`` is useless and must not start."""
    day = served_trading_day(config, as_of)
    return datetime.combine(day, config.schedule.cutoff, tzinfo=config.tz).astimezone(timezone.utc)


def non_trading_reason(config: AppConfig, as_of: datetime) -> str | None:
    """Why the night of ``as_of`` is skipped (it serves a non-trading day), or None to run it."""
    schedule = config.schedule
    if not schedule.skip_non_trading_days:
        return None
    day = served_trading_day(config, as_of)
    if day in schedule.holidays:
        return f"it serves {day.isoformat()}, a holiday (schedule.holidays)"
    weekday = _WEEKDAY_NAMES[day.weekday()]
    if weekday not in schedule.trading_days:
        return f"it serves {day.isoformat()}, a {day.strftime('%A')} (not in schedule.trading_days)"
    return None


def should_catch_up(config: AppConfig, as_of: datetime, now: datetime, *, complete: bool) -> bool:
    """Whether a night missed while the daemon was down must run now: not complete, before its cut-off."""
    now = _aware(now, "now")
    as_of = _aware(as_of, "as_of")
    if complete:
        return False
    return as_of <= now < night_cutoff(config, as_of)


@dataclass(frozen=True)
class ScheduledFire:
    """One job's next fire time, as ``robot-llm status`` shows it."""

    job: str
    next_fire: datetime | None
    note: str


def upcoming_fires(config: AppConfig, now: datetime) -> tuple[ScheduledFire, ...]:
    """The next fire time of every job the config defines, computed from the config alone."""
    now = _aware(now, "now")
    tz = config.tz
    out: list[ScheduledFire] = []
    nightly = next_nightly_fire(config, now)
    note = f"cron {config.schedule.nightly!r}"
    if nightly is not None:
        reason = non_trading_reason(config, nightly)
        cutoff = night_cutoff(config, nightly).astimezone(tz)
        note += f", serves {served_trading_day(config, nightly).isoformat()} (cut-off {cutoff:%Y-%m-%d %H:%M %Z})"
        if reason:
            note += f"; will be skipped: {reason}"
    out.append(ScheduledFire("nightly", nightly, note))
    for job, expr in (("signals", config.schedule.signals), ("morning_report", config.schedule.morning_report)):
        fire = _cron(expr, tz).get_next_fire_time(None, now)
        out.append(ScheduledFire(job, fire.astimezone(timezone.utc) if fire else None, f"cron {expr!r}"))
    for feed in config.feeds:
        if feed.enabled:
            out.append(ScheduledFire(f"feed:{feed.name}", None, f"every {feed.interval}"))
    return tuple(out)


# --------------------------------------------------------------------------- the lease


class LeaseHeldError(RobotLLMError):
    """Another live daemon holds the lease on this database."""


@dataclass(frozen=True)
class LeaseInfo:
    """A snapshot of the lease row."""

    name: str
    holder: str
    host: str
    pid: int
    acquired_at: datetime
    heartbeat_at: datetime
    expires_at: datetime
    state: str
    released: bool

    def is_live(self, now: datetime) -> bool:
        """Held by a daemon that has not released it and whose heartbeat has not lapsed."""
        return not self.released and self.expires_at > _aware(now, "now")


def _lease_info(row: DaemonLease) -> LeaseInfo:
    return LeaseInfo(
        name=row.name,
        holder=row.holder,
        host=row.host,
        pid=row.pid,
        acquired_at=row.acquired_at,
        heartbeat_at=row.heartbeat_at,
        expires_at=row.expires_at,
        state=row.state,
        released=row.released,
    )


def read_lease(engine: Engine, name: str = LEASE_NAME) -> LeaseInfo | None:
    """The current lease row, or None if no daemon ever ran on this database."""
    with session_scope(engine) as session:
        row = session.get(DaemonLease, name)
        return _lease_info(row) if row is not None else None


def _upsert(engine: Engine) -> Callable[..., Any]:
    """The dialect's ``insert`` (the one with ``on_conflict_do_update``)."""
    if engine.dialect.name == "postgresql":
        from sqlalchemy.dialects.postgresql import insert
    elif engine.dialect.name == "sqlite":
        from sqlalchemy.dialects.sqlite import insert
    else:
        raise DatabaseError(f"the daemon lease needs PostgreSQL or SQLite, not {engine.dialect.name}")
    return insert


def acquire_lease(
    engine: Engine,
    *,
    holder: str,
    host: str,
    pid: int,
    ttl: timedelta,
    now: datetime | None = None,
    name: str = LEASE_NAME,
) -> LeaseInfo:
    """Take the lease atomically, or raise LeaseHeldError naming the live holder's host and pid.

    One statement decides: insert the row, or on conflict overwrite it only if its holder
    released it, let it expire, or is us. Both PostgreSQL and SQLite evaluate that
    ``ON CONFLICT ... DO UPDATE ... WHERE`` under the row's lock, so two daemons starting
    at once cannot both win.
    """
    now = _aware(now or utcnow(), "now")
    insert = _upsert(engine)
    table = DaemonLease.__table__
    values = {
        "name": name,
        "holder": holder,
        "host": host,
        "pid": pid,
        "acquired_at": now,
        "heartbeat_at": now,
        "expires_at": now + ttl,
        "state": "starting",
        "released": False,
    }
    stmt = insert(table).values(**values)
    stmt = stmt.on_conflict_do_update(
        index_elements=[table.c.name],
        set_={k: stmt.excluded[k] for k in values if k != "name"},
        where=or_(table.c.expires_at <= now, table.c.released.is_(True), table.c.holder == holder),
    )
    # Read first, in its own transaction, only to say whose stale lease we take over: a read
    # before the write in one SQLite transaction could fail to upgrade to a write lock.
    previous = read_lease(engine, name)
    with session_scope(engine) as session:
        session.execute(stmt)
        row = session.get(DaemonLease, name, populate_existing=True)
        assert row is not None
        current = _lease_info(row)
    if current.holder != holder:
        age = (now - current.heartbeat_at).total_seconds()
        left = (current.expires_at - now).total_seconds()
        raise LeaseHeldError(
            f"another robot-llm daemon is running on this database: host {current.host}, pid {current.pid} "
            f"(state {current.state}, last heartbeat {age:.0f}s ago, lease expires in {left:.0f}s). "
            "Stop it first; if it died, its lease expires by itself."
        )
    if previous is not None and previous.holder != holder and not previous.released:
        log.warning(
            "took over a stale daemon lease from host %s pid %s (its heartbeat stopped at %s)",
            previous.host,
            previous.pid,
            previous.heartbeat_at.isoformat(),
        )
    return current


def renew_lease(engine: Engine, holder: str, ttl: timedelta, state: str, now: datetime | None = None) -> bool:
    """Extend our lease; False if it is no longer ours (another daemon took it over)."""
    now = _aware(now or utcnow(), "now")
    with session_scope(engine) as session:
        result = session.execute(
            update(DaemonLease)
            .where(DaemonLease.name == LEASE_NAME, DaemonLease.holder == holder, DaemonLease.released.is_(False))
            .values(heartbeat_at=now, expires_at=now + ttl, state=state)
        )
        return bool(result.rowcount)


def release_lease(engine: Engine, holder: str, now: datetime | None = None) -> None:
    """Give the lease up so the next daemon starts at once (no wait for expiry)."""
    now = _aware(now or utcnow(), "now")
    with session_scope(engine) as session:
        session.execute(
            update(DaemonLease)
            .where(DaemonLease.name == LEASE_NAME, DaemonLease.holder == holder)
            .values(released=True, expires_at=now, heartbeat_at=now, state="stopped")
        )


# --------------------------------------------------------------------------- run bookkeeping


def night_complete(engine: Engine, as_of: datetime) -> bool:
    """Whether the night of ``as_of`` needs no more work.

    Complete means the daemon recorded it ok or skipped, or its queue was planned and
    nothing in it is pending or running (e.g. a user ran ``batch run`` by hand).
    """
    as_of = _aware(as_of, "as_of")
    with session_scope(engine) as session:
        recorded = session.scalar(
            select(func.count())
            .select_from(Run)
            .where(Run.kind == NIGHTLY_KIND, Run.as_of == as_of, Run.status.in_(_DONE_STATUSES))
        )
        if recorded:
            return True
        by_status = dict(
            session.execute(
                select(GenerationRequest.status, func.count())
                .where(GenerationRequest.as_of == as_of)
                .group_by(GenerationRequest.status)
            ).all()
        )
    return bool(by_status) and not by_status.get("pending") and not by_status.get("running")


def _queue_counts(engine: Engine, as_of: datetime) -> dict[str, int]:
    with session_scope(engine) as session:
        rows = session.execute(
            select(GenerationRequest.status, func.count())
            .where(GenerationRequest.as_of == as_of)
            .group_by(GenerationRequest.status)
        ).all()
    return {status: int(n) for status, n in rows}


def _start_run(engine: Engine, kind: str, as_of: datetime | None, host: str) -> int:
    now = utcnow()
    with session_scope(engine) as session:
        run = Run(
            kind=kind, status="running", as_of=as_of, started_at=now, heartbeat_at=now, host=host, pid=os.getpid()
        )
        session.add(run)
        session.flush()
        return run.id


def _finish_run(
    engine: Engine,
    run_id: int,
    status: str,
    *,
    error: str | None = None,
    counts: dict[str, int | str | None] | None = None,
    done: int | None = None,
    total: int | None = None,
) -> None:
    now = utcnow()
    values: dict[str, object] = {"status": status, "finished_at": now, "heartbeat_at": now, "error": error}
    if counts is not None:
        values["counts"] = counts
    if done is not None:
        values["done"] = done
    if total is not None:
        values["total"] = total
    with session_scope(engine) as session:
        session.execute(update(Run).where(Run.id == run_id).values(**values))


def _record_skipped(engine: Engine, as_of: datetime, reason: str, host: str) -> None:
    run_id = _start_run(engine, NIGHTLY_KIND, as_of, host)
    _finish_run(engine, run_id, "skipped", error=reason)


# --------------------------------------------------------------------------- the child


def generate_command(config: AppConfig, as_of: datetime, *, log_format: str = "text") -> list[str]:
    """The command line of the generation child for the night of ``as_of``.

    The child logs in the daemon's format and at its level, so one journal holds both.
    """
    if config.source is None:
        raise RobotLLMError("the daemon needs a config loaded from a file (the generation child reads it)")
    verbosity = {"DEBUG": ["-vv"], "INFO": ["-v"]}.get(config.logging.level, [])
    return [
        sys.executable,
        "-m",
        "robot_llm.cli",
        "batch",
        "run",
        "-c",
        str(config.source),
        "--as-of",
        _aware(as_of, "as_of").isoformat(),
        "--log-format",
        log_format,
        *verbosity,
    ]


@dataclass(frozen=True)
class ChildOutcome:
    """How the generation child ended."""

    pid: int
    returncode: int
    stop_requested: bool  # we forwarded SIGTERM because the daemon is stopping
    timed_out: bool  # it ran past batch.child_timeout
    killed_by_us: bool  # it ignored SIGTERM and got SIGKILL after daemon.shutdown_timeout

    @property
    def stalled(self) -> bool:
        """The worker's watchdog ended it: a batch made no progress for ``batch.stall_timeout``."""
        from robot_llm.batch import WATCHDOG_EXIT_CODE

        return self.returncode == WATCHDOG_EXIT_CODE

    def describe(self) -> str:
        """One line for logs and ``Run.error``."""
        if self.stalled:
            text = (
                f"the generation child (pid {self.pid}) stopped itself: a batch made no progress "
                "for batch.stall_timeout"
            )
        elif self.returncode < 0:
            sig = signal.Signals(-self.returncode).name
            text = f"the generation child (pid {self.pid}) was killed by {sig}"
            if self.killed_by_us:
                text += " after it ignored SIGTERM for daemon.shutdown_timeout"
            elif -self.returncode == signal.SIGKILL:
                text += " (not by robot-llm: the kernel's out-of-memory killer, or an operator)"
        else:
            text = f"the generation child (pid {self.pid}) exited with code {self.returncode}"
        if self.timed_out:
            text += "; it had run longer than batch.child_timeout"
        return text


def _child_env() -> dict[str, str]:
    # The package may run from a checkout (not installed): let the child import it the same way.
    root = str(Path(__file__).resolve().parent.parent)
    env = dict(os.environ)
    parts = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if root not in parts:
        env["PYTHONPATH"] = os.pathsep.join([root, *parts])
    return env


# --------------------------------------------------------------------------- the daemon


@dataclass(frozen=True)
class _Outcome:
    """What a job reports back for its Run row."""

    status: str  # ok | failed
    counts: dict[str, Any]
    error: str | None = None


class _InFlight:
    """Counts running jobs so shutdown can wait for them (APScheduler's own wait is unbounded)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._active: Counter[str] = Counter()

    def enter(self, name: str) -> None:
        with self._cond:
            self._active[name] += 1

    def leave(self, name: str) -> None:
        with self._cond:
            self._active[name] -= 1
            if self._active[name] <= 0:
                del self._active[name]
            self._cond.notify_all()

    def names(self) -> list[str]:
        with self._cond:
            return sorted(self._active)

    def wait_idle(self, timeout: float) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: not self._active, timeout)


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
        self._in_flight = _InFlight()
        self._stats: Counter[str] = Counter()
        self._stats_lock = threading.Lock()
        self._child: subprocess.Popen[bytes] | None = None
        self._night: str | None = None
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
        child = self._child
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
            from robot_llm.report_html import require_plotly

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
            _cron(config.schedule.signals, tz),
            args=("signals", "ingest_signals", self._ingest_signals),
            id="signals",
            name="signals",
            misfire_grace_time=300,
            **_JOB_POLICY,
        )
        scheduler.add_job(
            self._guarded,
            _cron(config.schedule.nightly, tz),
            args=("nightly", None, self._nightly),  # records its own 'nightly' Run rows
            id="nightly",
            name="nightly",
            # However late it fires, it runs: the job itself refuses to start after the cut-off.
            misfire_grace_time=None,
            **_JOB_POLICY,
        )
        scheduler.add_job(
            self._guarded,
            _cron(config.schedule.morning_report, tz),
            args=("morning_report", None, self._report),  # report_job records its own 'report' Run
            id="morning_report",
            name="morning_report",
            misfire_grace_time=3600,
            **_JOB_POLICY,
        )

    def _catch_up(self, scheduler: BlockingScheduler, config: AppConfig) -> None:
        now = utcnow()
        try:
            as_of = _night_as_of(config, now)
        except RobotLLMError as exc:
            log.warning("no nightly run to catch up: %s", exc)
            return
        complete = night_complete(self._engine, as_of)
        if should_catch_up(config, as_of, now, complete=complete):
            log.info("the night of %s was missed or left unfinished; catching up now", as_of.isoformat())
            scheduler.modify_job("nightly", next_run_time=datetime.now(config.tz))
        elif not complete and not self._night_recorded(as_of):
            reason = non_trading_reason(config, as_of)
            if reason is not None:
                reason = f"non-trading day: {reason}"
            else:
                cutoff = night_cutoff(config, as_of)
                reason = f"missed while the daemon was down; its cut-off {cutoff.isoformat()} has passed"
            _record_skipped(self._engine, as_of, reason, self.host)
            log.warning("the night of %s was not run: %s", as_of.isoformat(), reason)

    def _night_recorded(self, as_of: datetime) -> bool:
        with session_scope(self._engine) as session:
            return bool(
                session.scalar(
                    select(func.count()).select_from(Run).where(Run.kind == NIGHTLY_KIND, Run.as_of == as_of)
                )
            )

    def _describe_jobs(self) -> str:
        now = utcnow()
        tz = self.config.tz
        parts = []
        for fire in upcoming_fires(self.config, now):
            when = f"{fire.next_fire.astimezone(tz):%Y-%m-%d %H:%M %Z}" if fire.next_fire else fire.note
            parts.append(f"{fire.job} {when}")
        return "; ".join(parts)

    # ----------------------------------------------------------------- jobs

    def _guarded(self, name: str, kind: str | None, fn: Callable[..., _Outcome | None], *args: object) -> None:
        """Run one job: skip it once stopping, record it as a Run of ``kind``, never let it raise."""
        self._in_flight.enter(name)  # before the stop check, so shutdown's drain cannot miss this job
        run_id = None
        try:
            # Queued executions that start after a stop request are dropped: "no new work".
            if self._stop.is_set():
                return
            if kind is not None:
                run_id = _start_run(self._engine, kind, None, self.host)
            outcome = fn(*args)
            if run_id is not None and outcome is not None:
                _finish_run(self._engine, run_id, outcome.status, error=outcome.error, counts=outcome.counts)
            self._count(f"{name.split(':')[0]}_{outcome.status if outcome else 'done'}")
        except Exception as exc:
            self._count(f"{name.split(':')[0]}_failed")
            log.exception("job %s failed", name)
            if run_id is not None:
                try:
                    _finish_run(self._engine, run_id, "failed", error=f"{type(exc).__name__}: {exc}")
                except Exception:
                    log.exception("could not record the failure of job %s", name)
        finally:
            self._in_flight.leave(name)

    def _count(self, key: str) -> None:
        with self._stats_lock:
            self._stats[key] += 1

    def _ingest_feed(self, feed_name: str) -> _Outcome:
        from robot_llm.ingest.feeds import ingest_feeds

        (result,) = ingest_feeds(self.config, self._engine, only=[feed_name])
        counts = {
            "feed": result.feed,
            "fetch": result.status,
            "http_status": result.http_status,
            "new": result.new,
            "duplicates": result.duplicates,
        }
        return _Outcome("ok" if result.ok else "failed", counts, result.error)

    def _ingest_signals(self) -> _Outcome:
        from robot_llm.ingest.signals import ingest_signals

        results = ingest_signals(self.config, self._engine)
        errors = [r.error for r in results if r.error]
        counts = {
            "files": len(results),
            "stored": sum(r.stored for r in results),
            "duplicates": sum(r.duplicates for r in results),
            "rejected": sum(len(r.rejects) for r in results),
            "errors": len(errors),
        }
        return _Outcome("failed" if errors else "ok", counts, "; ".join(errors) or None)

    def _report(self) -> None:
        config = self.config
        from robot_llm.report import format_report, report_job

        report = report_job(config, self._engine)
        log.info("morning report:\n%s", format_report(report, config))
        if config.report.html_dir is not None:
            from robot_llm.report_html import write_morning

            log.info("morning report page: %s", write_morning(config, self._engine, report.day))

    def _nightly(self) -> None:
        config = self.config
        now = utcnow()
        as_of = _night_as_of(config, now)
        if night_complete(self._engine, as_of):
            log.info("night %s is already complete; nothing to do", as_of.isoformat())
            return
        reason = non_trading_reason(config, as_of)
        if reason is not None:
            _record_skipped(self._engine, as_of, f"non-trading day: {reason}", self.host)
            log.info("night %s skipped: %s", as_of.isoformat(), reason)
            return
        cutoff = night_cutoff(config, as_of)
        if now >= cutoff:
            _record_skipped(self._engine, as_of, f"started after its cut-off {cutoff.isoformat()}", self.host)
            log.warning("night %s not started: its cut-off %s has passed", as_of.isoformat(), cutoff.isoformat())
            return
        self._run_night(config, as_of)

    def _run_night(self, config: AppConfig, as_of: datetime) -> None:
        run_id = _start_run(self._engine, NIGHTLY_KIND, as_of, self.host)
        self._night = as_of.isoformat()
        try:
            from robot_llm.plan import plan_night

            try:
                plan = plan_night(config, self._engine, as_of)
            except Exception as exc:
                _finish_run(self._engine, run_id, "failed", error=f"planning failed: {exc}")
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
                _finish_run(
                    self._engine, run_id, "aborted", error="the daemon stopped before generation", counts=counts
                )
                return
            queue = _queue_counts(self._engine, as_of)
            if not queue.get("pending") and not queue.get("running"):
                _finish_run(self._engine, run_id, "ok", counts={**counts, **queue}, done=queue.get("done", 0))
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
            self._night = None

    def _run_child(self, config: AppConfig, as_of: datetime, run_id: int) -> ChildOutcome:
        cmd = generate_command(config, as_of, log_format=self._log_format)
        log.info("starting the generation child: %s", " ".join(cmd))
        # A new session: a Ctrl-C in the daemon's terminal is ours to forward, not the child's to receive.
        proc = subprocess.Popen(cmd, env=_child_env(), start_new_session=True)
        self._child = proc
        started = _time.monotonic()
        deadline = started + config.batch.child_timeout.total_seconds()
        grace = config.daemon.shutdown_timeout.total_seconds()
        term_at: float | None = None
        stop_requested = timed_out = killed = False
        last_beat = started
        try:
            while True:
                try:
                    returncode = proc.wait(timeout=0.25)
                    break
                except subprocess.TimeoutExpired:
                    pass
                now = _time.monotonic()
                if term_at is None and (self._stop.is_set() or now > deadline):
                    stop_requested = self._stop.is_set()
                    timed_out = not stop_requested
                    log.info("sending SIGTERM to the generation child (pid %d)", proc.pid)
                    proc.send_signal(signal.SIGTERM)
                    term_at = now
                elif term_at is not None and not killed and (self._kill_now.is_set() or now - term_at > grace):
                    log.warning("the generation child (pid %d) did not stop; sending SIGKILL", proc.pid)
                    proc.kill()
                    killed = True
                if now - last_beat >= 5:
                    last_beat = now
                    self._beat_run(run_id, as_of)
        finally:
            self._child = None
        return ChildOutcome(proc.pid, returncode, stop_requested, timed_out, killed)

    def _beat_run(self, run_id: int, as_of: datetime) -> None:
        queue = _queue_counts(self._engine, as_of)
        with session_scope(self._engine) as session:
            session.execute(
                update(Run)
                .where(Run.id == run_id)
                .values(heartbeat_at=utcnow(), done=queue.get("done", 0), total=sum(queue.values()))
            )

    def _finish_night(
        self, run_id: int, as_of: datetime, outcome: ChildOutcome, counts: dict[str, int | str | None]
    ) -> None:
        queue = _queue_counts(self._engine, as_of)
        left = queue.get("pending", 0) + queue.get("running", 0)
        counts = {**counts, **{f"requests_{k}": v for k, v in queue.items()}, "child_returncode": outcome.returncode}
        done, total = queue.get("done", 0), sum(queue.values())
        # SIGTERM before the child installed its handler (still importing) kills it outright;
        # that is still the clean stop we asked for, not a failure.
        stopped = outcome.stop_requested and outcome.returncode in (0, -signal.SIGTERM)
        if outcome.returncode != 0 and not stopped:
            error = outcome.describe()
            self._fail_orphaned_worker_runs(outcome.pid, error)
            _finish_run(self._engine, run_id, "failed", error=error, counts=counts, done=done, total=total)
            log.error("night %s failed: %s; %d requests left for the next run", as_of.isoformat(), error, left)
        elif left and stopped:
            error = f"stopped by the daemon's shutdown; {left} requests left for the next run"
            _finish_run(self._engine, run_id, "aborted", error=error, counts=counts, done=done, total=total)
            log.info("night %s stopped cleanly: %d of %d done", as_of.isoformat(), done, total)
        elif left:
            error = f"the generation child exited 0 but {left} requests are still pending or running"
            _finish_run(self._engine, run_id, "failed", error=error, counts=counts, done=done, total=total)
            log.error("night %s: %s", as_of.isoformat(), error)
        else:
            _finish_run(self._engine, run_id, "ok", counts=counts, done=done, total=total)
            log.info("night %s complete: %d done, %d failed", as_of.isoformat(), done, queue.get("failed", 0))

    def _fail_orphaned_worker_runs(self, child_pid: int, error: str) -> None:
        # A killed worker cannot close its own Run row; close it for it so status does not lie.
        with session_scope(self._engine) as session:
            session.execute(
                update(Run)
                .where(Run.pid == child_pid, Run.host == self.host, Run.status == "running", Run.kind != NIGHTLY_KIND)
                .values(status="failed", finished_at=utcnow(), error=error)
            )

    def _abort_orphaned_runs(self) -> None:
        # We hold the lease, so nightly rows still 'running' belong to a daemon that died.
        with session_scope(self._engine) as session:
            result = session.execute(
                update(Run)
                .where(Run.kind == NIGHTLY_KIND, Run.status == "running")
                .values(status="aborted", finished_at=utcnow(), error="the daemon running it stopped before it ended")
            )
            if result.rowcount:
                log.warning("marked %d nightly run(s) of a previous daemon as aborted", result.rowcount)

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
        if self._night is not None:
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
        if self._night is not None:
            parts.append(f"night={self._night}")
        child = self.child_pid
        if child is not None:
            parts.append(f"child_pid={child}")
        parts.append(stats)
        return " ".join(parts)
