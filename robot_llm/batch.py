"""The nightly generate worker: claim requests, run the model, store theses as they finish.

The queue is the ``generation_requests`` table. A worker claims up to
``model.max_batch_size`` requests at a time under a *lease* (``lease_owner``,
``lease_expires_at``), runs them through the model as one batch, scores the stance
of every thesis, and stores the batch's theses in one transaction the moment the
batch is done, so a crash loses at most the batch in flight. A request is claimable
when it is ``pending``, or ``running`` under a lease that expired (its worker died);
it is never claimed past its ``valid_until``.

Backends:

* PostgreSQL: ``SELECT ... FOR UPDATE SKIP LOCKED`` and the lease are taken in one
  transaction, so any number of workers on any number of hosts share one queue
  without ever taking the same request.
* SQLite: one writer per database file. The claim is an immediate write transaction,
  and a worker claims nothing while another worker's generate run is alive (its
  heartbeat younger than the lease), so a second worker finds nothing to claim.

``theses.request_id`` is unique and theses are inserted with ``ON CONFLICT DO
NOTHING``: if a slow worker's lease expired and another worker finished the same
request first, the late thesis is dropped, never stored twice.

A watchdog thread heartbeats the run, renews the leases of the batch in flight and,
when the batch makes no progress for ``batch.stall_timeout``, records the run as
``aborted`` and ends the process with :func:`os._exit` (see :class:`_Watchdog` for why).
"""

from __future__ import annotations

import logging
import math
import os
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from sqlalchemy import and_, func, or_, select, update
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import SQLAlchemyError

from robot_llm.db import GenerationRequest, Run, Thesis, make_engine, utcnow
from robot_llm.errors import RobotLLMError

if TYPE_CHECKING:
    from robot_llm.config import AppConfig
    from robot_llm.llm.generate import Completion, SamplingParams
    from robot_llm.llm.tokenizer import Tokenizer

__all__ = [
    "BatchError",
    "BatchModel",
    "RunSummary",
    "StanceResult",
    "open_configured_model",
    "run_queue",
    "sampling_params",
    "stance_from_logprobs",
]

log = logging.getLogger(__name__)

#: Exit status of a process the watchdog ended (a stalled batch).
WATCHDOG_EXIT_CODE = 3
#: The longest the watchdog waits for the database while recording an abort.
ABORT_RECORD_TIMEOUT_S = 15.0


class BatchError(RobotLLMError):
    """The run cannot go on (database down, disk full, model cannot load); already stored theses are intact."""


# --------------------------------------------------------------------------- the model


class BatchModel(Protocol):
    """What the worker needs from a loaded model (the engine's ``LoadedModel`` shape)."""

    model_id: str
    tokenizer: Tokenizer
    max_positions: int

    def generate(
        self,
        prompts: list[str],
        params: list[SamplingParams],
        on_progress: Callable[[int, int], None] | None = None,
    ) -> list[Completion]:
        """One completion per prompt, in order."""
        ...

    def score(self, prompt: str, continuations: list[str]) -> list[float]:
        """Sum of log-probabilities of each continuation after ``prompt``."""
        ...

    def close(self) -> None:
        """Release the model's memory and files."""
        ...


@dataclass
class _ConfiguredModel:
    """The runtime's ``LoadedModel`` plus what the worker needs: the window, per-step liveness."""

    loaded: Any
    max_positions: int
    name: str

    @property
    def model_id(self) -> str:
        # The user's name for the model (config model.id), then the runtime's id, which pins
        # the exact weights: "yalm-100b:yalm-100b/fp16@3f2a9c1b7d0e".
        return f"{self.name}:{self.loaded.model_id}"

    @property
    def tokenizer(self) -> Tokenizer:
        return self.loaded.tokenizer

    def generate(
        self,
        prompts: list[str],
        params: list[SamplingParams],
        on_progress: Callable[[int, int], None] | None = None,
    ) -> list[Completion]:
        if on_progress is None:
            return self.loaded.generate(prompts, params)
        done = [0]

        def batch_done(finished: int, total: int) -> None:
            done[0] = finished
            on_progress(finished, total)

        # Every forward pass counts as liveness for the watchdog: one batch of the 100B model
        # streamed from disk can outlast batch.stall_timeout, one decode step cannot.
        return self.loaded.generate(
            prompts, params, on_progress=batch_done, on_step=lambda: on_progress(done[0], len(prompts))
        )

    def score(self, prompt: str, continuations: list[str]) -> list[float]:
        return self.loaded.score(prompt, continuations)

    def close(self) -> None:
        self.loaded.close()


