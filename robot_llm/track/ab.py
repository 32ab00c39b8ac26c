"""A/B: two sides (two templates, or two databases run on the same nights) paired by
(instrument, night), each side's figures on the pairs, and B − A with a paired bootstrap interval.

Definitions are in :mod:`robot_llm.track.ledger`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from robot_llm.track.figures import (
    FIGURES,
    Figures,
    LedgerSettings,
    figure_text,
    figures,
    format_figures,
    outcome_arrays,
)
from robot_llm.track.outcomes import Closes, Outcome, ThesisPoint, compute_outcomes, span_text
from robot_llm.track.stats import LEVEL, from_sums, interval, night_sums, resampled_sums, term_rows

__all__ = ["ABRow", "Side", "compare", "format_compare"]


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
        sums_a, sums_b = resampled_sums(
            [night_sums(term_rows(sa, ra, pa), nights), night_sums(term_rows(sb, rb, pb), nights)],
            settings.bootstrap,
            settings.seed,
        )
        boot_a, boot_b = from_sums(sums_a), from_sums(sums_b)
        for name in FIGURES:
            if diff[name] is not None:
                ci[name] = interval(boot_b[name] - boot_a[name])
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


def format_compare(rows: Sequence[ABRow], a: str, b: str) -> list[str]:
    """The A/B comparison as text lines."""
    out: list[str] = []
    for r in rows:
        name = r.ticker or "all"
        out.append(f"{name} {span_text(r.horizon)}: {r.a.n} pairs")
        out.append(f"  A {a}: {format_figures(r.a)}")
        out.append(f"  B {b}: {format_figures(r.b)}")
        diffs = [
            f"{label} {figure_text(r.diff[key], r.diff_ci[key], fmt)}"
            for key, label, fmt in (
                ("hit_rate", "hit", "+.1%"),
                ("ic", "IC", "+.3f"),
                ("top_minus_bottom", "top-bottom", "+.2%"),
                ("brier", "Brier", "+.3f"),
            )
        ]
        out.append("  B - A: " + ", ".join(diffs))
    return out
