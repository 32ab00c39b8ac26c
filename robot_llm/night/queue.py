"""The queue of generation requests: claim under a lease, store theses, record failures.

The queue is the ``generation_requests`` table. A worker claims up to
``model.max_batch_size`` requests at a time under a *lease* (``lease_owner``,
``lease_expires_at``) and stores the batch's theses in one transaction the moment the
batch is done, so a crash loses at most the batch in flight. A request is claimable
when it is ``pending``, or ``running`` under a lease that expired (its worker died);
it is never claimed past its ``valid_until``.

* PostgreSQL: ``SELECT ... FOR UPDATE SKIP LOCKED`` and the lease are taken in one
  transaction, so any number of workers on any number of hosts share one queue
  without ever taking the same request.
* SQLite: one writer per database file. The claim is an immediate write transaction,
  and a worker claims nothing while another worker's generate run is alive (its
  heartbeat younger than the lease), so a second worker finds nothing to claim.

``theses.request_id`` is unique and theses are inserted with ``ON CONFLICT DO
NOTHING``: if a slow worker's lease expired and another worker finished the same
request first, the late thesis is dropped, never stored twice.
"""

from __future__ import annotations

import logging
import socket
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from sqlalchemy import and_, func, or_, select, update
from sqlalchemy.engine import Connection, Engine

from robot_llm.store.db import GenerationRequest, Run, Thesis, db_clock, utcnow
from robot_llm.store.runs import abort_runs, beat_run, finish_run, process_gone, start_run
from robot_llm.thesis.validity import thesis_problem

if TYPE_CHECKING:
    from robot_llm.config import AppConfig

__all__ = ["ClaimedRequest", "RequestQueue", "Tally", "alive_window", "heartbeat_interval"]

log = logging.getLogger("robot_llm.night.worker")


@dataclass
class Tally:
    """What one worker run did so far (its Run row's counts)."""

    done: int = 0
    failed: int = 0
    retried: int = 0
    duplicates: int = 0
    batches: int = 0
    new_tokens: int = 0
    seconds: float = 0.0
    failures: list[tuple[int, str]] = field(default_factory=list)
    flags: Counter[str] = field(default_factory=Counter)  # rows flagged, by flag (robot_llm.thesis.rows)
    label_priors: dict[str, Any] = field(default_factory=dict)  # robot_llm.night.stance.Calibration.measured

    def counts(self, worker_id: str) -> dict[str, Any]:
        return {
            "flags": dict(self.flags),
            "label_priors": self.label_priors,
            "worker_id": worker_id,
            "theses": self.done,
            "failed": self.failed,
            "retried": self.retried,
            "duplicates": self.duplicates,
            "batches": self.batches,
            "new_tokens": self.new_tokens,
            "batch_seconds": round(self.seconds, 3),
        }

    @property
    def tokens_per_s(self) -> float | None:
        return self.new_tokens / self.seconds if self.seconds > 0 else None

    @property
    def handled(self) -> int:
        """Requests this run finished with: stored, failed for good, or found already stored."""
        return self.done + self.failed + self.duplicates


@dataclass(frozen=True)
class ClaimedRequest:
    """One claimed generation request, detached from the database."""

    id: int
    as_of: datetime
    ticker: str
    template_name: str
    template_version: str
    prompt: str
    prompt_sha256: str
    prompt_tokens: int
    news_ids: list[int]
    signal_ids: list[int]
    params: dict[str, Any]
    valid_until: datetime
    attempts: int


def heartbeat_interval(config: AppConfig) -> float:
    """Seconds between a worker's heartbeats (and lease renewals, and stall checks)."""
    batch = config.batch
    return max(0.05, min(batch.lease.total_seconds() / 4, batch.stall_timeout.total_seconds() / 4, 30.0))


