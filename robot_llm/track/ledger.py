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

The work is split by step: :mod:`.outcomes` (theses, closes, entry, exit, return),
:mod:`.stats` (ranks, terms, bootstrap), :mod:`.figures` (one group's figures), this module
(the ledger's groups) and :mod:`.ab` (A/B).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import TYPE_CHECKING, Any

# The command line (robot_llm/commands/track_record.py) imports these from here.
from robot_llm.track.ab import Side, compare, format_compare
from robot_llm.track.figures import Figures, LedgerSettings, figures_of, format_figures
from robot_llm.track.outcomes import Closes, ThesisPoint, compute_outcomes, load_closes, load_theses, span_text
from robot_llm.track.stats import LEVEL, numpy_module

if TYPE_CHECKING:
    import numpy as np
    from sqlalchemy.engine import Engine

__all__ = [
    "LedgerRow",
    "LedgerSettings",
    "Side",
    "compare",
    "compute_outcomes",
    "format_compare",
    "format_ledger",
    "ledger",
    "load_closes",
    "load_theses",
    "track_record",
]


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
    np = numpy_module()
    stance, ret, p_up, nights = arrays
    scored = idx[~np.isnan(stance[idx])]
    return figures_of(
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
    np = numpy_module()
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
