"""The ``runs`` table's row lifecycle: start, heartbeat, finish, and closing rows whose process died.

Every stage that does work records one Run row: ``plan`` (:mod:`robot_llm.night.plan`),
``generate`` (the worker, :mod:`robot_llm.night.worker`), ``nightly`` (the daemon's record of one
night's plan + generation child) and the ingest and report jobs. A row is ``running`` while
its process heartbeats, then ``ok``, ``failed``, ``aborted`` or ``skipped``; a process that
was killed cannot close its own row, so whoever finds it dead closes it (see
:func:`abort_runs`).

Every write of a Run row is one of the functions here. Each takes an Engine (the write is its own
transaction) or a Connection (the write joins the caller's transaction, which commits it: the queue
heartbeats the run in the transaction that stores a batch, the watchdog bounds its lock waits).
"""

from __future__ import annotations

import os
import socket
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sqlalchemy import and_, func, select, update
from sqlalchemy.engine import Connection

from robot_llm.clock import aware_utc
from robot_llm.store.db import GenerationRequest, Run, session_scope, utcnow

if TYPE_CHECKING:
    from sqlalchemy.engine import CursorResult, Engine
    from sqlalchemy.sql import ColumnElement, Executable

__all__ = [
    "NIGHTLY_KIND",
    "abort_runs",
    "beat_run",
    "fail_runs",
    "finish_run",
    "night_complete",
    "night_recorded",
    "process_gone",
    "queue_counts",
    "record_finished",
    "record_skipped",
    "start_run",
]

#: The Run kind the daemon records for one night's plan + generation (the child's own
#: worker records its 'generate' rows; this row says how the child as a whole ended).
NIGHTLY_KIND = "nightly"
_DONE_STATUSES = ("ok", "skipped")


def _write(bind: Engine | Connection, statement: Executable) -> CursorResult[Any]:
    """Run ``statement`` in the caller's transaction (a Connection) or in one of its own (an Engine)."""
    if isinstance(bind, Connection):
        return bind.execute(statement)
    with bind.begin() as conn:
        return conn.execute(statement)


def process_gone(host: str | None, pid: int | None) -> bool:
    """Whether ``pid`` ran on *this* host and is gone (or a zombie): its rows can be taken over at once.

    A process on another host, or one we cannot see, is never declared gone here; it is
    taken for dead only when its heartbeat or lease expires.
    """
    if host != socket.gethostname() or pid is None or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, owned by another user
        return False
    try:  # killed but not yet reaped by its parent: as dead as it gets
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[:1]
    except OSError:
        return False
    return state == ["Z"]


def start_run(
    engine: Engine,
    kind: str,
    *,
    as_of: datetime | None = None,
    total: int | None = None,
    counts: dict[str, Any] | None = None,
    host: str | None = None,
    abort_stale: ColumnElement[bool] | None = None,
) -> int:
    """Insert a ``running`` row of ``kind`` for this process; returns its id.

    ``abort_stale`` selects rows of this kind whose process is known dead; they are closed
    as ``aborted`` in the same transaction, so no one sees both the dead run and ours alive.
    """
    now = utcnow()
    with engine.begin() as conn:
        if abort_stale is not None:
            error = "the worker vanished (its heartbeat stopped: killed or crashed)"
            abort_runs(conn, and_(Run.kind == kind, abort_stale), error, now=now)
        values: dict[str, Any] = {"total": total} if total is not None else {}
        if counts is not None:
            values["counts"] = counts
        run_id = conn.execute(
            Run.__table__.insert()
            .values(
                kind=kind,
                status="running",
                as_of=as_of,
                started_at=now,
                heartbeat_at=now,
                host=host or socket.gethostname(),
                pid=os.getpid(),
                **values,
            )
            .returning(Run.id)
        ).scalar_one()
    return int(run_id)


def beat_run(bind: Engine | Connection, run_id: int, *, now: datetime | None = None, **values: Any) -> None:
    """Heartbeat a running row (at ``now``, default this instant), with progress (``done``, ``total``,
    ``counts``...) in ``values``."""
    statement = update(Run).where(Run.id == run_id, Run.status == "running")
    _write(bind, statement.values(heartbeat_at=now or utcnow(), **values))


