"""The track record: every thesis scored against what the market did next, point-in-time.

Definitions (exact; the tests recompute every figure from them independently):

* **Entry** of a thesis: the first stored close at or after its ``available_at`` (never its
  ``as_of``: a thesis cannot be traded before it exists). **Exit** for a horizon H: the
  first close at or after the entry's time + H (calendar time: a Friday close + 1d exits at
  Monday's close). **Return** = exit / entry − 1; with ``prices.benchmark`` set, minus the
  benchmark's return from its first close at or after the entry time to its first close at
  or after the exit time.
* **Point-in-time**: a read as of T sees only theses with ``available_at <= T`` and closes
  with ``time <= T``; so an outcome exists only once its exit close (and the benchmark's)
  is known. A thesis with no outcome yet is *pending*.
* A thesis with no stance (the model's answer could not be scored, or it abstained) is an
  **abstention**: counted apart (among theses whose outcome is known), in no figure.
* **n**: theses with a stance and an outcome. **hit rate**: over those with stance ≠ 0 and
  return ≠ 0, the share where the signs agree. **IC**: Spearman's rank correlation of
  stance and return, average ranks for ties (the Pearson correlation of the ranks).
  **top − bottom**: with ``r`` a thesis's average rank of stance (1..n), the bottom third is
  ``r <= n/3`` and the top third ``n + 1 − r <= n/3``; when n is not a multiple of 3 each
  third has floor(n/3) theses and the middle the rest, and tied stances fall into a third
  together or not at all. The figure is the top third's mean return minus the bottom's.
  **Brier**: over theses whose template gives an up-probability (:func:`up_probability`)
  and whose return ≠ 0, the mean of (p_up − [return > 0])².
* **Not enough data**: a figure counted over fewer than ``min_count`` theses is ``None``.
* **Intervals**: 95 % percentile bootstrap, resampling *nights* (a thesis's ``as_of``) with
  replacement, because one night's theses share one market move; ``bootstrap`` resamples
  from a generator seeded with ``seed``, the same for every group: reproducible. Ranks and
  thirds are those of the whole group, held fixed across resamples (each resample reweights
  the theses by how often it drew their night), so a resample costs one weighted sum per
  night: 1,000 resamples of 10,000 theses take milliseconds, not the seconds re-ranking
  every resample would. The point figures are exact; only the intervals use this.
* Groups: per model × template × instrument, and per model × template over all instruments
  (``ticker`` None); each over all time and over the ``window`` of theses available in
  ``(T − window, T]``.
* **A/B**: two sides (two templates, or two databases run on the same nights) are paired by
  (instrument, night); each figure is computed on the pairs where both sides have a stance
  and an outcome, and the difference B − A gets a paired bootstrap interval over nights.

numpy does the arithmetic (imported when a ledger is computed). Reads only; no torch.
"""

from __future__ import annotations

import bisect
import functools
import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta, timezone
from typing import TYPE_CHECKING, Any

from sqlalchemy import select

from robot_llm.store.db import Price, Thesis

if TYPE_CHECKING:
    import numpy as np
    from sqlalchemy.engine import Engine

__all__ = [
    "STANCE_LABELS",
    "ABRow",
    "Figures",
    "LedgerRow",
    "LedgerSettings",
    "Outcome",
    "Side",
    "ThesisPoint",
    "average_ranks",
    "compare",
    "compute_outcomes",
    "figures",
    "format_compare",
    "format_figures",
    "format_ledger",
    "ledger",
    "load_closes",
    "load_theses",
    "outcome_arrays",
    "span_text",
    "spearman",
    "stance_labels",
    "track_record",
    "up_probability",
]

FIGURES = ("hit_rate", "ic", "top_minus_bottom", "brier")
LEVEL = 0.95


def span_text(value: timedelta) -> str:
    """A horizon or window the way the config writes it ('1d', '90d')."""
    # Lazily: the config layer (pydantic, yaml) stays off the read API's import path.
    from robot_llm.config import format_duration

    return format_duration(value)


