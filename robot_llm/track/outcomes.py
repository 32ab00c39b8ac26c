"""Each thesis's outcome, point-in-time: the theses and closes known at a moment, entry, exit, return.

Definitions (entry, exit, return, point-in-time) are in :mod:`robot_llm.track.ledger`. Reads
only; no numpy, no torch.
"""

from __future__ import annotations

import bisect
import functools
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from sqlalchemy import select

from robot_llm.store.db import Price, Thesis

if TYPE_CHECKING:
    from sqlalchemy.engine import Engine

__all__ = [
    "STANCE_LABELS",
    "Closes",
    "Outcome",
    "ThesisPoint",
    "compute_outcomes",
    "load_closes",
    "load_theses",
    "span_text",
    "stance_labels",
    "up_probability",
]


def span_text(value: timedelta) -> str:
    """A horizon or window the way the config writes it ('1d', '90d')."""
    # Lazily: the config layer (pydantic, yaml) stays off the read API's import path.
    from robot_llm.config import format_duration

    return format_duration(value)


@dataclass(frozen=True, slots=True)
class ThesisPoint:
    """What the ledger needs of one thesis."""

    id: int
    ticker: str
    model: str
    template: str
    night: datetime
    available_at: datetime
    stance: float | None
    up_probability: float | None


def up_probability(
    stance: float | None, label: str | None, score: float | None, labels: Mapping[str, float] | None
) -> float | None:
    """The probability the template's stance gave to its "up" label, recovered exactly from the stored row.

    A template gives one when its stance labels have one label of the highest value, that
    value above zero, and two or three labels of distinct values: then the stance (the
    expected label value), the top label's probability (``score``) and the probabilities'
    sum of one determine every label's probability. Otherwise (no stance, other label
    sets) it is None.
    """
    if stance is None or label is None or score is None or not labels:
        return None
    spec = _label_spec(tuple((str(k).strip(), float(v)) for k, v in labels.items()))
    if spec is None:
        return None
    items, up_name = spec
    if len(items) == 2:
        (_, hi), (_, lo) = sorted(items, key=lambda kv: -kv[1])
        p = (stance - lo) / (hi - lo)
    else:
        top = [kv for kv in items if kv[0] == label.strip()]
        if len(top) != 1:
            return None
        if top[0][0] == up_name:
            p = score
        else:
            # The two labels other than the top one share 1 - score and make up stance - score*v_top.
            (name_a, va), (_, vc) = [kv for kv in items if kv[0] != top[0][0]]
            rest, mass = stance - score * top[0][1], 1.0 - score
            pa = (rest - mass * vc) / (va - vc)
            p = pa if name_a == up_name else mass - pa
    return min(1.0, max(0.0, p))


@functools.lru_cache(maxsize=64)
def _label_spec(items: tuple[tuple[str, float], ...]) -> tuple[tuple[tuple[str, float], ...], str] | None:
    """(labels, the up label's name) when these labels determine an up-probability, else None."""
    values = [v for _, v in items]
    if len(items) not in (2, 3) or len(set(values)) != len(values) or max(values) <= 0:
        return None
    return items, max(items, key=lambda kv: kv[1])[0]


# The stance labels and their values, read out of a thesis's params JSON by the database as
# text (the params also hold the calibration context and more, which need not be decoded).
STANCE_LABELS = Thesis.params[("stance", "labels")].as_string().label("stance_labels")


@functools.lru_cache(maxsize=64)
def _decoded(text: str) -> Any:
    return json.loads(text)


def stance_labels(text: str | None) -> Mapping[str, float] | None:
    """The labels of a :data:`STANCE_LABELS` column (JSON text; the same few texts on every row, decoded once)."""
    if not text:
        return None
    value = _decoded(text)
    return value if isinstance(value, dict) else None