def _release_config_file(config: AppConfig) -> Path | None:
    checkpoint = config.model.checkpoint
    if checkpoint is None:
        return None
    for candidate in (checkpoint / "config.json", checkpoint.parent / "config.json"):
        if candidate.is_file():
            return candidate
    return None


def model_shape(config: AppConfig) -> Any:
    """The :class:`~robot_llm.llm.config.YalmConfig` of the configured weights, as the runtime will see it.

    A store carries it in its manifest; a release checkpoint in a ``config.json`` next to
    (or one folder above) the weight files; a release without one (the published
    YaLM-100B) is the ``yalm-100b`` preset.
    """
    from robot_llm.llm.config import YalmConfig

    m = config.model
    if m.store is not None:
        from robot_llm.llm.store import StoreError, read_manifest

        try:
            return read_manifest(m.store).config
        except StoreError as exc:
            raise BatchError(f"model.store: {exc}") from None
    found = _release_config_file(config)
    if found is None:
        return YalmConfig.preset("yalm-100b")
    try:
        return YalmConfig.from_json(found)
    except (ValueError, TypeError) as exc:
        raise BatchError(f"{found}: {exc}") from None


def open_configured_model(config: AppConfig) -> BatchModel:
    """Load the model ``config.model`` describes; the one place that maps the config onto the runtime.

    Raises the runtime's user-facing errors (RobotLLMError) with a one-line reason when the
    weights, the vocabulary or the backend are not usable.
    """
    from robot_llm.llm.runtime import ModelSettings, open_model

    m = config.model
    assert m.vocab is not None  # required by the config validator
    settings = ModelSettings(
        vocab=m.vocab,
        backend=m.backend,
        checkpoint=m.checkpoint,
        store=m.store,
        home=m.home,
        # int8/int4 are how a store keeps its weights, not compute dtypes: the engine picks one.
        dtype="auto" if m.dtype in ("int8", "int4") else m.dtype,
        device=m.device,
        max_batch_size=m.max_batch_size,
        memory_budget_bytes=m.memory_budget,
        offload_dir=m.offload_dir,
        offload=m.offload,
        preset="yalm-100b" if m.store is None and _release_config_file(config) is None else None,
    )
    loaded = open_model(settings)
    return _ConfiguredModel(
        loaded=loaded, max_positions=min(m.max_positions, loaded.config.max_position_embeddings), name=m.id
    )


# --------------------------------------------------------------------------- params and stance


@dataclass(frozen=True)
class StanceSpec:
    """The template's stance question: a cue appended to the thesis and the label continuations."""

    cue: str
    labels: tuple[tuple[str, float], ...]


@dataclass(frozen=True)
class StanceResult:
    """A thesis's numeric stance: ``stance = Σ p(label)·value``, the argmax label and its probability."""

    stance: float
    label: str
    score: float
    label_logprobs: dict[str, float]


def sampling_params(params: dict[str, Any]) -> tuple[SamplingParams, StanceSpec | None]:
    """Parse a request's ``params`` JSON (the batch contract's shape); ValueError names the bad field."""
    from robot_llm.llm.generate import SamplingParams

    try:
        stop = params.get("stop") or []
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise ValueError(f"params.stop: expected a list of strings, got {stop!r}")
        sampling = SamplingParams(
            max_new_tokens=int(params["max_new_tokens"]),
            greedy=bool(params["greedy"]),
            temperature=float(params["temperature"]),
            top_k=int(params["top_k"]),
            top_p=float(params["top_p"]),
            seed=int(params["seed"]),
            stop=tuple(stop),
        )
    except KeyError as exc:
        raise ValueError(f"params: missing {exc.args[0]!r}") from None
    except (TypeError, ValueError) as exc:
        raise ValueError(f"params: {exc}") from None
    raw = params.get("stance")
    if raw is None:
        return sampling, None
    if not isinstance(raw, dict) or not isinstance(raw.get("cue"), str) or not isinstance(raw.get("labels"), dict):
        raise ValueError(f"params.stance: expected {{'cue': str, 'labels': {{label: value}}}}, got {raw!r}")
    labels = tuple((str(k), float(v)) for k, v in raw["labels"].items())
    if len(labels) < 2:
        raise ValueError(f"params.stance.labels: need at least two labels, got {len(labels)}")
    return sampling, StanceSpec(cue=raw["cue"], labels=labels)