@dataclass(frozen=True)
class LedgerSettings:
    """How the ledger is computed (``prices:`` in the config; defaults as there)."""

    horizons: tuple[timedelta, ...] = (timedelta(days=1),)
    benchmark: str | None = None
    min_count: int = 20
    window: timedelta = timedelta(days=90)
    bootstrap: int = 1000
    seed: int = 0

    @classmethod
    def from_config(cls, prices: Any) -> LedgerSettings:
        """The settings of a config's ``prices:`` section (:class:`robot_llm.config.PricesConfig`)."""
        return cls(
            horizons=tuple(prices.horizons),
            benchmark=prices.benchmark,
            min_count=prices.min_count,
            window=prices.window,
            bootstrap=prices.bootstrap,
            seed=prices.seed,
        )


# --------------------------------------------------------------------------- theses and closes


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


# --------------------------------------------------------------------------- statistics


def _np() -> Any:
    import numpy

    return numpy


def average_ranks(values: np.ndarray) -> np.ndarray:
    """1-based ranks of ``values``, tied values sharing the average of their ranks."""
    np = _np()
    order = np.argsort(values, kind="stable")
    ordered = values[order]
    new = np.r_[True, ordered[1:] != ordered[:-1]]
    starts = np.flatnonzero(new)
    ends = np.r_[starts[1:], len(values)]
    ranks = np.empty(len(values))
    ranks[order] = ((starts + 1 + ends) / 2.0)[np.cumsum(new) - 1]
    return ranks


def spearman(x: Sequence[float], y: Sequence[float]) -> float | None:
    """Spearman's rank correlation with average ranks for ties; None when either side is constant."""
    np = _np()
    rx, ry = average_ranks(np.asarray(x, dtype=float)), average_ranks(np.asarray(y, dtype=float))
    dx, dy = rx - rx.mean(), ry - ry.mean()
    var = float((dx * dx).sum() * (dy * dy).sum())
    return float((dx * dy).sum() / math.sqrt(var)) if var > 0 else None


# The per-thesis terms every figure is a ratio of sums of (see _from_sums).
_TERMS = (
    "one",
    "directional",
    "hit",
    "has_p",
    "brier",
    "a",
    "b",
    "aa",
    "bb",
    "ab",
    "top",
    "bottom",
    "top_ret",
    "bottom_ret",
)


def _terms(stance: np.ndarray, ret: np.ndarray, p_up: np.ndarray) -> np.ndarray:
    """One row per thesis, one column per term of ``_TERMS``.

    Ranks and thirds are those of the whole group: a bootstrap resample reweights these rows
    (by how often it drew each night) and keeps them, so every resample is a weighted sum.
    """
    np = _np()
    n = len(stance)
    directional = (stance != 0) & (ret != 0)
    has_p = ~np.isnan(p_up) & (ret != 0)
    rank_s, rank_r = average_ranks(stance), average_ranks(ret)
    # Centred on the mean rank, (n + 1) / 2, so the moments below lose no digits.
    a, b = rank_s - (n + 1) / 2.0, rank_r - (n + 1) / 2.0
    top = (n + 1 - rank_s) <= n / 3.0
    bottom = rank_s <= n / 3.0
    brier = np.where(has_p, (np.nan_to_num(p_up) - (ret > 0)) ** 2, 0.0)
    columns = [
        np.ones(n),
        directional,
        directional & (np.sign(stance) == np.sign(ret)),
        has_p,
        brier,
        a,
        b,
        a * a,
        b * b,
        a * b,
        top,
        bottom,
        top * ret,
        bottom * ret,
    ]
    return np.stack([np.asarray(c, dtype=float) for c in columns], axis=1)


def _from_sums(sums: np.ndarray) -> dict[str, np.ndarray]:
    """Each figure (and its count) from rows of term sums (a resample each; the data: one row of plain sums)."""
    np = _np()
    t = {name: sums[:, i] for i, name in enumerate(_TERMS)}
    with np.errstate(invalid="ignore", divide="ignore"):
        n = t["one"]
        ma, mb = t["a"] / n, t["b"] / n
        cov = t["ab"] / n - ma * mb
        var = (t["aa"] / n - ma * ma) * (t["bb"] / n - mb * mb)
        return {
            "hit_rate": t["hit"] / t["directional"],
            "brier": t["brier"] / t["has_p"],
            "ic": np.where(var > 0, cov / np.sqrt(np.where(var > 0, var, 1.0)), np.nan),
            "top_minus_bottom": t["top_ret"] / t["top"] - t["bottom_ret"] / t["bottom"],
            "_n_hit": t["directional"],
            "_n_brier": t["has_p"],
            "_n_top": t["top"],
            "_n_bottom": t["bottom"],
        }


