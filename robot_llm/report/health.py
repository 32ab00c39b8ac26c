"""The queue's and the theses' health in one line: what ``report``, the HTML page and ``doctor`` put first.

Counted over a set of nights (by their cut-off):

* **stuck** — requests ``running`` past their lease, or held by a worker of this host whose
  process is gone (a rerun takes those over at once);
* **pending**, **failed** — requests waiting, and failed for good;
* **empty**, **non-finite** — stored theses with no text, or with a NaN/inf stance or label
  log-probability (the store boundary refuses both now; older rows may hold them);
* **abstained** — stored theses without a stance (their template asked none);
* **degenerate** — stored theses that say nothing (:func:`robot_llm.thesis.validity.is_degenerate`).

A redone request counts once: only the latest row of each (night, instrument, template) does.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import select
from sqlalchemy.engine import Engine

from robot_llm.store.db import GenerationRequest, Run, Thesis, session_scope, utcnow
from robot_llm.store.runs import process_gone
from robot_llm.thesis.validity import is_degenerate

__all__ = ["Health", "latest_nights", "night_health"]


@dataclass(frozen=True)
class Health:
    """Counts of one or more nights (see the module's docstring)."""

    nights: int = 0
    requests: int = 0
    done: int = 0
    pending: int = 0
    stuck: int = 0
    failed: int = 0
    empty: int = 0
    nonfinite: int = 0
    abstained: int = 0
    degenerate: int = 0

    @property
    def troubled(self) -> bool:
        """Something the nights lack: stuck or failed requests, or empty or non-finite theses."""
        return bool(self.stuck or self.failed or self.empty or self.nonfinite)

    def line(self) -> str:
        """E.g. ``8 stuck, 0 failed, 8 empty, 0 non-finite, 0 abstained, 0 degenerate (of 8 request(s): ...)``."""
        return (
            f"{self.stuck} stuck, {self.failed} failed, {self.empty} empty, {self.nonfinite} non-finite, "
            f"{self.abstained} abstained, {self.degenerate} degenerate "
            f"(of {self.requests} request(s): {self.done} done, {self.pending} pending)"
        )


def latest_nights(engine: Engine, n: int = 1) -> list[datetime]:
    """The cut-offs of the ``n`` latest planned nights, newest first."""
    with engine.connect() as conn:
        return list(
            conn.execute(
                select(GenerationRequest.as_of).distinct().order_by(GenerationRequest.as_of.desc()).limit(n)
            ).scalars()
        )


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def night_health(engine: Engine, nights: Sequence[datetime]) -> Health:
    """The :class:`Health` of the nights with these cut-offs."""
    if not nights:
        return Health()
    now = utcnow()
    with session_scope(engine) as s:
        requests = list(s.scalars(select(GenerationRequest).where(GenerationRequest.as_of.in_(list(nights)))))
        newest: dict[tuple[Any, str, str], GenerationRequest] = {}
        for r in requests:
            key = (r.as_of, r.ticker, r.template_name)
            if key not in newest or r.redo > newest[key].redo:
                newest[key] = r
        current = list(newest.values())
        owners = {r.lease_owner for r in current if r.status == "running" and r.lease_owner}
        dead_owners: set[str] = set()
        if owners:
            for run in s.execute(
                select(Run.host, Run.pid, Run.counts).where(Run.kind == "generate", Run.started_at >= min(nights))
            ):
                owner = (run.counts or {}).get("worker_id")
                if owner in owners and process_gone(run.host, run.pid):
                    dead_owners.add(owner)
        theses = s.execute(
            select(Thesis.text, Thesis.stance, Thesis.score, Thesis.label_logprobs).where(
                Thesis.request_id.in_([r.id for r in current if r.status == "done"])
            )
        ).all()
    counts: dict[str, int] = {}
    for r in current:
        counts[r.status] = counts.get(r.status, 0) + 1
    stuck = sum(
        1
        for r in current
        if r.status == "running"
        and ((r.lease_expires_at is not None and r.lease_expires_at < now) or r.lease_owner in dead_owners)
    )
    empty = sum(1 for t in theses if not (t.text or "").strip())
    nonfinite = sum(
        1
        for t in theses
        if (t.stance is not None and not _finite(t.stance))
        or any(not _finite(v) for v in (t.label_logprobs or {}).values())
    )
    return Health(
        nights=len(nights),
        requests=len(current),
        done=counts.get("done", 0),
        pending=counts.get("pending", 0),
        stuck=stuck,
        failed=counts.get("failed", 0),
        empty=empty,
        nonfinite=nonfinite,
        abstained=sum(1 for t in theses if t.stance is None and (t.text or "").strip()),
        degenerate=sum(1 for t in theses if (t.text or "").strip() and is_degenerate(t.text)),
    )