def stance_from_logprobs(labels: Sequence[tuple[str, float]], logprobs: Sequence[float]) -> StanceResult:
    """Softmax over the labels' log-probabilities; the stance is the expected label value."""
    top = max(logprobs)
    weights = [math.exp(lp - top) for lp in logprobs]
    total = sum(weights)
    probs = [w / total for w in weights]
    best = max(range(len(labels)), key=lambda i: probs[i])
    return StanceResult(
        stance=sum(p * value for p, (_, value) in zip(probs, labels, strict=True)),
        label=labels[best][0].strip(),  # the word; the scored continuation keeps its space in label_logprobs
        score=probs[best],
        label_logprobs={name: lp for (name, _), lp in zip(labels, logprobs, strict=True)},
    )


def _score_stance(model: BatchModel, prompt: str, thesis: str, spec: StanceSpec) -> StanceResult:
    labels = [name for name, _ in spec.labels]
    context = prompt + thesis + spec.cue
    longest = max(len(model.tokenizer.encode_pieces_ids(label)) for label in labels)
    if len(model.tokenizer.encode(context)) + longest > model.max_positions:
        # A thesis that filled the window leaves no room for the cue: judge the thesis alone.
        context = thesis + spec.cue
    return stance_from_logprobs(spec.labels, model.score(context, labels))


# --------------------------------------------------------------------------- summary


@dataclass(frozen=True)
class RunSummary:
    """What one ``run_queue`` call did."""

    run_id: int | None
    worker_id: str
    status: str  # ok | failed | aborted
    done: int = 0
    failed: int = 0
    retried: int = 0
    duplicates: int = 0
    batches: int = 0
    new_tokens: int = 0
    seconds: float = 0.0
    stopped: bool = False
    blocked_by: str | None = None
    failures: tuple[tuple[int, str], ...] = ()

    @property
    def tokens_per_s(self) -> float:
        """Generated tokens per second of batch time."""
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0