def _night_sums(terms: np.ndarray, nights: np.ndarray) -> np.ndarray:
    """The terms summed per night (rows in the order of the sorted distinct nights)."""
    np = _np()
    _, index = np.unique(nights, return_inverse=True)
    k = int(index.max()) + 1
    return np.stack([np.bincount(index, weights=terms[:, j], minlength=k) for j in range(terms.shape[1])], axis=1)


@functools.lru_cache(maxsize=4)
def _draws(nights: int, count: int, seed: int) -> np.ndarray:
    """How often each of ``nights`` nights is drawn in each of ``count`` resamples (a ``count`` x ``nights`` table).

    Cached: every group with as many nights gets the same draws (the same seed), computed once.
    """
    np = _np()
    picks = np.random.default_rng(seed).integers(0, nights, size=(count, nights))
    rows = np.repeat(np.arange(count) * nights, nights)
    table = np.bincount(rows + picks.ravel(), minlength=count * nights).reshape(count, nights).astype(float)
    table.setflags(write=False)
    return table


def _resampled_sums(per_night: Sequence[np.ndarray], count: int, seed: int) -> list[np.ndarray]:
    """For each table of per-night sums, the term sums of ``count`` resamples of the nights (the same draws for all)."""
    draws = _draws(per_night[0].shape[0], count, seed)
    return [draws @ table for table in per_night]


def _interval(samples: np.ndarray) -> tuple[float, float] | None:
    np = _np()
    finite = samples[np.isfinite(samples)]
    # Resamples where the figure is undefined (a third empty, no directional pair) are left out;
    # if most are, the interval would describe another population: none is given.
    if len(finite) < max(10, 0.9 * len(samples)):
        return None
    lo, hi = np.quantile(finite, [(1 - LEVEL) / 2, 1 - (1 - LEVEL) / 2])
    return float(lo), float(hi)


@dataclass(frozen=True)
class Figures:
    """The ledger's figures for one group over one period (None: not enough data or undefined)."""

    n: int
    abstained: int
    pending: int
    hit_rate: float | None
    hit_rate_n: int
    ic: float | None
    top_minus_bottom: float | None
    top_n: int
    bottom_n: int
    brier: float | None
    brier_n: int
    min_count: int
    intervals: dict[str, tuple[float, float] | None] = field(default_factory=dict)

    @property
    def enough(self) -> bool:
        """Whether n reaches the stated minimum (below it no figure is given)."""
        return self.n >= self.min_count

    def to_json(self) -> dict[str, Any]:
        """Flat plain data: each figure beside its count and its ``*_ci`` interval."""
        data: dict[str, Any] = {
            "n": self.n,
            "abstained": self.abstained,
            "pending": self.pending,
            "enough_data": self.enough,
            "min_count": self.min_count,
            "hit_rate": self.hit_rate,
            "hit_rate_n": self.hit_rate_n,
            "ic": self.ic,
            "top_minus_bottom": self.top_minus_bottom,
            "top_n": self.top_n,
            "bottom_n": self.bottom_n,
            "brier": self.brier,
            "brier_n": self.brier_n,
        }
        for name in FIGURES:
            ci = self.intervals.get(name)
            data[f"{name}_ci"] = list(ci) if ci is not None else None
        return data


def outcome_arrays(outcomes: Sequence[Outcome]) -> tuple[Any, Any, Any, Any]:
    """Stance, return, up-probability (NaN where none) and night (a timestamp) of each outcome, as arrays."""
    np = _np()
    stance = np.array([o.thesis.stance for o in outcomes], dtype=float)
    ret = np.array([o.ret for o in outcomes], dtype=float)
    p_up = np.array([np.nan if o.thesis.up_probability is None else o.thesis.up_probability for o in outcomes])
    nights = np.array([o.thesis.night.timestamp() for o in outcomes])
    return stance, ret, p_up, nights


def _point(stats: dict[str, Any], name: str, count: float, min_count: int) -> float | None:
    value = float(stats[name][0])
    return value if math.isfinite(value) and count >= min_count else None


