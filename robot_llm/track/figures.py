"""One group's figures over one period (n, hit rate, IC, top − bottom, Brier) with their
bootstrap intervals, the settings they are computed with, and their text.

Definitions are in :mod:`robot_llm.track.ledger`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from robot_llm.track.outcomes import Outcome
from robot_llm.track.stats import from_sums, interval, night_sums, numpy_module, resampled_sums, term_rows

if TYPE_CHECKING:
    import numpy as np

__all__ = [
    "FIGURES",
    "Figures",
    "LedgerSettings",
    "figure_text",
    "figures",
    "figures_of",
    "format_figures",
    "outcome_arrays",
]

FIGURES = ("hit_rate", "ic", "top_minus_bottom", "brier")


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
    np = numpy_module()
    stance = np.array([o.thesis.stance for o in outcomes], dtype=float)
    ret = np.array([o.ret for o in outcomes], dtype=float)
    p_up = np.array([np.nan if o.thesis.up_probability is None else o.thesis.up_probability for o in outcomes])
    nights = np.array([o.thesis.night.timestamp() for o in outcomes])
    return stance, ret, p_up, nights


def _point(stats: dict[str, Any], name: str, count: float, min_count: int) -> float | None:
    value = float(stats[name][0])
    return value if math.isfinite(value) and count >= min_count else None


def _figures(terms: np.ndarray, *, abstained: int, pending: int, min_count: int) -> Figures:
    stats = from_sums(terms.sum(axis=0, keepdims=True))
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


def figures_of(
    stance: np.ndarray,
    ret: np.ndarray,
    p_up: np.ndarray,
    nights: np.ndarray,
    *,
    abstained: int,
    pending: int,
    settings: LedgerSettings,
) -> Figures:
    """The figures of theses given as arrays (each with a stance), with bootstrap intervals over ``nights``."""
    if len(stance) == 0:
        return Figures(0, abstained, pending, None, 0, None, None, 0, 0, None, 0, settings.min_count)
    terms = term_rows(stance, ret, p_up)
    result = _figures(terms, abstained=abstained, pending=pending, min_count=settings.min_count)
    if not result.enough or settings.bootstrap <= 0:
        return result
    (sums,) = resampled_sums([night_sums(terms, nights)], settings.bootstrap, settings.seed)
    boot = from_sums(sums)
    intervals = {name: interval(boot[name]) if getattr(result, name) is not None else None for name in FIGURES}
    return replace(result, intervals=intervals)


def figures(outcomes: Sequence[Outcome], *, abstained: int, pending: int, settings: LedgerSettings) -> Figures:
    """The figures of ``outcomes`` (each with a stance), with bootstrap intervals over nights."""
    return figures_of(*outcome_arrays(outcomes), abstained=abstained, pending=pending, settings=settings)


def figure_text(value: float | None, ci: tuple[float, float] | None, fmt: str) -> str:
    """A figure formatted with ``fmt``, its interval in brackets after it; "-" when there is none."""
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
        f"hit {figure_text(f.hit_rate, f.intervals.get('hit_rate'), '.1%')} of {f.hit_rate_n}",
        f"IC {figure_text(f.ic, f.intervals.get('ic'), '+.3f')}",
        f"top-bottom {figure_text(f.top_minus_bottom, f.intervals.get('top_minus_bottom'), '+.2%')}",
        f"Brier {figure_text(f.brier, f.intervals.get('brier'), '.3f')} of {f.brier_n}",
    ]
    return f"{head}; " + ", ".join(parts)
