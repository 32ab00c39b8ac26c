"""``robot-llm report``: what ran on a local day, how many theses, what failed and why, how fast.

The day is a calendar day in the config's ``timezone``; a run belongs to the day it
started on. Reading is all this module does, except :func:`report_job`, which also
records the report itself as a ``report`` run (the morning job).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field
from datetime import date, datetime, time, timedelta
from typing import TYPE_CHECKING, Any

from sqlalchemy import and_, func, or_, select

from robot_llm.report.health import Health, night_health
from robot_llm.report.track_record import summary_lines
from robot_llm.store.db import GenerationRequest, Run, Thesis, session_scope, utcnow
from robot_llm.store.runs import record_finished

if TYPE_CHECKING:
    from sqlalchemy.engine import Engine

    from robot_llm.config import AppConfig

__all__ = [
    "FailureLine",
    "LeaseLine",
    "NightStatus",
    "Report",
    "RunLine",
    "build_report",
    "default_day",
    "format_duration",
    "format_report",
    "format_status",
    "queue_status",
    "report_job",
    "window",
]


@dataclass(frozen=True)
class RunLine:
    """One run of the day."""

    id: int
    kind: str
    status: str
    started_at: datetime
    finished_at: datetime | None
    seconds: float | None
    done: int
    total: int
    tokens_per_s: float | None
    host: str | None
    pid: int | None
    error: str | None
    counts: dict[str, Any]


@dataclass(frozen=True)
class FailureLine:
    """A request that failed for good on that day."""

    request_id: int
    ticker: str
    template_name: str
    as_of: datetime
    attempts: int
    error: str | None


@dataclass(frozen=True)
class Report:
    """The day's summary."""

    day: date
    timezone: str
    runs: tuple[RunLine, ...]
    theses: int
    theses_by_template: dict[str, int]
    failures: tuple[FailureLine, ...]
    queue: dict[str, int]
    new_tokens: int
    batch_seconds: float
    #: The health of the nights the day worked on (first line of the report).
    health: Health = field(default_factory=Health)
    # The track record as the morning after this night knew it (robot_llm.report.track_record).
    track_record: tuple[str, ...] = ()

    def stance_flags(self) -> dict[str, int]:
        """Theses the day's generate runs flagged, by flag (their counts' ``flags``; see robot_llm.thesis.rows)."""
        total: dict[str, int] = {}
        for r in self.runs:
            if r.kind == "generate":
                for flag, n in (r.counts.get("flags") or {}).items():
                    total[flag] = total.get(flag, 0) + int(n)
        return total

    @property
    def tokens_per_s(self) -> float | None:
        """Generated tokens per second of batch time over the day's generate runs."""
        return self.new_tokens / self.batch_seconds if self.batch_seconds > 0 else None

    def to_json(self) -> dict[str, Any]:
        """Plain data for ``--json`` (times as ISO 8601 UTC)."""

        def conv(value: Any) -> Any:
            if isinstance(value, datetime | date):
                return value.isoformat()
            if isinstance(value, dict):
                return {k: conv(v) for k, v in value.items()}
            if isinstance(value, list | tuple):
                return [conv(v) for v in value]
            return value

        data = conv(asdict(self))
        data["tokens_per_s"] = self.tokens_per_s
        return data


def window(config: AppConfig, day: date) -> tuple[datetime, datetime]:
    start = datetime.combine(day, time(0), tzinfo=config.tz)
    end = datetime.combine(day + timedelta(days=1), time(0), tzinfo=config.tz)
    return start, end


def default_day(config: AppConfig, engine: Engine) -> date:
    """The local day of the latest plan or generate run (last night), or today when none ran."""
    with engine.connect() as conn:
        latest = conn.execute(select(func.max(Run.started_at)).where(Run.kind.in_(("plan", "generate")))).scalar()
    if latest is None:
        return utcnow().astimezone(config.tz).date()
    return latest.astimezone(config.tz).date()


