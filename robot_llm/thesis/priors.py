"""``doctor``'s stance check: templates that never show a neutral verdict, labels the model never picks.

Two warnings (the night still runs):

- a template whose labels have no neutral one (value 0), or whose worked examples never end
  in it (``cue`` followed by that label): the model then sees only up and down verdicts and
  rarely answers neutral;
- a label whose log-probability, as the last night measured it, is below
  :data:`PRIOR_FLOOR` (about −5: it never wins): the mean over the night's rows, and the
  scored calibration prior when the template's mode scores one (both recorded in the
  ``generate`` run's counts by :class:`robot_llm.night.stance.Calibration`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sqlalchemy.engine import Engine

    from robot_llm.prompting.template import Template

__all__ = ["PRIOR_FLOOR", "measured_priors", "prior_warnings", "template_warnings"]

#: A label whose log-probability among the labels is below this almost never wins.
PRIOR_FLOOR = -5.0


def template_warnings(template: Template) -> list[str]:
    """A template asking a stance without a neutral label, or whose worked examples never show it."""
    stance = template.stance
    if stance is None:
        return []
    neutral = [label for label, value in stance.labels.items() if value == 0]
    if not neutral:
        return [f"{template.path}: no stance label has the value 0: the model cannot answer 'no change'"]
    cue = stance.cue.strip()
    shown = _rendered_examples(template)
    if not any(f"{cue}{label}" in shown or f"{cue} {label.strip()}" in shown for label in neutral):
        names = ", ".join(repr(label) for label in neutral)
        return [f"{template.path}: no worked example ends in the neutral label {names} after {cue!r}"]
    return []


def _rendered_examples(template: Template) -> str:
    """The template rendered with no data (its worked examples, in every order it shows them)."""
    from datetime import UTC, datetime

    from robot_llm.prompting.context import VARIANTS, InstrumentView, RenderContext
    from robot_llm.prompting.render import render_prompt

    when = datetime(2026, 1, 1, tzinfo=UTC)
    view = InstrumentView("N/A", "N/A", (), None)
    return "\n".join(
        render_prompt(template, RenderContext(view, when, template.language, (), (), variant))
        for variant in range(VARIANTS)
    )


def measured_priors(engine: Engine) -> dict[str, Any]:
    """The label priors the latest ``generate`` run that measured any recorded, by template ({} if none)."""
    from sqlalchemy import select

    from robot_llm.store.db import Run, session_scope

    with session_scope(engine) as session:
        for counts in session.scalars(
            select(Run.counts).where(Run.kind == "generate").order_by(Run.started_at.desc()).limit(20)
        ):
            if counts and counts.get("label_priors"):
                return dict(counts["label_priors"])
    return {}


def prior_warnings(priors: dict[str, Any], templates: set[str]) -> list[str]:
    """One warning per configured template and label measured below :data:`PRIOR_FLOOR`."""
    out = []
    for name, entry in sorted(priors.items()):
        if name not in templates:
            continue
        for where, what in (("prior", "its calibration prior"), ("rows", "the last night's rows on average")):
            low = {label: lp for label, lp in (entry.get(where) or {}).items() if lp < PRIOR_FLOOR}
            if low:
                shown = ", ".join(f"{label!r} {lp:.1f}" for label, lp in low.items())
                out.append(f"template {name}: label(s) {shown} (log-probability) under {what}: they never win")
    return out