def load_theses(
    engine: Engine,
    as_of: datetime,
    *,
    ticker: str | None = None,
    template: str | None = None,
    model: str | None = None,
) -> list[ThesisPoint]:
    """Every thesis available at ``as_of`` (``available_at <= as_of``), oldest first."""
    stmt = select(
        Thesis.id,
        Thesis.ticker,
        Thesis.model_id,
        Thesis.template_name,
        Thesis.as_of,
        Thesis.available_at,
        Thesis.stance,
        Thesis.stance_label,
        Thesis.score,
        STANCE_LABELS,
    ).where(Thesis.available_at <= as_of)
    if ticker is not None:
        stmt = stmt.where(Thesis.ticker == ticker)
    if template is not None:
        stmt = stmt.where(Thesis.template_name == template)
    if model is not None:
        stmt = stmt.where(Thesis.model_id == model)
    stmt = stmt.order_by(Thesis.available_at, Thesis.id)
    with engine.connect() as conn:
        rows = conn.execute(stmt).all()
    return [
        ThesisPoint(
            id=r.id,
            ticker=r.ticker,
            model=r.model_id,
            template=r.template_name,
            night=r.as_of,
            available_at=r.available_at,
            stance=r.stance,
            up_probability=up_probability(r.stance, r.stance_label, r.score, stance_labels(r.stance_labels)),
        )
        for r in rows
    ]


@dataclass(frozen=True)
class Closes:
    """One instrument's closes known at the read's moment, in time order."""

    times: list[datetime]
    values: list[float]

    def first_at_or_after(self, moment: datetime) -> int | None:
        """The index of the first close at or after ``moment``; None when none is known yet."""
        i = bisect.bisect_left(self.times, moment)
        return i if i < len(self.times) else None


def load_closes(engine: Engine, tickers: Iterable[str], as_of: datetime) -> dict[str, Closes]:
    """The closes of ``tickers`` with ``time <= as_of``."""
    wanted = sorted(set(tickers))
    out: dict[str, Closes] = {t: Closes([], []) for t in wanted}
    if not wanted:
        return out
    stmt = (
        select(Price.ticker, Price.time, Price.close)
        .where(Price.ticker.in_(wanted), Price.time <= as_of)
        .order_by(Price.ticker, Price.time)
    )
    with engine.connect() as conn:
        for ticker, moment, close in conn.execute(stmt):
            series = out[ticker]
            series.times.append(moment)
            series.values.append(close)
    return out


@dataclass(frozen=True, slots=True)
class Outcome:
    """One thesis scored for one horizon: where it entered and exited, and the return."""

    thesis: ThesisPoint
    horizon: timedelta
    entry_time: datetime
    entry_close: float
    exit_time: datetime
    exit_close: float
    raw_return: float
    benchmark_return: float | None
    ret: float

    def to_json(self) -> dict[str, Any]:
        """Plain data (ISO times) for ``track-record --outcomes``."""
        t = self.thesis
        return {
            "thesis_id": t.id,
            "ticker": t.ticker,
            "model": t.model,
            "template": t.template,
            "night": t.night.isoformat(),
            "available_at": t.available_at.isoformat(),
            "stance": t.stance,
            "up_probability": t.up_probability,
            "horizon": span_text(self.horizon),
            "entry_time": self.entry_time.isoformat(),
            "entry_close": self.entry_close,
            "exit_time": self.exit_time.isoformat(),
            "exit_close": self.exit_close,
            "raw_return": self.raw_return,
            "benchmark_return": self.benchmark_return,
            "return": self.ret,
        }


def compute_outcomes(
    theses: Sequence[ThesisPoint],
    closes: Mapping[str, Closes],
    horizon: timedelta,
    *,
    benchmark: Closes | None = None,
) -> tuple[list[Outcome], list[ThesisPoint]]:
    """(outcomes, pending theses) for ``horizon``; ``closes`` must already be cut at the read's moment."""
    done: list[Outcome] = []
    pending: list[ThesisPoint] = []
    empty = Closes([], [])
    for t in theses:
        series = closes.get(t.ticker, empty)
        i = series.first_at_or_after(t.available_at)
        j = series.first_at_or_after(series.times[i] + horizon) if i is not None else None
        if i is None or j is None:
            pending.append(t)
            continue
        entry_time, exit_time = series.times[i], series.times[j]
        raw = series.values[j] / series.values[i] - 1.0
        bench = None
        if benchmark is not None:
            bi, bj = benchmark.first_at_or_after(entry_time), benchmark.first_at_or_after(exit_time)
            if bi is None or bj is None:
                pending.append(t)
                continue
            bench = benchmark.values[bj] / benchmark.values[bi] - 1.0
        done.append(
            Outcome(
                t,
                horizon,
                entry_time,
                series.values[i],
                exit_time,
                series.values[j],
                raw,
                bench,
                raw - bench if bench is not None else raw,
            )
        )
    return done, pending
