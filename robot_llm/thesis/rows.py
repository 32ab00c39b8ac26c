"""The worker's stance-quality step: abstentions without inputs, and each row's checks before it is stored.

Kept out of :mod:`robot_llm.night.worker` so the worker gains two calls, not a body of checks:

- :func:`abstention_row`: a request planned without news and without signals
  (``params.abstain == "no_inputs"``, :func:`robot_llm.night.plan.request_params`) is stored as an
  explicit abstention, ``kind`` ``no_inputs``, with no text and no stance; no model runs for it.
- :func:`annotate_rows`: every generated row gets its ``kind`` (``thesis``, or ``stance_only``
  for a template with ``max_new_tokens: 0``) and its flags
  (:mod:`robot_llm.thesis.checks`): a thesis whose stated direction contradicts its stance, a
  copied worked example, an echoed headline, a sentence already stored for another
  instrument of the night. The flags are counted into the run's statistics.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from sqlalchemy import select

from robot_llm.store.db import NewsItem, Thesis, session_scope
from robot_llm.thesis.checks import FLAG_DISAGREES, degeneration_flags, thesis_direction

if TYPE_CHECKING:
    from sqlalchemy.engine import Engine

    from robot_llm.night.queue import ClaimedRequest

__all__ = ["abstains", "abstention_row", "annotate_rows"]

_CYRILLIC = re.compile(r"[А-Яа-яЁё]")
_DEFAULTS: dict[str, Any] = {
    "kind": None,
    "flags": list,
    "stance_probs": dict,
    "text_stance": None,
    "news_stance": None,
    "stance_source": None,
}


def abstains(req: ClaimedRequest) -> str | None:
    """The abstention a request was planned with (``no_inputs``), or None for one to generate."""
    value = req.params.get("abstain")
    return str(value) if value else None


def abstention_row(req: ClaimedRequest, model_id: str, reason: str) -> dict[str, Any]:
    """The stored row of an explicit abstention: no text, no stance, no tokens, point-in-time like any thesis."""
    return {
        "request_id": req.id,
        "ticker": req.ticker,
        "template_name": req.template_name,
        "template_version": req.template_version,
        "text": "",
        "stance": None,
        "stance_label": None,
        "score": None,
        "label_logprobs": {},
        "model_id": model_id,
        "params": req.params,
        "seed": req.params.get("seed"),
        "prompt_sha256": req.prompt_sha256,
        "prompt_tokens": 0,
        "completion_tokens": 0,
        "finish_reason": "abstain",
        "generation_seconds": 0.0,
        "news_ids": req.news_ids,
        "signal_ids": req.signal_ids,
        "as_of": req.as_of,
        "valid_until": req.valid_until,
        "kind": reason,
        "flags": [],
    }


def annotate_rows(engine: Engine, rows: list[dict[str, Any]], prompts: dict[int, str]) -> Counter[str]:
    """Set ``kind`` and ``flags`` on the batch's generated rows; returns the flags counted.

    ``prompts`` are by request id. One query reads the news shown in the batch's prompts,
    one the sentences the night already stored for each (as_of, template).
    """
    for row in rows:  # one multi-row insert: every row names the same columns
        for key, value in _DEFAULTS.items():
            row.setdefault(key, value() if callable(value) else value)
    generated = [r for r in rows if r["kind"] is None]
    counted: Counter[str] = Counter()
    if not generated:
        return counted
    news_ids = {i for r in generated for i in r["news_ids"]}
    nights = {(r["as_of"], r["template_name"]) for r in generated}
    with session_scope(engine) as session:
        news = {
            i: " ".join(p for p in (title, summary) if p)
            for i, title, summary in session.execute(
                select(NewsItem.id, NewsItem.title, NewsItem.summary).where(NewsItem.id.in_(news_ids))
            )
        }
        seen: dict[tuple[Any, str], list[str]] = {}
        for as_of, template in nights:
            seen[(as_of, template)] = list(
                session.scalars(
                    select(Thesis.text).where(
                        Thesis.as_of == as_of, Thesis.template_name == template, Thesis.kind == "thesis"
                    )
                )
            )
    for row in generated:
        text = row["text"]
        stance_only = int(row["params"].get("max_new_tokens", 1)) == 0
        row["kind"] = "stance_only" if stance_only else "thesis"
        flags: list[str] = []
        if not stance_only:
            night = seen[(row["as_of"], row["template_name"])]
            verdicts = dict(row["params"].get("stance") or {}).get("verdicts") or {}
            shown = [news[i] for i in row["news_ids"]]
            flags += degeneration_flags(text, prompts[row["request_id"]], shown, night, verdicts.values())
            night.append(text)  # a later row of this batch repeating it is a repeat too
            flags += _agreement_flags(text, row["stance"])
        row["flags"] = flags
        counted.update(flags)
    return counted


def _agreement_flags(text: str, stance: float | None) -> Sequence[str]:
    """``disagrees`` when the thesis states one direction and its stance has the other sign."""
    if stance is None:
        return ()
    direction = thesis_direction(text, "ru" if _CYRILLIC.search(text) else "en")
    if direction and direction * stance < 0:
        return (FLAG_DISAGREES,)
    return ()
