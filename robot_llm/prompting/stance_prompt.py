"""The stance question's side of prompting: the content-free calibration context, and the labels' pieces.

A template that asks a stance appends a cue after the thesis and has the model score label
continuations after it (the scoring is :mod:`robot_llm.night.stance`). Here: the content-free
prompt whose label prior calibration divides out, and the check of how the tokenizer
splits the labels, which decides whether the comparison ``method`` is fair.
"""

from __future__ import annotations

from datetime import datetime
from typing import TYPE_CHECKING
from zoneinfo import ZoneInfo

from robot_llm.clock import aware_utc
from robot_llm.prompting.context import InstrumentView, RenderContext
from robot_llm.prompting.render import render_prompt
from robot_llm.prompting.template import Template

if TYPE_CHECKING:
    from robot_llm.prompting.budget import TokenCounter

__all__ = ["CONTENT_FREE", "content_free_context", "stance_label_problems"]


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
    return render_prompt(template, context) + " " + CONTENT_FREE + template.stance.cue


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