def build_report(config: AppConfig, engine: Engine, day: date, *, track_record: bool = False) -> Report:
    """Collect the report of local ``day``; ``track_record`` adds the ledger's summary (it reads every thesis)."""
    start, end = window(config, day)
    with session_scope(engine) as s:
        runs = s.scalars(select(Run).where(Run.started_at >= start, Run.started_at < end).order_by(Run.started_at))
        lines = tuple(
            RunLine(
                id=r.id,
                kind=r.kind,
                status=r.status,
                started_at=r.started_at,
                finished_at=r.finished_at,
                seconds=(r.finished_at - r.started_at).total_seconds() if r.finished_at else None,
                done=r.done,
                total=r.total,
                tokens_per_s=r.tokens_per_s,
                host=r.host,
                pid=r.pid,
                error=r.error,
                counts=dict(r.counts or {}),
            )
            for r in runs
        )
        by_template = Counter(
            dict(
                s.execute(
                    select(Thesis.template_name, func.count())
                    .where(Thesis.available_at >= start, Thesis.available_at < end)
                    .group_by(Thesis.template_name)
                ).all()
            )
        )
        failed = s.scalars(
            select(GenerationRequest)
            .where(
                GenerationRequest.status == "failed",
                GenerationRequest.updated_at >= start,
                GenerationRequest.updated_at < end,
            )
            .order_by(GenerationRequest.id)
        )
        failures = tuple(
            FailureLine(
                request_id=r.id,
                ticker=r.ticker,
                template_name=r.template_name,
                as_of=r.as_of,
                attempts=r.attempts,
                error=r.last_error,
            )
            for r in failed
        )
        queue = dict(
            s.execute(
                select(GenerationRequest.status, func.count())
                .where(GenerationRequest.created_at >= start, GenerationRequest.created_at < end)
                .group_by(GenerationRequest.status)
            ).all()
        )
        worked = list(
            s.scalars(
                select(GenerationRequest.as_of)
                .distinct()
                .where(
                    or_(
                        and_(GenerationRequest.created_at >= start, GenerationRequest.created_at < end),
                        and_(GenerationRequest.updated_at >= start, GenerationRequest.updated_at < end),
                    )
                )
            )
        )
    generate = [r for r in lines if r.kind == "generate"]
    return Report(
        day=day,
        timezone=config.timezone,
        runs=lines,
        theses=sum(by_template.values()),
        theses_by_template=dict(sorted(by_template.items())),
        failures=failures,
        queue={k: int(v) for k, v in sorted(queue.items())},
        new_tokens=sum(int(r.counts.get("new_tokens", 0)) for r in generate),
        batch_seconds=sum(float(r.counts.get("batch_seconds", 0.0)) for r in generate),
        health=night_health(engine, worked),
        track_record=summary_lines(config, engine, day) if track_record else (),
    )


def format_duration(seconds: float | None) -> str:
    """Seconds as '3m07s' or '1h02m03s'; None as 'unfinished'."""
    if seconds is None:
        return "unfinished"
    minutes, sec = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m{sec:02d}s" if hours else f"{minutes}m{sec:02d}s"


def format_report(report: Report, config: AppConfig) -> str:
    """The report as text for a terminal or an e-mail."""
    tz = config.tz
    nights = f"{report.health.nights} night(s)" if report.health.nights else "no night"
    out = [
        f"robot-llm report for {report.day.isoformat()} ({report.timezone}), {nights}: {report.health.line()}",
        "",
    ]
    if not report.runs:
        out.append("no runs started that day")
    else:
        out.append("runs:")
        for r in report.runs:
            when = r.started_at.astimezone(tz).strftime("%H:%M:%S")
            line = f"  #{r.id} {r.kind:<15} {r.status:<8} {when} {format_duration(r.seconds):>10}"
            if r.total:
                line += f"  {r.done}/{r.total}"
            if r.tokens_per_s:
                line += f"  {r.tokens_per_s:.1f} tokens/s"
            if r.host:
                line += f"  [{r.host}:{r.pid}]"
            out.append(line)
            if r.error:
                out.append(f"      {r.error}")
    out.append("")
    by = ", ".join(f"{k}: {v}" for k, v in report.theses_by_template.items())
    out.append(f"theses stored: {report.theses}" + (f" ({by})" if by else ""))
    if report.queue:
        out.append("requests planned that day: " + ", ".join(f"{k} {v}" for k, v in report.queue.items()))
    if report.tokens_per_s is not None:
        out.append(
            f"generation: {report.new_tokens} tokens in {format_duration(report.batch_seconds)} "
            f"({report.tokens_per_s:.1f} tokens/s)"
        )
    flags = report.stance_flags()
    if flags:  # robot_llm.thesis.rows: rows whose text contradicts their stance or degenerated
        out.append("theses flagged: " + ", ".join(f"{k} {v}" for k, v in sorted(flags.items())))
    if report.failures:
        out.append(f"failed requests: {len(report.failures)}")
        for f in report.failures:
            out.append(f"  #{f.request_id} {f.ticker} {f.template_name} after {f.attempts} attempt(s): {f.error}")
    else:
        out.append("failed requests: none")
    if report.track_record:
        out.extend(["", *report.track_record])
    return "\n".join(out)