def alive_window(config: AppConfig) -> timedelta:
    """A generate run whose heartbeat is older than this is taken for dead.

    Several missed heartbeats, not the whole lease: after a SIGKILL the rest of the
    queue is free again within minutes, while the dead worker's own batch waits for its
    leases to expire.
    """
    return min(config.batch.lease, timedelta(seconds=4 * heartbeat_interval(config) + 5))


def _claimable(now: datetime, as_of: datetime | None) -> Any:
    cond = and_(
        GenerationRequest.valid_until > now,
        or_(
            GenerationRequest.status == "pending",
            and_(GenerationRequest.status == "running", GenerationRequest.lease_expires_at < now),
        ),
    )
    if as_of is not None:
        cond = and_(cond, GenerationRequest.as_of == as_of)
    return cond


def _begin_write(conn: Connection) -> None:
    # pysqlite opens a deferred transaction that takes the write lock only at the first
    # write, so two workers could both read the same pending rows; BEGIN IMMEDIATE takes
    # the lock before the read.
    if conn.dialect.name == "sqlite":
        conn.exec_driver_sql("BEGIN IMMEDIATE")


class RequestQueue:
    """The claim / store / fail transactions of one worker."""

    def __init__(self, config: AppConfig, engine: Engine, worker_id: str, as_of: datetime | None) -> None:
        self.config = config
        self.engine = engine
        self.worker_id = worker_id
        self.as_of = as_of
        self.sqlite = engine.dialect.name == "sqlite"
        self.run_id: int | None = None

    def take_over(self) -> None:
        """Free the requests of this host's dead workers now, before anything is counted.

        A rerun right after a SIGKILL must see the dead worker's claimed requests as work to
        do even when nothing else is pending (one batch per night claims them all).
        """
        with self.engine.connect() as conn:
            _begin_write(conn)
            self._take_over_dead_workers(conn, utcnow())
            conn.commit()

    def remaining(self) -> int:
        with self.engine.connect() as conn:
            return int(
                conn.execute(
                    select(func.count()).select_from(GenerationRequest).where(_claimable(utcnow(), self.as_of))
                ).scalar_one()
            )

    def start_run(self, total: int) -> int:
        """Record this worker's ``generate`` run; generate runs whose worker vanished are closed first."""
        self.run_id = start_run(
            self.engine,
            "generate",
            as_of=self.as_of,
            total=total,
            counts={"worker_id": self.worker_id},
            # Workers killed by SIGKILL or a power loss never recorded an end.
            abort_stale=Run.heartbeat_at < utcnow() - alive_window(self.config),
        )
        return self.run_id

    def _take_over_dead_workers(self, conn: Connection, now: datetime) -> None:
        """Close the generate runs of this host whose process is gone, and free their requests now.

        Without this, an immediate rerun after a SIGKILL would find the dead worker's run
        alive (its last heartbeat is recent) and its requests leased for ``batch.lease``.
        A run already closed by someone else (the daemon records its killed child as
        failed) may still hold leases: those are freed too. Runs on other hosts are left to
        their heartbeat and leases.
        """
        rows = conn.execute(
            select(Run.id, Run.host, Run.pid, Run.counts, Run.status).where(
                Run.kind == "generate",
                Run.id != self.run_id,
                or_(
                    Run.status == "running",
                    # A lease lives at most batch.lease past its owner's last renewal.
                    and_(Run.host == socket.gethostname(), Run.finished_at >= now - self.config.batch.lease),
                ),
            )
        ).all()
        for row in rows:
            if not process_gone(row.host, row.pid):
                continue
            if row.status == "running":
                error = f"its worker (pid {row.pid}) is gone (killed or crashed); taken over by {self.worker_id}"
                abort_runs(conn, Run.id == row.id, error, now=now)
            owner = (row.counts or {}).get("worker_id")
            if not owner:
                continue
            # Claimable at once; the attempt it spent stays counted.
            freed = conn.execute(
                update(GenerationRequest)
                .where(
                    GenerationRequest.lease_owner == owner,
                    GenerationRequest.status == "running",
                    GenerationRequest.lease_expires_at >= now,
                )
                .values(lease_expires_at=now - timedelta(seconds=1), updated_at=now)
            ).rowcount
            if row.status == "running" or freed:
                log.warning(
                    "took over worker run #%s (pid %s on this host is gone): %d claimed request(s) free at once",
                    row.id,
                    row.pid,
                    freed,
                )

    def _other_live_worker(self, conn: Connection, now: datetime) -> str | None:
        window = alive_window(self.config)
        row = conn.execute(
            select(Run.id, Run.host, Run.pid, Run.heartbeat_at)
            .where(
                Run.kind == "generate",
                Run.status == "running",
                Run.id != self.run_id,
                Run.heartbeat_at > now - window,
            )
            .limit(1)
        ).first()
        if row is None:
            return None
        dead_after = (row.heartbeat_at + window).strftime("%Y-%m-%d %H:%M:%SZ")
        return (
            f"run #{row.id} (host {row.host}, pid {row.pid}) is alive; "
            f"it is taken for dead if its heartbeat stops, at {dead_after} at the earliest"
        )

    def claim(self, limit: int) -> tuple[list[ClaimedRequest], str | None]:
        """Claim up to ``limit`` requests; returns them, or ([], who) when another SQLite worker is active."""
        lease = self.config.batch.lease
        max_attempts = self.config.batch.max_attempts
        with self.engine.connect() as conn:
            _begin_write(conn)
            now = utcnow()
            self._take_over_dead_workers(conn, now)
            if self.sqlite:
                other = self._other_live_worker(conn, now)
                if other is not None:
                    conn.rollback()
                    return [], other
            # A request whose worker died while holding it max_attempts times is what kills
            # workers (e.g. out of memory); retrying it again would stall the night.
            conn.execute(
                update(GenerationRequest)
                .where(
                    GenerationRequest.status == "running",
                    GenerationRequest.lease_expires_at < now,
                    GenerationRequest.attempts >= max_attempts,
                )
                .values(
                    status="failed",
                    lease_owner=None,
                    lease_expires_at=None,
                    updated_at=now,
                    last_error=f"its worker died {max_attempts} times while working on it (lease expired)",
                )
            )
            query = (
                select(GenerationRequest)
                .where(_claimable(now, self.as_of))
                .order_by(GenerationRequest.as_of, GenerationRequest.id)
                .limit(limit)
            )
            if not self.sqlite:
                query = query.with_for_update(skip_locked=True)
            rows = conn.execute(query).mappings().all()
            ids = [r["id"] for r in rows]
            if ids:
                # The lease runs from now, once the rows are ours: the statements above may have
                # waited on another worker's locks for longer than a whole lease, and a lease
                # dated from before that wait would be expired when it commits (and the rows
                # claimable by anyone at once).
                leased_at = utcnow()
                conn.execute(
                    update(GenerationRequest)
                    .where(GenerationRequest.id.in_(ids))
                    .values(
                        status="running",
                        lease_owner=self.worker_id,
                        lease_expires_at=leased_at + lease,
                        attempts=GenerationRequest.attempts + 1,
                        updated_at=leased_at,
                    )
                )
            conn.commit()
        claimed = [
            ClaimedRequest(
                id=r["id"],
                as_of=r["as_of"],
                ticker=r["ticker"],
                template_name=r["template_name"],
                template_version=r["template_version"],
                prompt=r["prompt"],
                prompt_sha256=r["prompt_sha256"],
                prompt_tokens=r["prompt_tokens"],
                news_ids=list(r["news_ids"] or []),
                signal_ids=list(r["signal_ids"] or []),
                params=dict(r["params"] or {}),
                valid_until=r["valid_until"],
                attempts=r["attempts"] + 1,
            )
            for r in rows
        ]
        return claimed, None

    def _progress_values(self, tally: Tally, total: int) -> dict[str, Any]:
        return {
            "done": tally.done,
            "total": total,
            "tokens_per_s": tally.tokens_per_s,
            "counts": tally.counts(self.worker_id),
        }

    def store(self, rows: list[dict[str, Any]], tally: Tally, total: int) -> int:
        """Insert the batch's theses and mark their requests done in one transaction; returns rows inserted.

        A thesis another worker already stored for the same request is skipped (``ON
        CONFLICT DO NOTHING`` on the unique ``request_id``) and counted as a duplicate.
        """
        for row in rows:
            # The boundary itself refuses what the worker should never have handed over.
            problem = thesis_problem(row)
            if problem is not None:
                raise ValueError(f"request #{row['request_id']}: refusing to store an invalid thesis: {problem}")
        table = Thesis.__table__
        if self.sqlite:
            from sqlalchemy.dialects.sqlite import insert
        else:
            from sqlalchemy.dialects.postgresql import insert
        with self.engine.connect() as conn:
            _begin_write(conn)
            conn.execute(
                update(GenerationRequest)
                .where(GenerationRequest.id.in_([row["request_id"] for row in rows]))
                .values(status="done", lease_owner=None, lease_expires_at=None, last_error=None, updated_at=utcnow())
            )
            # available_at is the database's clock in the storing statement, the last before the
            # commit: not this worker's clock, which may run ahead of the database (a replay at T
            # would then see a thesis no reader could see at T).
            available_at = db_clock(conn.dialect.name)
            result = conn.execute(
                insert(table)
                .values([{**row, "available_at": available_at} for row in rows])
                .on_conflict_do_nothing(index_elements=["request_id"])
                .returning(table.c.request_id)
            )
            inserted = len(result.all())
            conn.commit()
        tally.done += inserted
        tally.duplicates += len(rows) - inserted
        self.progress(tally, total)
        return inserted

    def progress(self, tally: Tally, total: int) -> None:
        """Write the run's progress (done/total, tokens/s, counts, heartbeat)."""
        assert self.run_id is not None
        beat_run(self.engine, self.run_id, **self._progress_values(tally, total))

    def fail(self, errors: dict[int, str], attempts: dict[int, int], tally: Tally, total: int) -> None:
        """Record per-request errors: failed after ``max_attempts``, else back to pending for a retry."""
        max_attempts = self.config.batch.max_attempts
        with self.engine.connect() as conn:
            _begin_write(conn)
            now = utcnow()
            for request_id, error in errors.items():
                final = attempts[request_id] >= max_attempts
                conn.execute(
                    update(GenerationRequest)
                    .where(GenerationRequest.id == request_id, GenerationRequest.status == "running")
                    .values(
                        status="failed" if final else "pending",
                        lease_owner=None,
                        lease_expires_at=None,
                        last_error=error[:4000],
                        updated_at=now,
                    )
                )
                if final:
                    tally.failed += 1
                    tally.failures.append((request_id, error))
                else:
                    tally.retried += 1
            beat_run(conn, self.run_id, now=now, **self._progress_values(tally, total))
            conn.commit()

    def release(self, request_ids: list[int]) -> None:
        """Give back requests this worker claimed but will not finish (it was interrupted).

        They are pending again at once and the interrupted attempt is not counted: the
        interruption was the user's, not the request's.
        """
        if not request_ids:
            return
        with self.engine.connect() as conn:
            _begin_write(conn)
            conn.execute(
                update(GenerationRequest)
                .where(
                    GenerationRequest.id.in_(request_ids),
                    GenerationRequest.lease_owner == self.worker_id,
                    GenerationRequest.status == "running",
                )
                .values(
                    status="pending",
                    lease_owner=None,
                    lease_expires_at=None,
                    attempts=GenerationRequest.attempts - 1,
                    updated_at=utcnow(),
                )
            )
            conn.commit()

    def finish(self, status: str, tally: Tally, total: int, error: str | None) -> None:
        """Close this worker's run row with its final counts."""
        assert self.run_id is not None
        finish_run(self.engine, self.run_id, status, error=error, **self._progress_values(tally, total))