def _figures(terms: np.ndarray, *, abstained: int, pending: int, min_count: int) -> Figures:
    stats = _from_sums(terms.sum(axis=0, keepdims=True))
    n = terms.shape[0]
    counts = {k: round(float(stats[k][0])) for k in ("_n_hit", "_n_brier", "_n_top", "_n_bottom")}
    return Figures(
        n=n,
        abstained=abstained,
        pending=pending,
        hit_rate=_point(stats, "hit_rate", counts["_n_hit"], min_count),
        hit_rate_n=counts["_n_hit"],
        ic=_point(stats, "ic", n, min_count),
        top_minus_bottom=_point(stats, "top_minus_bottom", n, min_count),
        top_n=counts["_n_top"],
        bottom_n=counts["_n_bottom"],
        brier=_point(stats, "brier", counts["_n_brier"], min_count),
        brier_n=counts["_n_brier"],
        min_count=min_count,
    )


def _figures_of(
    stance: np.ndarray,
    ret: np.ndarray,
    p_up: np.ndarray,
    nights: np.ndarray,
    *,
    abstained: int,
    pending: int,
    settings: LedgerSettings,
) -> Figures:
    if len(stance) == 0:
        return Figures(0, abstained, pending, None, 0, None, None, 0, 0, None, 0, settings.min_count)
    terms = _terms(stance, ret, p_up)
    result = _figures(terms, abstained=abstained, pending=pending, min_count=settings.min_count)
    if not result.enough or settings.bootstrap <= 0:
        return result
    (sums,) = _resampled_sums([_night_sums(terms, nights)], settings.bootstrap, settings.seed)
    boot = _from_sums(sums)
    intervals = {name: _interval(boot[name]) if getattr(result, name) is not None else None for name in FIGURES}
    return replace(result, intervals=intervals)


def figures(outcomes: Sequence[Outcome], *, abstained: int, pending: int, settings: LedgerSettings) -> Figures:
    """The figures of ``outcomes`` (each with a stance), with bootstrap intervals over nights."""
    return _figures_of(*outcome_arrays(outcomes), abstained=abstained, pending=pending, settings=settings)


# --------------------------------------------------------------------------- the ledger


@dataclass(frozen=True)
class LedgerRow:
    """One group of the ledger: all time, and the rolling window."""

    model: str
    template: str
    ticker: str | None
    horizon: timedelta
    all_time: Figures
    window: Figures
    window_span: timedelta

    def to_json(self) -> dict[str, Any]:
        """The ``--json`` object: keys model, template, ticker, horizon, then the figures; ``window`` nested."""
        return {
            "model": self.model,
            "template": self.template,
            "ticker": self.ticker,
            "horizon": span_text(self.horizon),
            **self.all_time.to_json(),
            "ci_level": LEVEL,
            "ci_over": "nights",
            "window": {"span": span_text(self.window_span), **self.window.to_json()},
        }


def _group_index(theses: Iterable[ThesisPoint]) -> dict[tuple[str, str, str | None], list[int]]:
    """Positions by (model, template, ticker) and by (model, template, None)."""
    out: dict[tuple[str, str, str | None], list[int]] = {}
    for i, t in enumerate(theses):
        out.setdefault((t.model, t.template, t.ticker), []).append(i)
        out.setdefault((t.model, t.template, None), []).append(i)
    return out


def _group_figures(
    arrays: tuple[Any, Any, Any, Any], idx: np.ndarray, pending: int, settings: LedgerSettings
) -> Figures:
    """The figures of the outcomes at ``idx`` in ``arrays`` (stance, return, p_up, night); a NaN stance abstains."""
    np = _np()
    stance, ret, p_up, nights = arrays
    scored = idx[~np.isnan(stance[idx])]
    return _figures_of(
        stance[scored],
        ret[scored],
        p_up[scored],
        nights[scored],
        abstained=len(idx) - len(scored),
        pending=pending,
        settings=settings,
    )