@dataclass
class _Tally:
    done: int = 0
    failed: int = 0
    retried: int = 0
    duplicates: int = 0
    batches: int = 0
    new_tokens: int = 0
    seconds: float = 0.0
    failures: list[tuple[int, str]] = field(default_factory=list)

    def counts(self, worker_id: str) -> dict[str, Any]:
        return {
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


# --------------------------------------------------------------------------- the queue


@dataclass(frozen=True)
class _Claimed:
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


class _Queue:
    """The claim / store / fail transactions of one worker."""

    def __init__(self, config: AppConfig, engine: Engine, worker_id: str, as_of: datetime | None) -> None:
        self.config = config
        self.engine = engine
        self.worker_id = worker_id
        self.as_of = as_of
        self.sqlite = engine.dialect.name == "sqlite"
        self.run_id: int | None = None

    def remaining(self) -> int:
        with self.engine.connect() as conn:
            return int(
                conn.execute(
                    select(func.count()).select_from(GenerationRequest).where(_claimable(utcnow(), self.as_of))
                ).scalar_one()
            )

    def start_run(self, total: int) -> int:
        now = utcnow()
        with self.engine.begin() as conn:
            # Generate runs whose worker vanished (SIGKILL, power loss) never recorded an end.
            conn.execute(
                update(Run)
                .where(
                    Run.kind == "generate",
                    Run.status == "running",
                    Run.heartbeat_at < now - alive_window(self.config),
                )
                .values(
                    status="aborted",
                    finished_at=now,
                    error="the worker vanished (its heartbeat stopped: killed or crashed)",
                )
            )
            run_id = conn.execute(
                Run.__table__.insert()
                .values(
                    kind="generate",
                    status="running",
                    as_of=self.as_of,
                    started_at=now,
                    heartbeat_at=now,
                    done=0,
                    total=total,
                    counts={"worker_id": self.worker_id},
                    host=socket.gethostname(),
                    pid=os.getpid(),
                )
                .returning(Run.id)
            ).scalar_one()
        self.run_id = int(run_id)
        return self.run_id

    def _other_live_worker(self, conn: Connection, now: datetime) -> str | None:
        row = conn.execute(
            select(Run.id, Run.host, Run.pid)
            .where(
                Run.kind == "generate",
                Run.status == "running",
                Run.id != self.run_id,
                Run.heartbeat_at > now - alive_window(self.config),
            )
            .limit(1)
        ).first()
        return None if row is None else f"run #{row.id} (host {row.host}, pid {row.pid})"

    def claim(self, limit: int) -> tuple[list[_Claimed], str | None]:
        """Claim up to ``limit`` requests; returns them, or ([], who) when another SQLite worker is active."""
        lease = self.config.batch.lease
        max_attempts = self.config.batch.max_attempts
        with self.engine.connect() as conn:
            _begin_write(conn)
            now = utcnow()
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
                conn.execute(
                    update(GenerationRequest)
                    .where(GenerationRequest.id.in_(ids))
                    .values(
                        status="running",
                        lease_owner=self.worker_id,
                        lease_expires_at=now + lease,
                        attempts=GenerationRequest.attempts + 1,
                        updated_at=now,
                    )
                )
            conn.commit()
        claimed = [
            _Claimed(
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

    def _progress_values(self, tally: _Tally, total: int) -> dict[str, Any]:
        return {
            "done": tally.done,
            "total": total,
            "tokens_per_s": tally.tokens_per_s,
            "counts": tally.counts(self.worker_id),
            "heartbeat_at": utcnow(),
        }

    def store(self, rows: list[dict[str, Any]], tally: _Tally, total: int) -> int:
        """Insert the batch's theses and mark their requests done in one transaction; returns rows inserted.

        A thesis another worker already stored for the same request is skipped (``ON
        CONFLICT DO NOTHING`` on the unique ``request_id``) and counted as a duplicate.
        """
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
            # available_at is the commit time (a backtest may see the thesis only from then
            # on): taken just before the insert, the last statement before the commit.
            available_at = utcnow()
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

    def progress(self, tally: _Tally, total: int) -> None:
        """Write the run's progress (done/total, tokens/s, counts, heartbeat)."""
        with self.engine.begin() as conn:
            conn.execute(
                update(Run)
                .where(Run.id == self.run_id, Run.status == "running")
                .values(**self._progress_values(tally, total))
            )

    def fail(self, errors: dict[int, str], attempts: dict[int, int], tally: _Tally, total: int) -> None:
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
            conn.execute(
                update(Run)
                .where(Run.id == self.run_id, Run.status == "running")
                .values(**self._progress_values(tally, total))
            )
            conn.commit()

    def finish(self, status: str, tally: _Tally, total: int, error: str | None) -> None:
        with self.engine.begin() as conn:
            conn.execute(
                update(Run)
                .where(Run.id == self.run_id, Run.status == "running")
                .values(status=status, finished_at=utcnow(), error=error, **self._progress_values(tally, total))
            )


# --------------------------------------------------------------------------- watchdog


class _Watchdog(threading.Thread):
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

    def __init__(self, config: AppConfig, url: str, queue: _Queue, tick_s: float) -> None:
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
            conn.execute(
                update(Run).where(Run.id == self.queue.run_id, Run.status == "running").values(heartbeat_at=now)
            )
            conn.commit()
            conn.execute(
                update(GenerationRequest)
                .where(GenerationRequest.lease_owner == self.queue.worker_id, GenerationRequest.status == "running")
                .values(lease_expires_at=now + self.config.batch.lease)
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
                conn.execute(
                    update(Run)
                    .where(Run.id == self.queue.run_id, Run.status == "running")
                    .values(status="aborted", finished_at=utcnow(), heartbeat_at=utcnow(), error=reason)
                )
                conn.commit()
        except SQLAlchemyError as exc:
            recorded = f"NOT recorded in the runs table ({_one_line(exc)})"
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
                log.warning("watchdog: heartbeat not written: %s", _one_line(exc))


# --------------------------------------------------------------------------- progress display


class _Progress:
    """A tqdm bar with ETA on a terminal, log lines with counts and tokens/s otherwise."""

    def __init__(self, enabled: bool | None, total: int) -> None:
        self.bar = None
        if enabled is None:
            enabled = sys.stderr.isatty()
        if enabled:
            from tqdm import tqdm

            self.bar = tqdm(total=total, unit="thesis", desc="generate", file=sys.stderr, dynamic_ncols=True)

    def update(self, tally: _Tally, total: int, step: int) -> None:
        tps = tally.tokens_per_s or 0.0
        if self.bar is not None:
            self.bar.total = total
            self.bar.set_postfix(failed=tally.failed, tok_s=f"{tps:.1f}", refresh=False)
            self.bar.update(step)
        else:
            log.info(
                "generate: %d/%d done, %d failed, %d retried, %d tokens, %.1f tokens/s",
                tally.handled,
                total,
                tally.failed,
                tally.retried,
                tally.new_tokens,
                tps,
            )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


# --------------------------------------------------------------------------- the worker


def _one_line(exc: BaseException) -> str:
    orig = getattr(exc, "orig", None)
    text = str(orig if orig is not None else exc).strip()
    return (text.splitlines() or [type(exc).__name__])[0]


def _run_batch(
    model: BatchModel, batch: list[_Claimed], on_progress: Callable[[], None]
) -> tuple[list[dict[str, Any]], dict[int, str], int]:
    """Generate and score ``batch``; returns (thesis rows, errors by request id, new tokens).

    A request that cannot run (bad params, a prompt longer than the window) gets an error
    of its own; a batch the model fails on is re-run one request at a time, so one bad
    request does not spend its batch-mates' attempts.
    """
    errors: dict[int, str] = {}
    ready: list[tuple[_Claimed, SamplingParams, StanceSpec | None]] = []
    for req in batch:
        try:
            params, spec = sampling_params(req.params)
            tokens = len(model.tokenizer.encode(req.prompt))
            if tokens > model.max_positions:
                raise ValueError(f"the prompt has {tokens} tokens, the model's window is {model.max_positions}")
            ready.append((req, params, spec))
        except ValueError as exc:
            errors[req.id] = str(exc)
    groups = [ready] if ready else []
    rows: list[dict[str, Any]] = []
    new_tokens = 0
    while groups:
        group = groups.pop(0)
        started = time.monotonic()
        try:
            completions = model.generate(
                [req.prompt for req, _, _ in group],
                [params for _, params, _ in group],
                on_progress=lambda _done, _total: on_progress(),
            )
            on_progress()
            stances: list[StanceResult | None] = []
            for (req, _, spec), c in zip(group, completions, strict=True):
                stances.append(_score_stance(model, req.prompt, c.text, spec) if spec is not None else None)
                on_progress()
        except Exception as exc:  # the model's failure is this batch's, not the run's
            if len(group) > 1:
                log.warning("batch of %d failed (%s); running its requests one by one", len(group), _one_line(exc))
                groups.extend([item] for item in group)
            else:
                errors[group[0][0].id] = f"{type(exc).__name__}: {exc}"
            continue
        seconds = time.monotonic() - started
        for (req, params, _), c, st in zip(group, completions, stances, strict=True):
            new_tokens += c.new_token_count
            rows.append(
                {
                    "request_id": req.id,
                    "ticker": req.ticker,
                    "template_name": req.template_name,
                    "template_version": req.template_version,
                    "text": c.text,
                    "stance": st.stance if st else None,
                    "stance_label": st.label if st else None,
                    "score": st.score if st else None,
                    "label_logprobs": st.label_logprobs if st else {},
                    "model_id": model.model_id,
                    "params": req.params,
                    "seed": params.seed,
                    "prompt_sha256": req.prompt_sha256,
                    "prompt_tokens": c.prompt_token_count,
                    "completion_tokens": c.new_token_count,
                    "finish_reason": c.finish_reason,
                    # Rows of a batch are computed together: each carries its batch's time.
                    "generation_seconds": seconds,
                    "news_ids": req.news_ids,
                    "signal_ids": req.signal_ids,
                    "as_of": req.as_of,
                    "valid_until": req.valid_until,
                }
            )
    return rows, errors, new_tokens


def _require_aware(value: datetime | None, name: str) -> None:
    if value is not None and (value.tzinfo is None or value.utcoffset() is None):
        raise ValueError(f"{name} must be an aware datetime, got naive {value!r}")


def run_queue(
    config: AppConfig,
    engine: Engine,
    *,
    worker_id: str | None = None,
    as_of: datetime | None = None,
    stop: threading.Event | None = None,
    progress: bool | None = None,
    preflight: bool = True,
    model: BatchModel | None = None,
) -> RunSummary:
    """Work the queue until nothing claimable is left (or ``stop`` is set); returns what was done.

    ``as_of`` limits the worker to one night's requests; ``stop`` ends the run after the
    batch in flight is stored; ``progress`` forces the terminal bar on or off (default:
    on when stderr is a terminal). ``preflight`` runs :func:`robot_llm.preflight.preflight`
    first and refuses to start when a check fails. ``model`` is an already loaded model
    (the daemon keeps one between nights); by default the configured model is loaded and
    closed here. Raises :class:`BatchError` when the database fails mid-run; every thesis
    stored before that stays stored.
    """
    _require_aware(as_of, "as_of")
    if preflight:
        from robot_llm.preflight import require_preflight

        require_preflight(config)
    worker_id = worker_id or f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
    stop = stop or threading.Event()
    queue = _Queue(config, engine, worker_id, as_of)
    tally = _Tally()
    try:
        total = queue.remaining()
    except SQLAlchemyError as exc:
        raise BatchError(f"database error before the run started: {_one_line(exc)}") from None
    if total == 0:
        log.info("generate: nothing to do")
        return RunSummary(run_id=None, worker_id=worker_id, status="ok")
    owned = model is None
    if model is None:
        model = open_configured_model(config)
    try:
        return _work(config, engine, queue, model, tally, total, stop, progress)
    finally:
        if owned:
            model.close()


def _work(
    config: AppConfig,
    engine: Engine,
    queue: _Queue,
    model: BatchModel,
    tally: _Tally,
    total: int,
    stop: threading.Event,
    progress: bool | None,
) -> RunSummary:
    try:
        run_id = queue.start_run(total)
    except SQLAlchemyError as exc:
        raise BatchError(f"cannot record the run: {_one_line(exc)}") from None
    tick = heartbeat_interval(config)
    watchdog = _Watchdog(config, engine.url.render_as_string(hide_password=False), queue, tick)
    watchdog.start()
    bar = _Progress(progress, total)
    blocked_by: str | None = None
    status, error = "ok", None
    drained = False
    try:
        while not stop.is_set():
            watchdog.progress()
            claimed, blocked_by = queue.claim(config.model.max_batch_size)
            if not claimed:
                drained = True
                break
            watchdog.progress([r.id for r in claimed])
            started = time.monotonic()
            rows, errors, new_tokens = _run_batch(model, claimed, watchdog.progress)
            tally.seconds += time.monotonic() - started
            tally.new_tokens += new_tokens
            tally.batches += 1
            before = tally.handled
            total = max(total, tally.handled + queue.remaining() + len(claimed))
            if rows:
                queue.store(rows, tally, total)
            if errors:
                queue.fail(errors, {r.id: r.attempts for r in claimed}, tally, total)
            watchdog.progress([])
            bar.update(tally, total, tally.handled - before)
        if not drained:
            status, error = "aborted", "stopped on request (signal); the rest of the queue waits for the next run"
    except SQLAlchemyError as exc:
        status, error = "failed", f"database error: {_one_line(exc)}"
    except BaseException as exc:
        status, error = "failed", f"{type(exc).__name__}: {exc}"
        raise
    finally:
        bar.close()
        watchdog.halt()
        if status == "failed":
            _record_failure(queue, tally, total, error or "")
        else:
            try:
                queue.finish(status, tally, total, error)
            except SQLAlchemyError as exc:
                raise BatchError(
                    f"{tally.done} thesis(es) are stored, but the end of run #{run_id} could not be recorded: "
                    f"{_one_line(exc)}"
                ) from None
    if status == "failed":
        raise BatchError(
            f"{error}; {tally.done} thesis(es) stored by this run are intact; "
            f"run `robot-llm batch run -c {config.source or 'FILE'}` again to resume"
        )
    if blocked_by is not None:
        log.warning("generate: another worker is active on this SQLite database: %s", blocked_by)
    return RunSummary(
        run_id=run_id,
        worker_id=queue.worker_id,
        status=status,
        done=tally.done,
        failed=tally.failed,
        retried=tally.retried,
        duplicates=tally.duplicates,
        batches=tally.batches,
        new_tokens=tally.new_tokens,
        seconds=tally.seconds,
        stopped=not drained,
        blocked_by=blocked_by,
        failures=tuple(tally.failures),
    )


def _record_failure(queue: _Queue, tally: _Tally, total: int, error: str) -> None:
    try:
        queue.finish("failed", tally, total, error)
    except SQLAlchemyError as exc:
        log.error("the failure could not be recorded in the runs table either: %s", _one_line(exc))


def summary_line(summary: RunSummary) -> str:
    """One human line about a run."""
    if summary.run_id is None:
        return "generate: nothing to do (no pending requests)"
    parts = [
        f"generate run #{summary.run_id} {summary.status}: {summary.done} thesis(es) stored",
        f"{summary.failed} failed",
        f"{summary.retried} retried",
        f"{summary.new_tokens} tokens in {summary.seconds:.1f}s ({summary.tokens_per_s:.1f} tokens/s)",
    ]
    if summary.duplicates:
        parts.append(f"{summary.duplicates} already stored by another worker")
    if summary.stopped:
        parts.append("stopped on request")
    if summary.blocked_by:
        parts.append(f"another worker holds the SQLite queue: {summary.blocked_by}")
    return ", ".join(parts)
