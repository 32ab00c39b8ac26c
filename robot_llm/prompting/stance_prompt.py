"""The stance question's side of prompting: the content-free calibration context, and the labels' pieces.

A template that asks a stance appends a cue after the thesis and has the model score label
continuations after it (the scoring is :mod:`robot_llm.night.stance`). Here: the content-free
prompt whose label prior calibration divides out, and the check of how the tokenizer
splits the labels, which decides whether the comparison ``method`` is fair.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from datetime import datetime
from typing import TYPE_CHECKING
from zoneinfo import ZoneInfo

from robot_llm.clock import aware_utc
from robot_llm.prompting.context import InstrumentView, NewsView, RenderContext
from robot_llm.prompting.render import render_prompt
from robot_llm.prompting.template import Template

if TYPE_CHECKING:
    from robot_llm.prompting.budget import TokenCounter

__all__ = ["CONTENT_FREE", "content_free_context", "domain_contexts", "stance_label_problems"]


#: The content-free stand-in for every piece of data (Zhao et al., "Calibrate Before Use", 2021).
CONTENT_FREE = "N/A"


def content_free_context(template: Template, as_of: datetime, tz: ZoneInfo) -> str:
    """The stance context of a content-free input: the template with no instrument, news or forecast.

    Instrument and thesis are ``N/A``; the result ends with the stance cue, so the label
    probabilities after it are the prior the model gives the labels whatever the news.
    """
    if template.stance is None:
        raise ValueError(f"template {template.name!r} asks no stance")
    nothing = InstrumentView(CONTENT_FREE, CONTENT_FREE, (), None)
    context = RenderContext(
        instrument=nothing,
        as_of=aware_utc(as_of, "as_of").astimezone(tz),
        language=template.language,
        news=(),
        signals=(),
    )
    thesis = "" if _reads_prompt(template) else " " + CONTENT_FREE
    return render_prompt(template, context) + thesis + template.stance.cue


def _reads_prompt(template: Template) -> bool:
    """Whether the stance cue follows the prompt itself (no thesis is read): ``after: prompt`` or no thesis."""
    assert template.stance is not None
    return template.stance.after == "prompt" or template.generation.max_new_tokens == 0


def domain_contexts(
    template: Template, as_of: datetime, tz: ZoneInfo, texts: Sequence[str], samples: int, seed: int
) -> list[str]:
    """Stance contexts whose news and thesis are random words of the night's own news (Fei et al., ACL 2023).

    Each of ``samples`` renderings shows one news item and a thesis, each as many words
    (drawn with replacement, seeded) as a typical news text of ``texts`` has; the mean label
    prior over them is what a news-shaped input with no meaning gets. An empty list without news.
    """
    if template.stance is None:
        raise ValueError(f"template {template.name!r} asks no stance")
    words = [w for text in texts for w in re.findall(r"\w+", text)]
    if not words:
        return []
    lengths = sorted(len(re.findall(r"\w+", t)) for t in texts)
    length = max(3, lengths[len(lengths) // 2])
    rng = random.Random(seed)
    when = aware_utc(as_of, "as_of").astimezone(tz)
    out = []
    for _ in range(samples):
        news_text = " ".join(rng.choice(words) for _ in range(length))
        thesis = " ".join(rng.choice(words) for _ in range(length))
        item = NewsView(id=0, title=news_text, summary="", feed="", published_at=when, fetched_at=when, at=when)
        context = RenderContext(
            instrument=InstrumentView(CONTENT_FREE, CONTENT_FREE, (), None),
            as_of=when,
            language=template.language,
            news=(item,),
            signals=(),
        )
        read = "" if _reads_prompt(template) else " " + thesis
        out.append(render_prompt(template, context) + read + template.stance.cue)
    return out


def stance_label_problems(template: Template, tokenizer: TokenCounter) -> tuple[list[str], list[str]]:
    """(errors, warnings) about how the tokenizer splits the template's stance labels.

    Labels of different piece counts bias the ``sum`` method towards the shortest label
    (a warning); the ``first`` method needs every label to be one piece, all distinct (an error).
    """
    stance = template.stance
    if stance is None:
        return [], []
    specials = len(tokenizer.encode(""))  # BOS, when the tokenizer adds one
    pieces = {label: tokenizer.encode(label)[specials:] for label in stance.labels}
    counts = ", ".join(f"{label!r}: {len(p)}" for label, p in pieces.items())
    errors: list[str] = []
    warnings: list[str] = []
    if stance.method == "first":
        firsts = [p[0] for p in pieces.values() if p]
        if any(len(p) != 1 for p in pieces.values()) or len(set(firsts)) != len(firsts):
            errors.append(
                f"{template.path}: stance.method 'first' needs labels of one distinct piece each ({counts} pieces)"
            )
    elif len({len(p) for p in pieces.values()}) > 1:
        fix = "" if stance.method == "mean" else "; use stance.method 'mean' (length-fair) or single-piece labels"
        warnings.append(f"{template.path}: stance labels split unevenly ({counts} pieces){fix}")
    return errors, warnings
