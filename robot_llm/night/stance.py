"""Stance scoring: a thesis's numeric stance from the model's probabilities of label words.

The template asks a stance question (a cue appended to the thesis, e.g. "Stance:") and
names label continuations with values (``bullish: 1.0``, ``bearish: -1.0``...). The model
scores each label's pieces after the cue — from the finished row's live KV cache, during
generation (:class:`robot_llm.llm.generate.Followup`) — and the template's ``method``
turns them into one number per label: ``sum`` (today's summed log-probability, which
penalises labels of more pieces), ``mean`` per piece (length-fair) or the ``first`` piece.
With calibration the label prior of a content-free prompt, scored once per template per
night, is divided out (Zhao et al., "Calibrate Before Use", 2021). The stance is the
expected value under the softmax over the labels, with the argmax label and its
probability kept for display.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from robot_llm.llm.generate import Completion
    from robot_llm.llm.scoring import Followup
    from robot_llm.night.model import BatchModel

__all__ = [
    "Calibration",
    "StanceResult",
    "StanceSpec",
    "label_measure",
    "parse_stance_spec",
    "score_stance",
    "stance_from_logprobs",
    "stance_from_pieces",
]

METHODS = ("sum", "mean", "first")


@dataclass(frozen=True)
class StanceSpec:
    """The template's stance question: the cue after the thesis, the labels, how they compare.

    ``calibration`` is the content-free context (ending with the cue) whose label prior is
    divided out, or None.
    """

    cue: str
    labels: tuple[tuple[str, float], ...]
    method: str = "sum"
    calibration: str | None = None

    def followup(self) -> Followup:
        """The labels as continuations to score after the thesis and the cue."""
        from robot_llm.llm.scoring import Followup

        return Followup(self.cue, tuple(name for name, _ in self.labels))


@dataclass(frozen=True)
class StanceResult:
    """A thesis's numeric stance: ``stance = Σ p(label)·value``, the argmax label and its probability.

    ``label_logprobs`` are the labels' summed log-probabilities (before any method or calibration).
    """

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
    method = raw.get("method", "sum")
    if method not in METHODS:
        raise ValueError(f"params.stance.method: expected one of {', '.join(METHODS)}, got {method!r}")
    calibration = raw.get("calibration")
    if calibration is not None and not isinstance(calibration, str):
        raise ValueError(f"params.stance.calibration: expected the content-free context, got {calibration!r}")
    return StanceSpec(cue=raw["cue"], labels=labels, method=method, calibration=calibration)


def label_measure(pieces: Sequence[float], method: str) -> float:
    """One label's log-score from its pieces' log-probabilities: their sum, mean or the first one."""
    if not pieces:
        return 0.0
    if method == "mean":
        return sum(pieces) / len(pieces)
    if method == "first":
        return pieces[0]
    return sum(pieces)


def stance_from_logprobs(labels: Sequence[tuple[str, float]], logprobs: Sequence[float]) -> StanceResult:
    """Softmax over the labels' log-scores; the stance is the expected label value."""
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


def stance_from_pieces(
    spec: StanceSpec, pieces: Sequence[Sequence[float]], prior: Sequence[float] | None = None
) -> StanceResult:
    """The stance from each label's piece log-probabilities, by the spec's method, less the ``prior`` log-scores."""
    scores = [label_measure(p, spec.method) for p in pieces]
    if prior is not None:
        scores = [s - q for s, q in zip(scores, prior, strict=True)]
    result = stance_from_logprobs(spec.labels, scores)
    sums = {name: float(sum(p)) for (name, _), p in zip(spec.labels, pieces, strict=True)}
    return StanceResult(stance=result.stance, label=result.label, score=result.score, label_logprobs=sums)


@dataclass
class Calibration:
    """Label priors of content-free contexts, scored once each (one per template per night) and kept."""

    priors: dict[tuple[str, str, tuple[str, ...]], list[float]] = field(default_factory=dict)
    passes: int = 0

    def prior(self, model: BatchModel, spec: StanceSpec) -> list[float] | None:
        """The spec's content-free label log-scores (None when it asks for no calibration)."""
        if spec.calibration is None:
            return None
        labels = tuple(name for name, _ in spec.labels)
        key = (spec.calibration, spec.method, labels)
        if key not in self.priors:
            pieces = model.score_pieces(spec.calibration, list(labels))
            self.passes += 1
            self.priors[key] = [label_measure(p, spec.method) for p in pieces]
        return self.priors[key]


def score_stance(
    model: BatchModel, prompt: str, completion: Completion, spec: StanceSpec, calibration: Calibration
) -> StanceResult:
    """The stance of ``completion``'s thesis after ``prompt``.

    Uses the label log-probabilities generation read from the row's cache; a thesis that
    filled the window (no room for the cue) is judged alone, re-scored without the prompt.
    """
    labels = [name for name, _ in spec.labels]
    context = prompt + completion.text + spec.cue
    longest = max(len(model.tokenizer.encode_pieces_ids(label)) for label in labels)
    pieces = completion.followup_logprobs
    if pieces is None or len(model.tokenizer.encode(context)) + longest > model.max_positions:
        pieces = tuple(tuple(p) for p in model.score_pieces(completion.text + spec.cue, labels))
    return stance_from_pieces(spec, pieces, calibration.prior(model, spec))