def report_job(config: AppConfig, engine: Engine, day: date | None = None) -> Report:
    """Build the report of ``day`` (default: :func:`default_day`) and record it as a ``report`` run."""
    day = day or default_day(config, engine)
    now = utcnow()
    report = build_report(config, engine, day, track_record=True)
    counts = {"day": day.isoformat(), "runs": len(report.runs), "theses": report.theses, "failed": len(report.failures)}
    record_finished(engine, "report", now, counts=counts, done=1, total=1)
    return report


# --------------------------------------------------------------------------- queue status


@dataclass(frozen=True)
class LeaseLine:
    """Requests one worker holds, and when its lease runs out."""

    owner: str
    requests: int
    expires_at: datetime | None


@dataclass(frozen=True)
class NightStatus:
    """The queue of one night (one ``as_of``)."""

    as_of: datetime
    counts: dict[str, int]
    leases: tuple[LeaseLine, ...]


def queue_status(engine: Engine, *, nights: int = 7) -> tuple[tuple[NightStatus, ...], tuple[RunLine, ...]]:
    """The ``nights`` most recent nights' request counts by status and their leases, and the live generate runs."""
    with session_scope(engine) as s:
        recent = list(
            s.scalars(
                select(GenerationRequest.as_of)
                .group_by(GenerationRequest.as_of)
                .order_by(GenerationRequest.as_of.desc())
                .limit(nights)
            )
        )
        out = []
        for as_of in recent:
            counts = dict(
                s.execute(
                    select(GenerationRequest.status, func.count())
                    .where(GenerationRequest.as_of == as_of)
                    .group_by(GenerationRequest.status)
                ).all()
            )
            leases = s.execute(
                select(GenerationRequest.lease_owner, func.count(), func.max(GenerationRequest.lease_expires_at))
                .where(GenerationRequest.as_of == as_of, GenerationRequest.status == "running")
                .group_by(GenerationRequest.lease_owner)
            ).all()
            out.append(
                NightStatus(
                    as_of=as_of,
                    counts={k: int(v) for k, v in counts.items()},
                    leases=tuple(LeaseLine(owner or "?", int(n), exp) for owner, n, exp in leases),
                )
            )
        live = s.scalars(select(Run).where(Run.kind == "generate", Run.status == "running").order_by(Run.started_at))
        runs = tuple(
            RunLine(
                id=r.id,
                kind=r.kind,
                status=r.status,
                started_at=r.started_at,
                finished_at=r.finished_at,
                seconds=None,
                done=r.done,
                total=r.total,
                tokens_per_s=r.tokens_per_s,
                host=r.host,
                pid=r.pid,
                error=r.error,
                counts={**dict(r.counts or {}), "heartbeat_at": r.heartbeat_at.isoformat() if r.heartbeat_at else None},
            )
            for r in live
        )
    return tuple(out), runs


def format_status(status: tuple[tuple[NightStatus, ...], tuple[RunLine, ...]], config: AppConfig) -> str:
    """The queue status as text."""
    nights, runs = status
    if not nights:
        return "no generation requests yet (run `robot-llm batch plan`)"
    tz = config.tz
    now = utcnow()
    out = []
    for night in nights:
        counts = ", ".join(f"{k} {night.counts.get(k, 0)}" for k in ("pending", "running", "done", "failed"))
        out.append(f"night {night.as_of.astimezone(tz).strftime('%Y-%m-%d %H:%M %Z')}: {counts}")
        for lease in night.leases:
            if lease.expires_at is None:
                state = "no lease"
            elif lease.expires_at < now:
                state = f"lease EXPIRED {int((now - lease.expires_at).total_seconds())}s ago (claimable again)"
            else:
                state = f"lease until {lease.expires_at.astimezone(tz).strftime('%H:%M:%S')}"
            out.append(f"  {lease.owner}: {lease.requests} running, {state}")
    for r in runs:
        tps = f", {r.tokens_per_s:.1f} tokens/s" if r.tokens_per_s else ""
        out.append(
            f"generate run #{r.id} on {r.host}:{r.pid}: {r.done}/{r.total}{tps}, heartbeat {r.counts['heartbeat_at']}"
        )
    return "\n".join(out)
