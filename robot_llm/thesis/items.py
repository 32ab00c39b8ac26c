"""Each news item's stance, read in the news stance's own step (no weight pass of its own), and its aggregate.

A template opts in with ``stance.news.items: true``. The items are the news block's lines,
each starting with ``- ``, right before the news stance's anchor (``stance.news.before``),
one per entry of the request's ``news_ids``, in order (the prompt shows news oldest first).
A prompt whose lines do not match its news ids one to one gets no per-item stance: each of
its items is stored unplaced (``stance`` None), never guessed.

Item ``i``'s label scores are the cue right after its line, seeing the prompt before the
news block and item ``i``'s own tokens (:func:`robot_llm.llm.scoring.plan_items` says
exactly what that means). They go through the news stance's method, calibration and label
values; ``batch`` calibration keeps a prior of the items' own (an item is not a row).

The instrument's aggregate (``item_stance``) is the plain mean of its placed items' stances:
the planner already chose the most relevant items (``news.max_items``), and the items of
one night are all within its look-back, so each counts once (no recency or relevance weight,
which would need times and scores the worker does not have; a weighting is not measured yet).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from robot_llm.llm.generate import Completion
    from robot_llm.llm.model import Model
    from robot_llm.night.stance import Calibration, StanceSpec

__all__ = ["BULLET", "ItemStances", "item_spans", "item_stances"]

#: How a news item's line starts in the templates that ask per-item stances.
BULLET = "- "


@dataclass(frozen=True)
class ItemStances:
    """A row's per-item stances: the aggregate (None: no item placed) and one entry per news id.

    Each entry is ``{"news_id", "stance", "label", "probs"}``; ``stance`` and ``label`` are
    None and ``probs`` empty for an item that could not be placed.
    """

    stance: float | None
    items: list[dict[str, Any]]


def item_spans(prompt: str, spec: StanceSpec | None, count: int) -> tuple[tuple[int, int], ...]:
    """The char spans (bullet to line end) of the ``count`` news items before the news stance's anchor.

    Empty when the template asks no per-item stance, or the prompt's bullet lines there are
    not exactly ``count``.
    """
    news = spec.news if spec is not None else None
    if news is None or not news.items or not count or news.anchor is None:
        return ()
    end = prompt.rfind(news.anchor)
    if end < 0:
        return ()
    spans: list[tuple[int, int]] = []
    for _ in range(count):
        start = prompt.rfind("\n", 0, end) + 1
        if start == 0 or not prompt.startswith(BULLET, start):
            return ()
        spans.append((start, end))
        end = start - 1
    if prompt.startswith(BULLET, prompt.rfind("\n", 0, end) + 1):  # more bullet lines than news ids
        return ()
    return tuple(reversed(spans))


def item_stances(
    model: Model,
    calibration: Calibration,
    rows: Sequence[tuple[StanceSpec | None, Completion, Sequence[int]]],
    names: Sequence[str],
) -> list[ItemStances | None]:
    """Every row's per-item stances (None: its template asks none), calibrated together as one batch.

    ``rows`` are (spec, completion, news ids) of a batch, ``names`` their template names.
    """
    scored: list[tuple[StanceSpec, Sequence[Sequence[float]]] | None] = []
    where: list[list[int | None]] = []
    flat_names: list[str] = []
    for (spec, completion, news_ids), name in zip(rows, names, strict=True):
        news = spec.news if spec is not None else None
        if news is None or not news.items:
            where.append([])
            continue
        item_spec = replace(news, after="item")
        pieces = completion.item_logprobs
        if pieces is None or len(pieces) != len(news_ids):
            pieces = (None,) * len(news_ids)
        at: list[int | None] = []
        for item in pieces:
            if item is None:
                at.append(None)
                continue
            at.append(len(scored))
            scored.append((item_spec, [list(p) for p in item]))
            flat_names.append(f"{name}:items")
        where.append(at)
    results = calibration.stances(model, scored, flat_names) if scored else []
    out: list[ItemStances | None] = []
    for (spec, _, news_ids), at in zip(rows, where, strict=True):
        news = spec.news if spec is not None else None
        if news is None or not news.items:
            out.append(None)
            continue
        entries = []
        for news_id, index in zip(news_ids, at, strict=True):
            st = results[index] if index is not None else None
            entries.append(
                {
                    "news_id": int(news_id),
                    "stance": st.stance if st else None,
                    "label": st.label if st else None,
                    "probs": st.probs if st else {},
                }
            )
        placed = [e["stance"] for e in entries if e["stance"] is not None]
        out.append(ItemStances(sum(placed) / len(placed) if placed else None, entries))
    return out
