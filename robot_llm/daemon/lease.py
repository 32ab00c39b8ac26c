"""The daemon lease: one scheduler per database, across hosts.

A row in ``daemon_leases`` is taken atomically (insert, or take over a row whose holder
released it or let it expire) and renewed by the daemon's heartbeat. It works across hosts
sharing one PostgreSQL, which a pidfile cannot.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from sqlalchemy import or_, update

from robot_llm.clock import aware_utc
from robot_llm.errors import RobotLLMError
from robot_llm.store.db import DaemonLease, DatabaseError, session_scope, utcnow
from robot_llm.store.runs import process_gone

if TYPE_CHECKING:
    from sqlalchemy.engine import Engine

__all__ = ["LEASE_NAME", "LeaseHeldError", "LeaseInfo", "acquire_lease", "read_lease", "release_lease", "renew_lease"]

log = logging.getLogger("robot_llm.daemon.scheduler")

LEASE_NAME = "daemon"


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
        return not self.released and self.expires_at > aware_utc(now, "now")


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
    released it, let it expire, is us, or is a process of this host that is gone (a SIGKILLed
    daemon is taken over at once, not after its lease ran out). Both PostgreSQL and SQLite
    evaluate that ``ON CONFLICT ... DO UPDATE ... WHERE`` under the row's lock, so two daemons
    starting at once cannot both win.
    """
    now = aware_utc(now or utcnow(), "now")
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
    # Read first, in its own transaction (a read before the write in one SQLite transaction
    # could fail to upgrade to a write lock): whose lease we take over, and whether it is dead.
    previous = read_lease(engine, name)
    takeover = [table.c.expires_at <= now, table.c.released.is_(True), table.c.holder == holder]
    dead = previous is not None and not previous.released and process_gone(previous.host, previous.pid)
    if dead:
        assert previous is not None
        takeover.append(table.c.holder == previous.holder)  # only if that dead daemon still holds it
    stmt = insert(table).values(**values)
    stmt = stmt.on_conflict_do_update(
        index_elements=[table.c.name],
        set_={k: stmt.excluded[k] for k in values if k != "name"},
        where=or_(*takeover),
    )
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
            f"(state {current.state}, last heartbeat {age:.0f}s ago, lease expires in {left:.0f}s, at "
            f"{current.expires_at:%Y-%m-%d %H:%M:%SZ}). Stop it first; if it died on another host, "
            "its lease expires by itself (a dead daemon of this host is taken over at once)."
        )
    if previous is not None and previous.holder != holder and not previous.released:
        log.warning(
            "took over the daemon lease of host %s pid %s (%s; its last heartbeat %s)",
            previous.host,
            previous.pid,
            "that process is gone" if dead else "its lease had expired",
            previous.heartbeat_at.isoformat(),
        )
    return current


def renew_lease(engine: Engine, holder: str, ttl: timedelta, state: str, now: datetime | None = None) -> bool:
    """Extend our lease; False if it is no longer ours (another daemon took it over)."""
    now = aware_utc(now or utcnow(), "now")
    with session_scope(engine) as session:
        result = session.execute(
            update(DaemonLease)
            .where(DaemonLease.name == LEASE_NAME, DaemonLease.holder == holder, DaemonLease.released.is_(False))
            .values(heartbeat_at=now, expires_at=now + ttl, state=state)
        )
        return bool(result.rowcount)


def release_lease(engine: Engine, holder: str, now: datetime | None = None) -> None:
    """Give the lease up so the next daemon starts at once (no wait for expiry)."""
    now = aware_utc(now or utcnow(), "now")
    with session_scope(engine) as session:
        session.execute(
            update(DaemonLease)
            .where(DaemonLease.name == LEASE_NAME, DaemonLease.holder == holder)
            .values(released=True, expires_at=now, heartbeat_at=now, state="stopped")
        )
