"""``robot-llm run`` (the daemon) and ``robot-llm status`` (what the daemon is doing)."""

from __future__ import annotations

import argparse
import logging
import os
from datetime import datetime, timezone
from typing import TYPE_CHECKING

from robot_llm.commands.common import load_app_config, open_database

if TYPE_CHECKING:
    from sqlalchemy.engine import Engine

    from robot_llm.config import AppConfig

__all__ = ["format_status", "register"]

log = logging.getLogger("robot_llm.daemon.scheduler")


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser], common: argparse.ArgumentParser) -> None:
    """Add ``run`` and ``status`` to the CLI."""
    run = sub.add_parser(
        "run",
        parents=[common],
        help="run the scheduler daemon (feeds, signals, the nightly batch, the morning report)",
        description=(
            "Run the daemon in the foreground until SIGTERM/SIGINT; SIGHUP reloads the config. "
            "Only one daemon may run per database. Logs follow the config's logging section; "
            "--log-format json gives one JSON object per line."
        ),
    )
    run.set_defaults(handler=_run)
    status = sub.add_parser(
        "status",
        parents=[common],
        help="show the daemon's lease, the last run of each job and the next fire times",
    )
    status.set_defaults(handler=_status)


def _run(args: argparse.Namespace) -> int:
    from robot_llm.commands.common import console_level
    from robot_llm.daemon.scheduler import Daemon
    from robot_llm.logs import add_log_file, setup_logging
    from robot_llm.store.migrate import ensure_current

    config = load_app_config(args)
    # The global --log-format defaults to text, so "not given" and "text" look alike:
    # JSON when either the flag or logging.format in the config asks for it.
    fmt = "json" if "json" in (getattr(args, "log_format", "text"), config.logging.format) else "text"
    level = "DEBUG" if (getattr(args, "verbose", 0) or 0) >= 2 else config.logging.level
    if config.logging.file is None:  # stderr is the daemon's log (the journal under systemd)
        setup_logging(level=level, fmt=fmt, tz=config.tz)
    else:  # the file is its log; the terminal shows warnings, more with -v, as for every command
        setup_logging(level=console_level(args), fmt=fmt, tz=config.tz)
        add_log_file(level, fmt, config.logging.file, tz=config.tz)
    if level != "DEBUG":
        # APScheduler logs every job start and end at INFO; our own lines say what each job did.
        logging.getLogger("apscheduler").setLevel(logging.WARNING)
    engine = open_database(config)
    ensure_current(engine, args.config)
    # With a log file the terminal shows the child's warnings (more with -v), as it does the daemon's;
    # without one, stderr is the daemon's log and the child logs there at the same level.
    verbosity = (getattr(args, "verbose", 0) or 0) if config.logging.file is not None else None
    daemon = Daemon(config, engine, log_format=fmt, verbosity=verbosity)
    code = daemon.run()
    if daemon.jobs_left_running:
        # A job that ignored the shutdown would keep the interpreter alive (thread-pool
        # threads are joined at exit); the exit must stay bounded.
        logging.shutdown()
        os._exit(code)
    return code


def _status(args: argparse.Namespace) -> int:
    from robot_llm.store.migrate import ensure_current

    config = load_app_config(args)
    engine = open_database(config)
    try:
        ensure_current(engine, args.config)  # an un-migrated database: say what to run, not a raw SQL error
        print(format_status(config, engine, datetime.now(timezone.utc)))
    finally:
        engine.dispose()
    return 0


def _age(now: datetime, then: datetime | None) -> str:
    if then is None:
        return "never"
    seconds = int((now - then).total_seconds())
    if abs(seconds) < 120:
        return f"{seconds}s ago"
    if abs(seconds) < 7200:
        return f"{seconds // 60}m ago"
    return f"{seconds // 3600}h ago"


def format_status(config: AppConfig, engine: Engine, now: datetime) -> str:
    """The text of ``robot-llm status``: lease holder, last run per job kind, next fire times."""
    from sqlalchemy import func, select

    from robot_llm.clock import upcoming_fires
    from robot_llm.daemon.lease import read_lease
    from robot_llm.store.db import Run, session_scope

    tz = config.tz
    lines: list[str] = []
    lease = read_lease(engine)
    if lease is None:
        lines.append("daemon: none has run on this database")
    elif lease.is_live(now):
        lines.append(
            f"daemon: running on host {lease.host}, pid {lease.pid}, state {lease.state}; "
            f"heartbeat {_age(now, lease.heartbeat_at)}; started {lease.acquired_at.astimezone(tz):%Y-%m-%d %H:%M %Z}"
        )
    elif lease.released:
        lines.append(
            f"daemon: not running (last one: host {lease.host}, pid {lease.pid}, "
            f"stopped {_age(now, lease.heartbeat_at)})"
        )
    else:
        lines.append(
            f"daemon: not running; the last one (host {lease.host}, pid {lease.pid}) died without releasing "
            f"its lease (last heartbeat {_age(now, lease.heartbeat_at)}); the next daemon takes it over"
        )

    with session_scope(engine) as session:
        latest = select(func.max(Run.id)).group_by(Run.kind)
        runs = session.scalars(select(Run).where(Run.id.in_(latest)).order_by(Run.kind)).all()
    lines.append("")
    lines.append("last runs:")
    if not runs:
        lines.append("  none yet")
    for run in runs:
        text = f"  {run.kind:<15} {run.status:<8} started {run.started_at.astimezone(tz):%Y-%m-%d %H:%M:%S %Z}"
        if run.as_of is not None:
            text += f", night {run.as_of.astimezone(tz):%Y-%m-%d %H:%M}"
        if run.total:
            text += f", {run.done}/{run.total} done"
        if run.status == "running":
            text += f", heartbeat {_age(now, run.heartbeat_at)}"
        if run.error:
            text += f" - {run.error.splitlines()[0]}"
        lines.append(text)

    lines.append("")
    lines.append(f"next fire times ({config.timezone}):")
    for fire in upcoming_fires(config, now):
        when = f"{fire.next_fire.astimezone(tz):%Y-%m-%d %H:%M %Z}" if fire.next_fire else "-"
        lines.append(f"  {fire.job:<15} {when:<22} {fire.note}")
    return "\n".join(lines)
