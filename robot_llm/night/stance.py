"""Stance scoring: a thesis's numeric stance from the model's probabilities of label words.

The template asks a stance question (a cue appended to the thesis, e.g. "Stance:") and
names label continuations with values (``bullish: 1.0``, ``bearish: -1.0``...). The model
scores each label's pieces after the cue — from the finished row's live KV cache, during
generation (:class:`robot_llm.llm.generate.Followup`) — and the template's ``method``
turns them into one number per label: ``sum`` (today's summed log-probability, which
penalises labels of more pieces), ``mean`` per piece (length-fair) or the ``first`` piece.

The label prior the model shows whatever the news is divided out by the template's
calibration mode (:data:`CALIBRATION_MODES`): ``content-free`` scores one content-free
context (Zhao et al., "Calibrate Before Use", 2021), ``domain`` the mean over contexts of
random in-domain words (Fei et al., "Mitigating Label Biases for In-context Learning", ACL
2023), each once per template per night; ``batch`` takes the mean label probability of the
night's own rows so far (Zhou et al., "Batch Calibration", ICLR 2024: no pass of its own).
The stance is the expected value under the softmax over the labels, with the argmax label,
its probability and every label's probability kept.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from robot_llm.llm.generate import Completion
    from robot_llm.llm.model import Model
    from robot_llm.llm.scoring import Followup

__all__ = [
    "CALIBRATION_MODES",
    "Calibration",
    "StanceResult",
    "StanceSpec",
    "close_thesis",
    "label_measure",
    "label_pieces",
    "parse_stance_spec",
    "score_stance",
    "softmax",
    "stance_from_logprobs",
    "stance_from_pieces",
]

METHODS = ("sum", "mean", "first")
#: How a template's label prior is estimated and divided out (see the module docstring).
CALIBRATION_MODES = ("none", "content-free", "domain", "batch")


@dataclass(frozen=True)
class StanceSpec:
    """The template's stance question: the cue after the thesis, the labels, how they compare.

    ``calibration`` is the content-free context (ending with the cue) whose label prior is
    divided out, or None; ``mode`` is the calibration mode and ``contexts`` the contexts a
    ``domain`` prior is averaged over.
    """

    cue: str
    labels: tuple[tuple[str, float], ...]
    method: str = "sum"
    calibration: str | None = None
    mode: str = "none"
    contexts: tuple[str, ...] = ()
    after: str = "thesis"  # "prompt": the cue follows the prompt (the news), not the thesis
    anchor: str | None = None  # with after "prompt": the prompt is cut before the last occurrence of this
    news: StanceSpec | None = None  # the news stance asked beside this one (read in the next step)
    store: str = "thesis"  # which of the two is the stored ``stance``
    verdicts: tuple[tuple[str, str], ...] = ()  # label -> the phrase that closes the thesis (see close_thesis)

    def followup(self, hidden: bool = False) -> Followup:
        """The labels as continuations to score after the thesis (or the prompt) and the cue.

        ``hidden``: keep the hidden state where the stance after the prompt (the news's) is read,
        for a stance head (:mod:`robot_llm.night.stance_head`).
        """
        from robot_llm.llm.scoring import Followup

        return Followup(
            self.cue,
            tuple(name for name, _ in self.labels),
            after_prompt=self.after == "prompt",
            anchor=self.anchor,
            then=self.news.followup(hidden) if self.news is not None else None,
            hidden=hidden and self.after == "prompt",
        )

    def news_spec(self, news: dict[str, Any]) -> StanceSpec:
        """The news stance asked beside this one: the prompt cut before ``news['before']``, then ``news['cue']``.

        Calibrated the same way; its content-free and domain contexts are this spec's, cut the same way.
        """
        before, cue = str(news["before"]), str(news["cue"])

        def cut(context: str) -> str:
            at = context.rfind(before)
            return (context[:at] if at >= 0 else context[: -len(self.cue)]) + cue

        return StanceSpec(
            cue=cue,
            labels=self.labels,
            method=self.method,
            calibration=cut(self.calibration) if self.calibration is not None else None,
            mode=self.mode,
            contexts=tuple(cut(c) for c in self.contexts),
            after="prompt",
            anchor=before,
        )

    def prior_contexts(self) -> tuple[str, ...]:
        """The contexts whose label scores make the prior (none for ``batch`` and ``none``)."""
        if self.mode == "domain":
            return self.contexts
        if self.mode == "content-free" and self.calibration is not None:
            return (self.calibration,)
        return ()


@dataclass(frozen=True)
class StanceResult:
    """A thesis's numeric stance: ``stance = Σ p(label)·value``, the argmax label and its probability.

    ``label_logprobs`` are the labels' summed log-probabilities (before any method or
    calibration); ``probs`` each label word's probability after calibration.
    """

    stance: float
    label: str
    score: float
    label_logprobs: dict[str, float]
    probs: dict[str, float] = field(default_factory=dict)


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
    # Requests planned before the modes existed name only the content-free context.
    mode = raw.get("calibration_mode", "content-free" if calibration is not None else "none")
    if mode not in CALIBRATION_MODES:
        modes = ", ".join(CALIBRATION_MODES)
        raise ValueError(f"params.stance.calibration_mode: expected one of {modes}, got {mode!r}")
    contexts = raw.get("calibration_contexts", [])
    if not isinstance(contexts, list) or not all(isinstance(c, str) for c in contexts):
        raise ValueError(f"params.stance.calibration_contexts: expected a list of strings, got {contexts!r}")
    if mode == "content-free" and calibration is None:
        raise ValueError("params.stance.calibration: mode 'content-free' needs the content-free context")
    if mode == "domain" and not contexts:
        raise ValueError("params.stance.calibration_contexts: mode 'domain' needs at least one context")
    after = raw.get("after", "thesis")
    if after not in ("thesis", "prompt"):
        raise ValueError(f"params.stance.after: expected 'thesis' or 'prompt', got {after!r}")
    verdicts = raw.get("verdicts", {})
    if not isinstance(verdicts, dict) or (verdicts and set(verdicts) != {name for name, _ in labels}):
        raise ValueError(f"params.stance.verdicts: expected one phrase per label, got {verdicts!r}")
    spec = StanceSpec(
        cue=raw["cue"],
        labels=labels,
        method=method,
        calibration=calibration,
        mode=mode,
        contexts=tuple(contexts),
        after=after,
        verdicts=tuple((str(k), str(v)) for k, v in verdicts.items()),
    )
    news = raw.get("news")
    if news is None:
        return spec
    if not isinstance(news, dict) or not isinstance(news.get("cue"), str) or not isinstance(news.get("before"), str):
        raise ValueError(f"params.stance.news: expected {{'cue': str, 'before': str}}, got {news!r}")
    store = raw.get("store", "thesis")
    if store not in ("thesis", "news"):
        raise ValueError(f"params.stance.store: expected 'thesis' or 'news', got {store!r}")
    return replace(spec, news=spec.news_spec(news), store=store)


def close_thesis(text: str, spec: StanceSpec, label: str) -> str:
    """The thesis the model wrote (the news's fact), closed with the verdict phrase of the stored ``label``.

    Without verdicts, or for a row with no thesis, the text as written. The model writes up to
    its first stop (``;`` in the templates that close it), the phrase follows: the sentence's
    verdict is the stored stance's by construction.
    """
    phrase = next((v for name, v in spec.verdicts if name.strip() == label), None)
    fact = text.strip().rstrip(";,.: ")
    if phrase is None or not fact:
        return text
    return f"{fact}; {phrase}"


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
    probs = softmax(logprobs)
    best = max(range(len(labels)), key=lambda i: probs[i])
    return StanceResult(
        stance=sum(p * value for p, (_, value) in zip(probs, labels, strict=True)),
        label=labels[best][0].strip(),  # the word; the scored continuation keeps its space in label_logprobs
        score=probs[best],
        label_logprobs={name: lp for (name, _), lp in zip(labels, logprobs, strict=True)},
        probs={name.strip(): p for (name, _), p in zip(labels, probs, strict=True)},
    )


def softmax(scores: Sequence[float]) -> list[float]:
    """Probabilities from log-scores (shifted by their maximum, so no overflow)."""
    top = max(scores)
    weights = [math.exp(s - top) for s in scores]
    total = sum(weights)
    return [w / total for w in weights]


def stance_from_pieces(
    spec: StanceSpec, pieces: Sequence[Sequence[float]], prior: Sequence[float] | None = None
) -> StanceResult:
    """The stance from each label's piece log-probabilities, by the spec's method, less the ``prior`` log-scores."""
    scores = [label_measure(p, spec.method) for p in pieces]
    if prior is not None:
        scores = [s - q for s, q in zip(scores, prior, strict=True)]
    result = stance_from_logprobs(spec.labels, scores)
    sums = {name: float(sum(p)) for (name, _), p in zip(spec.labels, pieces, strict=True)}
    return StanceResult(
        stance=result.stance, label=result.label, score=result.score, label_logprobs=sums, probs=result.probs
    )


def _mean_log_prior(rows: Sequence[Sequence[float]]) -> list[float]:
    """``log`` of the mean label distribution of ``rows`` (label log-scores each): the prior to divide out."""
    dists = [softmax(r) for r in rows]
    return [math.log(max(sum(d[i] for d in dists) / len(dists), 1e-300)) for i in range(len(rows[0]))]


@dataclass
class Calibration:
    """A night's label priors: scored contexts (once each per template per night), and the batch's running mean.

    ``priors`` keeps the content-free and domain priors; ``seen`` the label log-scores of every
    row scored so far, per stance question, for ``batch`` calibration (the night's rows up to
    and including the batch being stored: a row's stance never depends on rows after it).
    """

    priors: dict[tuple[Any, ...], list[float]] = field(default_factory=dict)
    seen: dict[tuple[Any, ...], list[list[float]]] = field(default_factory=dict)
    passes: int = 0
    names: dict[tuple[Any, ...], tuple[str, StanceSpec]] = field(default_factory=dict)

    def measured(self) -> dict[str, dict[str, dict[str, float]]]:
        """What the night measured per template: each label's log mean probability over its rows (``rows``),
        and the scored prior (``prior``, log-probabilities over the labels) when the mode scores one.

        ``doctor`` reads these from the run's counts: a label below about −5 never wins.
        """
        out: dict[str, dict[str, dict[str, float]]] = {}
        for key, (name, spec) in self.names.items():
            labels = [label for label, _ in spec.labels]
            entry = {"rows": dict(zip(labels, _mean_log_prior(self.seen[key]), strict=True))}
            contexts = spec.prior_contexts()
            prior_key = (contexts, spec.method, tuple(labels))
            if contexts and prior_key in self.priors:
                entry["prior"] = dict(zip(labels, _mean_log_prior([self.priors[prior_key]]), strict=True))
            out[name] = {k: {label: round(v, 3) for label, v in d.items()} for k, d in entry.items()}
        return out

    def prior(self, model: Model, spec: StanceSpec) -> list[float] | None:
        """The spec's scored-context label prior (None for ``none`` and ``batch``)."""
        contexts = spec.prior_contexts()
        if not contexts:
            return None
        labels = tuple(name for name, _ in spec.labels)
        key = (contexts, spec.method, labels)
        if key not in self.priors:
            rows = []
            for context in contexts:
                pieces = model.score_pieces(context, list(labels))
                self.passes += 1
                rows.append([label_measure(p, spec.method) for p in pieces])
            self.priors[key] = _mean_log_prior(rows)
        return self.priors[key]

    def stances(
        self,
        model: Model,
        scored: Sequence[tuple[StanceSpec, Sequence[Sequence[float]]] | None],
        names: Sequence[str] | None = None,
    ) -> list[StanceResult | None]:
        """The stance of every row of a batch from its label pieces (None rows ask none), calibrated by its spec.

        ``names`` (the rows' template names) label what :meth:`measured` reports.
        """
        for i, item in enumerate(scored):
            if item is not None:
                spec, pieces = item
                key = (spec.cue, spec.method, spec.labels, spec.after)
                self.seen.setdefault(key, []).append([label_measure(p, spec.method) for p in pieces])
                if names is not None:
                    self.names.setdefault(key, (names[i], spec))
        out: list[StanceResult | None] = []
        for item in scored:
            if item is None:
                out.append(None)
                continue
            spec, pieces = item
            if spec.mode == "batch":
                prior: list[float] | None = _mean_log_prior(self.seen[(spec.cue, spec.method, spec.labels, spec.after)])
            else:
                prior = self.prior(model, spec)
            out.append(stance_from_pieces(spec, pieces, prior))
        return out


def label_pieces(
    model: Model, prompt: str, completion: Completion, spec: StanceSpec, *, news: bool = False
) -> list[list[float]]:
    """The label pieces' log-probabilities after ``completion``'s thesis and the cue (``news``: the news stance's).

    Uses those generation read from the row's cache; a thesis that filled the window (no room
    for the cue) is judged alone, re-scored without the prompt.
    """
    labels = [name for name, _ in spec.labels]
    followup = spec.followup()
    pieces = completion.followup_logprobs
    if news:
        assert followup.then is not None
        followup, pieces = followup.then, completion.then_logprobs
    context = followup.context(prompt, completion.text)
    longest = max(len(model.tokenizer.encode_pieces_ids(label)) for label in labels)
    if pieces is None or len(model.tokenizer.encode(context)) + longest > model.max_positions:
        # A stance after the prompt fits whenever the prompt did; a thesis too long is judged alone.
        alone = context if followup.after_prompt else followup.context("", completion.text)
        return [list(p) for p in model.score_pieces(alone, labels)]
    return [list(p) for p in pieces]


def score_stance(
    model: Model, prompt: str, completion: Completion, spec: StanceSpec, calibration: Calibration
) -> StanceResult:
    """The stance of ``completion``'s thesis after ``prompt``, calibrated as its spec says (one row alone)."""
    result = calibration.stances(model, [(spec, label_pieces(model, prompt, completion, spec))])[0]
    assert result is not None
    return result