def finish_run(
    bind: Engine | Connection,
    run_id: int,
    status: str,
    *,
    error: str | None = None,
    counts: dict[str, Any] | None = None,
    **values: Any,
) -> None:
    """Close a running row as ``status``; a row already closed (e.g. by a watchdog's abort) is left alone."""
    now = utcnow()
    fields: dict[str, Any] = {"status": status, "finished_at": now, "heartbeat_at": now, "error": error, **values}
    if counts is not None:
        fields["counts"] = counts
    _write(bind, update(Run).where(Run.id == run_id, Run.status == "running").values(**fields))


def abort_runs(
    bind: Engine | Connection, where: ColumnElement[bool], error: str, *, now: datetime | None = None
) -> int:
    """Close the running rows ``where`` selects (their process is gone) as ``aborted``; returns how many."""
    return _close_runs(bind, where, "aborted", error, now)


def fail_runs(bind: Engine | Connection, where: ColumnElement[bool], error: str) -> int:
    """Close the running rows ``where`` selects as ``failed`` (a child the daemon saw die); returns how many."""
    return _close_runs(bind, where, "failed", error, None)


def _close_runs(
    bind: Engine | Connection, where: ColumnElement[bool], status: str, error: str, now: datetime | None
) -> int:
    statement = update(Run).where(Run.status == "running", where)
    result = _write(bind, statement.values(status=status, finished_at=now or utcnow(), error=error))
    return int(result.rowcount or 0)


def record_finished(
    engine: Engine, kind: str, started_at: datetime, *, counts: dict[str, Any], done: int, total: int
) -> None:
    """Record a run of ``kind`` that started at ``started_at`` and ended ``ok`` just now (a report job)."""
    _write(
        engine,
        Run.__table__.insert().values(
            kind=kind,
            status="ok",
            started_at=started_at,
            finished_at=utcnow(),
            heartbeat_at=started_at,
            done=done,
            total=total,
            counts=counts,
            host=socket.gethostname(),
            pid=os.getpid(),
        ),
    )


def record_skipped(engine: Engine, as_of: datetime, reason: str, host: str | None = None) -> None:
    """Record that the night of ``as_of`` was deliberately not run, and why."""
    run_id = start_run(engine, NIGHTLY_KIND, as_of=as_of, host=host)
    finish_run(engine, run_id, "skipped", error=reason)


def queue_counts(engine: Engine, as_of: datetime) -> dict[str, int]:
    """Generation requests of the night ``as_of`` by status."""
    with session_scope(engine) as session:
        rows = session.execute(
            select(GenerationRequest.status, func.count())
            .where(GenerationRequest.as_of == as_of)
            .group_by(GenerationRequest.status)
        ).all()
    return {status: int(n) for status, n in rows}


def night_complete(engine: Engine, as_of: datetime) -> bool:
    """Whether the night of ``as_of`` needs no more work.

    Complete means the daemon recorded it ok or skipped, or its queue was planned and
    nothing in it is pending or running (e.g. a user ran ``batch run`` by hand).
    """
    as_of = aware_utc(as_of, "as_of")
    with session_scope(engine) as session:
        recorded = session.scalar(
            select(func.count())
            .select_from(Run)
            .where(Run.kind == NIGHTLY_KIND, Run.as_of == as_of, Run.status.in_(_DONE_STATUSES))
        )
    if recorded:
        return True
    by_status = queue_counts(engine, as_of)
    return bool(by_status) and not by_status.get("pending") and not by_status.get("running")


def night_recorded(engine: Engine, as_of: datetime) -> bool:
    """Whether any nightly row (whatever its status) exists for ``as_of``."""
    with session_scope(engine) as session:
        return bool(
            session.scalar(select(func.count()).select_from(Run).where(Run.kind == NIGHTLY_KIND, Run.as_of == as_of))
        )
