"""Stance scoring: a thesis's numeric stance from the model's probabilities of label words.

The template asks a stance question (a cue appended to the thesis, e.g. "Stance:") and
names label continuations with values (``bullish: 1.0``, ``bearish: -1.0``...). The model
scores each label after the cue; the stance is the expected value under the softmax over
the labels, with the argmax label and its probability kept for display.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from robot_llm.configured_model import BatchModel

__all__ = ["StanceResult", "StanceSpec", "parse_stance_spec", "score_stance", "stance_from_logprobs"]


@dataclass(frozen=True)
class StanceSpec:
    """The template's stance question: a cue appended to the thesis and the label continuations."""

    cue: str
    labels: tuple[tuple[str, float], ...]


@dataclass(frozen=True)
class StanceResult:
    """A thesis's numeric stance: ``stance = Σ p(label)·value``, the argmax label and its probability."""

    stance: float
    label: str
    score: float
    label_logprobs: dict[str, float]


def parse_stance_spec(raw: object) -> StanceSpec | None:
    """The ``params.stance`` of a request (None: the template asks no stance); ValueError names the bad field."""
    if raw is None:
        return None
    if not isinstance(raw, dict) or not isinstance(raw.get("cue"), str) or not isinstance(raw.get("labels"), dict):
        raise ValueError(f"params.stance: expected {{'cue': str, 'labels': {{label: value}}}}, got {raw!r}")
    labels = tuple((str(k), float(v)) for k, v in raw["labels"].items())
    if len(labels) < 2:
        raise ValueError(f"params.stance.labels: need at least two labels, got {len(labels)}")
    return StanceSpec(cue=raw["cue"], labels=labels)


def stance_from_logprobs(labels: Sequence[tuple[str, float]], logprobs: Sequence[float]) -> StanceResult:
    """Softmax over the labels' log-probabilities; the stance is the expected label value."""
    top = max(logprobs)
    weights = [math.exp(lp - top) for lp in logprobs]
    total = sum(weights)
    probs = [w / total for w in weights]
    best = max(range(len(labels)), key=lambda i: probs[i])
    return StanceResult(
        stance=sum(p * value for p, (_, value) in zip(probs, labels, strict=True)),
        label=labels[best][0].strip(),  # the word; the scored continuation keeps its space in label_logprobs
        score=probs[best],
        label_logprobs={name: lp for (name, _), lp in zip(labels, logprobs, strict=True)},
    )


def score_stance(model: BatchModel, prompt: str, thesis: str, spec: StanceSpec) -> StanceResult:
    labels = [name for name, _ in spec.labels]
    context = prompt + thesis + spec.cue
    longest = max(len(model.tokenizer.encode_pieces_ids(label)) for label in labels)
    if len(model.tokenizer.encode(context)) + longest > model.max_positions:
        # A thesis that filled the window leaves no room for the cue: judge the thesis alone.
        context = thesis + spec.cue
    return stance_from_logprobs(spec.labels, model.score(context, labels))
