"""Redo a night: queue its requests again as new rows, so new theses are made and the old ones stay in the history.

A finished night cannot be run again (its requests are ``done`` or ``failed``); after a damaged
model or a bad template was fixed, :func:`queue_redo` copies each chosen request of the night —
the same prompt, rendered from the data known at its cut-off, the same parameters and seed —
into a new pending row with ``redo`` one higher. The worker then generates it like any other:
its thesis is a new row whose ``available_at`` is the moment it is committed, so a backtest sees
the earlier thesis until then and the redone one from then on (``Forecasts.latest`` takes the
newest commit of the newest night); nothing stored is changed or deleted.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import func, select
from sqlalchemy.engine import Engine

from robot_llm.clock import aware_utc
from robot_llm.errors import RobotLLMError
from robot_llm.store.db import GenerationRequest, session_scope, utcnow

__all__ = ["RedoError", "RedoResult", "queue_redo"]


class RedoError(RobotLLMError):
    """The night (or an instrument of it) cannot be redone; the message says why."""


@dataclass(frozen=True)
class RedoResult:
    """What :func:`queue_redo` queued: (ticker, template, redo number) per new request."""

    as_of: datetime
    queued: tuple[tuple[str, str, int], ...]


def queue_redo(engine: Engine, as_of: datetime, tickers: Sequence[str] | None = None) -> RedoResult:
    """Queue the night ``as_of`` again (only ``tickers`` when given) as new pending requests.

    Each (instrument, template) of the night gets one new row copied from its latest request.
    Refused, with nothing queued, when the night has no requests, a ticker is not in it, a
    request is still pending or running (run ``batch run`` instead), or the night's theses
    have gone stale (a redo would never be read).
    """
    as_of = aware_utc(as_of, "as_of")
    now = utcnow()
    with session_scope(engine) as session:
        latest = (
            select(
                GenerationRequest.ticker,
                GenerationRequest.template_name,
                func.max(GenerationRequest.redo).label("redo"),
            )
            .where(GenerationRequest.as_of == as_of)
            .group_by(GenerationRequest.ticker, GenerationRequest.template_name)
            .subquery()
        )
        rows = list(
            session.scalars(
                select(GenerationRequest)
                .join(
                    latest,
                    (GenerationRequest.ticker == latest.c.ticker)
                    & (GenerationRequest.template_name == latest.c.template_name)
                    & (GenerationRequest.redo == latest.c.redo),
                )
                .where(GenerationRequest.as_of == as_of)
                .order_by(GenerationRequest.ticker, GenerationRequest.template_name)
            )
        )
        if not rows:
            raise RedoError(f"the night {as_of.isoformat()} has no requests: plan it first (`robot-llm batch plan`)")
        if tickers:
            unknown = sorted(set(tickers) - {r.ticker for r in rows})
            if unknown:
                raise RedoError(f"the night {as_of.isoformat()} has no requests for {', '.join(unknown)}")
            rows = [r for r in rows if r.ticker in set(tickers)]
        waiting = [f"{r.ticker} {r.template_name} ({r.status})" for r in rows if r.status in ("pending", "running")]
        if waiting:
            raise RedoError(
                f"not redone: {', '.join(waiting)} still wait(s) to be generated; `robot-llm batch run` finishes them"
            )
        stale = [r for r in rows if r.valid_until <= now]
        if stale:
            raise RedoError(
                f"not redone: the night's theses went stale at {stale[0].valid_until.isoformat()} "
                "(prompts.valid_for); a redone thesis would never be read"
            )
        queued = []
        for r in rows:
            session.add(
                GenerationRequest(
                    as_of=r.as_of,
                    ticker=r.ticker,
                    template_name=r.template_name,
                    template_version=r.template_version,
                    prompt=r.prompt,
                    prompt_sha256=r.prompt_sha256,
                    prompt_tokens=r.prompt_tokens,
                    news_ids=list(r.news_ids),
                    signal_ids=list(r.signal_ids),
                    params=dict(r.params),
                    valid_until=r.valid_until,
                    status="pending",
                    attempts=0,
                    created_at=now,
                    updated_at=now,
                    redo=r.redo + 1,
                )
            )
            queued.append((r.ticker, r.template_name, r.redo + 1))
    return RedoResult(as_of=as_of, queued=tuple(queued))