def ledger(
    theses: Sequence[ThesisPoint],
    closes: Mapping[str, Closes],
    as_of: datetime,
    settings: LedgerSettings,
    *,
    horizons: Sequence[timedelta] | None = None,
) -> list[LedgerRow]:
    """The ledger of ``theses`` against ``closes`` (both already cut at ``as_of``), ordered by group."""
    np = _np()
    benchmark = None
    if settings.benchmark:
        benchmark = closes.get(settings.benchmark) or Closes([], [])
    since = (as_of - settings.window).timestamp()
    keys = sorted(
        {(t.model, t.template, t.ticker) for t in theses} | {(t.model, t.template, None) for t in theses},
        key=lambda k: (k[0], k[1], k[2] is None, k[2] or ""),
    )
    rows: list[LedgerRow] = []
    for horizon in horizons or settings.horizons:
        outcomes, pending = compute_outcomes(theses, closes, horizon, benchmark=benchmark)
        # Arrays over every outcome once (NaN stance: an abstention); groups are positions into them.
        stance = np.array([np.nan if o.thesis.stance is None else o.thesis.stance for o in outcomes], dtype=float)
        ret = np.array([o.ret for o in outcomes], dtype=float)
        p_up = np.array([np.nan if o.thesis.up_probability is None else o.thesis.up_probability for o in outcomes])
        nights = np.array([o.thesis.night.timestamp() for o in outcomes])
        recent = np.array([o.thesis.available_at.timestamp() > since for o in outcomes], dtype=bool)
        outs = _group_index(o.thesis for o in outcomes)
        pend = _group_index(pending)
        recent_pending = {k: sum(1 for i in v if pending[i].available_at.timestamp() > since) for k, v in pend.items()}

        arrays = (stance, ret, p_up, nights)
        for key in keys:
            idx = np.asarray(outs.get(key, []), dtype=np.int64)
            rows.append(
                LedgerRow(
                    *key,
                    horizon=horizon,
                    all_time=_group_figures(arrays, idx, len(pend.get(key, [])), settings),
                    window=_group_figures(arrays, idx[recent[idx]], recent_pending.get(key, 0), settings),
                    window_span=settings.window,
                )
            )
    return rows


def track_record(
    engine: Engine,
    as_of: datetime,
    settings: LedgerSettings,
    *,
    horizons: Sequence[timedelta] | None = None,
    ticker: str | None = None,
    template: str | None = None,
    model: str | None = None,
) -> list[LedgerRow]:
    """The ledger as known at ``as_of``: theses available by then, against the closes known by then."""
    moment = as_of.astimezone(timezone.utc)
    theses = load_theses(engine, moment, ticker=ticker, template=template, model=model)
    wanted = {t.ticker for t in theses} | ({settings.benchmark} if settings.benchmark else set())
    closes = load_closes(engine, wanted, moment)
    return ledger(theses, closes, moment, settings, horizons=horizons)


# --------------------------------------------------------------------------- A/B


@dataclass(frozen=True)
class Side:
    """One side of an A/B comparison: a name and the theses it wrote (as known at the read's moment)."""

    name: str
    theses: Sequence[ThesisPoint]


@dataclass(frozen=True)
class ABRow:
    """Two sides on the same (instrument, night) pairs: each side's figures, and B − A with its interval."""

    ticker: str | None
    horizon: timedelta
    a: Figures
    b: Figures
    diff: dict[str, float | None]
    diff_ci: dict[str, tuple[float, float] | None]

    def to_json(self) -> dict[str, Any]:
        """Plain data for ``track-record --ab ... --json``."""
        return {
            "ticker": self.ticker,
            "horizon": span_text(self.horizon),
            "pairs": self.a.n,
            "a": self.a.to_json(),
            "b": self.b.to_json(),
            "diff": {
                **self.diff,
                **{f"{k}_ci": list(v) if v is not None else None for k, v in self.diff_ci.items()},
            },
            "ci_level": LEVEL,
            "ci_over": "nights",
        }


def _by_pair(outcomes: Iterable[Outcome]) -> dict[tuple[str, datetime], Outcome]:
    # One thesis per (instrument, night) and side: the last to become available stands, as in `latest`.
    out: dict[tuple[str, datetime], Outcome] = {}
    for o in sorted(outcomes, key=lambda o: (o.thesis.available_at, o.thesis.id)):
        if o.thesis.stance is not None:
            out[(o.thesis.ticker, o.thesis.night)] = o
    return out


def _paired(a: Sequence[Outcome], b: Sequence[Outcome], settings: LedgerSettings) -> tuple[Figures, Figures, Any, Any]:
    fa = figures(a, abstained=0, pending=0, settings=settings)
    fb = figures(b, abstained=0, pending=0, settings=settings)
    diff: dict[str, float | None] = {}
    for name in FIGURES:
        va, vb = getattr(fa, name), getattr(fb, name)
        diff[name] = vb - va if va is not None and vb is not None else None
    ci: dict[str, tuple[float, float] | None] = dict.fromkeys(FIGURES)
    if a and settings.bootstrap > 0 and any(v is not None for v in diff.values()):
        sa, ra, pa, nights = outcome_arrays(a)
        sb, rb, pb, _ = outcome_arrays(b)
        # The same resampled nights for both sides: the interval of a paired difference.
        sums_a, sums_b = _resampled_sums(
            [_night_sums(_terms(sa, ra, pa), nights), _night_sums(_terms(sb, rb, pb), nights)],
            settings.bootstrap,
            settings.seed,
        )
        boot_a, boot_b = _from_sums(sums_a), _from_sums(sums_b)
        for name in FIGURES:
            if diff[name] is not None:
                ci[name] = _interval(boot_b[name] - boot_a[name])
    return fa, fb, diff, ci


