"""A stance head: a small classifier on the model's own hidden state where the news stance is read.

A 270M base model's label words follow the news only loosely; its hidden state at the stance
cue (the token whose logits predict the labels) carries far more of it. A head is a
multinomial logistic regression on that state, RMS-normalised (the final norm's direction;
its per-feature gain is folded into the weights), trained on licence-clean public labelled
news by ``benchmarks/stance_head.py`` and stored as a small JSON file beside the weight store
(:data:`HEAD_FILE`). It belongs to one set of weights (the runtime's model id, which pins
the store's manifest) and to named templates (name and version: the context the state is read
after); the night uses it only where both match, and otherwise keeps the label-word stance.

The hidden state comes from the same weight pass that scores the labels
(:attr:`robot_llm.llm.scoring.Followup.hidden`): the head costs no pass of its own.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from robot_llm.night.stance import StanceResult, stance_from_logprobs

__all__ = ["FORMAT", "HEAD_FILE", "StanceHead", "TemplateHead", "find_head", "load_head", "weights_id"]

#: The head's file name, beside the store's ``manifest.json``.
HEAD_FILE = "stance_head.json"
FORMAT = "robot-llm-stance-head/1"


@dataclass(frozen=True)
class TemplateHead:
    """One template's head: ``logits = weights · (h / rms(h)) + bias`` over its labels (label, value)."""

    version: str
    labels: tuple[tuple[str, float], ...]
    weights: tuple[tuple[float, ...], ...]  # one row of hidden_size per label
    bias: tuple[float, ...]

    def stance(self, hidden: Sequence[float]) -> StanceResult:
        """The stance of one hidden state: the softmax of the head's logits, its expected label value."""
        if len(hidden) != len(self.weights[0]):
            raise ValueError(f"the hidden state has {len(hidden)} values, the head takes {len(self.weights[0])}")
        rms = math.sqrt(sum(v * v for v in hidden) / len(hidden)) or 1.0
        logits = [
            b + sum(w * v for w, v in zip(row, hidden, strict=True)) / rms
            for row, b in zip(self.weights, self.bias, strict=True)
        ]
        top = max(logits)
        norm = top + math.log(sum(math.exp(x - top) for x in logits))
        return stance_from_logprobs(self.labels, [x - norm for x in logits])


@dataclass(frozen=True)
class StanceHead:
    """A head file: the weights it was trained on (``model``: preset/dtype@digest) and its templates' heads."""

    model: str
    templates: dict[str, TemplateHead]
    source: str = ""  # what it was trained on (data, rows, script): shown by the night's log

    def for_template(self, name: str, version: str) -> TemplateHead | None:
        """The head of this template at this version (None: the template's label-word stance stays)."""
        head = self.templates.get(name)
        return head if head is not None and head.version == version else None


def weights_id(model_id: str) -> str:
    """The weights' part of a night's model id (``name:preset/dtype@digest`` -> ``preset/dtype@digest``)."""
    return model_id.rsplit(":", 1)[-1]


def load_head(path: Path) -> StanceHead:
    """Read a head file; ValueError naming the file and the field that is wrong."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: not a readable stance head ({exc})") from exc
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        found = data.get("format") if isinstance(data, dict) else type(data).__name__
        raise ValueError(f"{path}: format: expected {FORMAT!r}, got {found!r}")
    if not isinstance(data.get("model"), str) or not isinstance(data.get("templates"), dict):
        raise ValueError(f"{path}: expected 'model' (the weights' id) and 'templates' (name -> head)")
    templates = {}
    for name, raw in data["templates"].items():
        where = f"{path}: templates.{name}"
        try:
            labels = tuple((str(k), float(v)) for k, v in raw["labels"].items())
            weights = tuple(tuple(float(x) for x in row) for row in raw["weights"])
            bias = tuple(float(x) for x in raw["bias"])
            version = str(raw["version"])
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ValueError(f"{where}: expected version, labels, weights and bias ({exc!r})") from exc
        if not (len(labels) == len(weights) == len(bias) >= 2) or len({len(r) for r in weights}) != 1:
            raise ValueError(f"{where}: one weight row and one bias per label, all rows of one length")
        templates[name] = TemplateHead(version, labels, weights, bias)
    return StanceHead(model=data["model"], templates=templates, source=str(data.get("source", "")))


def find_head(store: Path | None, model_id: str) -> StanceHead | None:
    """The head beside ``store`` when there is one for these weights (None: no file, or other weights')."""
    if store is None or not (store / HEAD_FILE).is_file():
        return None
    head = load_head(store / HEAD_FILE)
    return head if head.model == weights_id(model_id) else None
