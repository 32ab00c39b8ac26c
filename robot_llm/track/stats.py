"""The ledger's arithmetic: average ranks, Spearman's IC, the per-thesis terms every figure is a
ratio of sums of, and the bootstrap over nights (definitions in :mod:`robot_llm.track.ledger`).

numpy is imported when a figure is first computed, not with this module.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np

__all__ = [
    "LEVEL",
    "average_ranks",
    "from_sums",
    "interval",
    "night_sums",
    "numpy_module",
    "resampled_sums",
    "spearman",
    "term_rows",
]

LEVEL = 0.95


def numpy_module() -> Any:
    """numpy, imported on first use (the read API imports this package without needing it)."""
    import numpy

    return numpy


def average_ranks(values: np.ndarray) -> np.ndarray:
    """1-based ranks of ``values``, tied values sharing the average of their ranks."""
    np = numpy_module()
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
    np = numpy_module()
    rx, ry = average_ranks(np.asarray(x, dtype=float)), average_ranks(np.asarray(y, dtype=float))
    dx, dy = rx - rx.mean(), ry - ry.mean()
    var = float((dx * dx).sum() * (dy * dy).sum())
    return float((dx * dy).sum() / math.sqrt(var)) if var > 0 else None


# The per-thesis terms every figure is a ratio of sums of (see from_sums).
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


def term_rows(stance: np.ndarray, ret: np.ndarray, p_up: np.ndarray) -> np.ndarray:
    """One row per thesis, one column per term of ``_TERMS``.

    Ranks and thirds are those of the whole group: a bootstrap resample reweights these rows
    (by how often it drew each night) and keeps them, so every resample is a weighted sum.
    """
    np = numpy_module()
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


def from_sums(sums: np.ndarray) -> dict[str, np.ndarray]:
    """Each figure (and its count) from rows of term sums (a resample each; the data: one row of plain sums)."""
    np = numpy_module()
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


def night_sums(terms: np.ndarray, nights: np.ndarray) -> np.ndarray:
    """The terms summed per night (rows in the order of the sorted distinct nights)."""
    np = numpy_module()
    _, index = np.unique(nights, return_inverse=True)
    k = int(index.max()) + 1
    return np.stack([np.bincount(index, weights=terms[:, j], minlength=k) for j in range(terms.shape[1])], axis=1)


@functools.lru_cache(maxsize=4)
def _draws(nights: int, count: int, seed: int) -> np.ndarray:
    """How often each of ``nights`` nights is drawn in each of ``count`` resamples (a ``count`` x ``nights`` table).

    Cached: every group with as many nights gets the same draws (the same seed), computed once.
    """
    np = numpy_module()
    picks = np.random.default_rng(seed).integers(0, nights, size=(count, nights))
    rows = np.repeat(np.arange(count) * nights, nights)
    table = np.bincount(rows + picks.ravel(), minlength=count * nights).reshape(count, nights).astype(float)
    table.setflags(write=False)
    return table


def resampled_sums(per_night: Sequence[np.ndarray], count: int, seed: int) -> list[np.ndarray]:
    """For each table of per-night sums, the term sums of ``count`` resamples of the nights (the same draws for all)."""
    draws = _draws(per_night[0].shape[0], count, seed)
    return [draws @ table for table in per_night]


def interval(samples: np.ndarray) -> tuple[float, float] | None:
    """The percentile interval at :data:`LEVEL` of a figure's resampled values; None when too few are defined."""
    np = numpy_module()
    finite = samples[np.isfinite(samples)]
    # Resamples where the figure is undefined (a third empty, no directional pair) are left out;
    # if most are, the interval would describe another population: none is given.
    if len(finite) < max(10, 0.9 * len(samples)):
        return None
    lo, hi = np.quantile(finite, [(1 - LEVEL) / 2, 1 - (1 - LEVEL) / 2])
    return float(lo), float(hi)