def compare(
    a: Side,
    b: Side,
    closes: Mapping[str, Closes],
    settings: LedgerSettings,
    *,
    horizons: Sequence[timedelta] | None = None,
) -> list[ABRow]:
    """A against B on the (instrument, night) pairs both scored: per instrument and over all of them."""
    benchmark = None
    if settings.benchmark:
        benchmark = closes.get(settings.benchmark) or Closes([], [])
    rows: list[ABRow] = []
    for horizon in horizons or settings.horizons:
        outs_a = _by_pair(compute_outcomes(a.theses, closes, horizon, benchmark=benchmark)[0])
        outs_b = _by_pair(compute_outcomes(b.theses, closes, horizon, benchmark=benchmark)[0])
        common = sorted(set(outs_a) & set(outs_b))
        for ticker in [*sorted({k[0] for k in common}), None]:
            keys = [k for k in common if ticker is None or k[0] == ticker]
            fa, fb, diff, ci = _paired([outs_a[k] for k in keys], [outs_b[k] for k in keys], settings)
            rows.append(ABRow(ticker, horizon, fa, fb, diff, ci))
    return rows


# --------------------------------------------------------------------------- text


def _num(value: float | None, ci: tuple[float, float] | None, fmt: str) -> str:
    if value is None:
        return "-"
    text = format(value, fmt)
    if ci is not None:
        text += f" [{format(ci[0], fmt)}, {format(ci[1], fmt)}]"
    return text


def format_figures(f: Figures) -> str:
    """One line: n, then each figure with its interval, or "not enough data"."""
    head = f"n {f.n}, {f.abstained} abstained, {f.pending} pending"
    if not f.enough:
        return f"{head}: not enough data (fewer than {f.min_count} scored theses)"
    parts = [
        f"hit {_num(f.hit_rate, f.intervals.get('hit_rate'), '.1%')} of {f.hit_rate_n}",
        f"IC {_num(f.ic, f.intervals.get('ic'), '+.3f')}",
        f"top-bottom {_num(f.top_minus_bottom, f.intervals.get('top_minus_bottom'), '+.2%')}",
        f"Brier {_num(f.brier, f.intervals.get('brier'), '.3f')} of {f.brier_n}",
    ]
    return f"{head}; " + ", ".join(parts)


def format_ledger(rows: Sequence[LedgerRow], *, tickers: bool = True) -> list[str]:
    """The ledger as text lines, grouped by model, template and horizon (``tickers``: per instrument too)."""
    out: list[str] = []
    last = None
    for r in rows:
        if r.ticker is not None and not tickers:
            continue
        key = (r.model, r.template, r.horizon)
        if key != last:
            out.append(f"{r.template} ({r.model}), horizon {span_text(r.horizon)}:")
            last = key
        name = r.ticker or "all"
        out.append(f"  {name:<8} all time: {format_figures(r.all_time)}")
        out.append(f"  {'':<8} last {span_text(r.window_span)}: {format_figures(r.window)}")
    return out


def format_compare(rows: Sequence[ABRow], a: str, b: str) -> list[str]:
    """The A/B comparison as text lines."""
    out: list[str] = []
    for r in rows:
        name = r.ticker or "all"
        out.append(f"{name} {span_text(r.horizon)}: {r.a.n} pairs")
        out.append(f"  A {a}: {format_figures(r.a)}")
        out.append(f"  B {b}: {format_figures(r.b)}")
        diffs = [
            f"{label} {_num(r.diff[key], r.diff_ci[key], fmt)}"
            for key, label, fmt in (
                ("hit_rate", "hit", "+.1%"),
                ("ic", "IC", "+.3f"),
                ("top_minus_bottom", "top-bottom", "+.2%"),
                ("brier", "Brier", "+.3f"),
            )
        ]
        out.append("  B - A: " + ", ".join(diffs))
    return out
