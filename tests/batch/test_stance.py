"""Calibrated, length-fair stance: the template's method, the content-free prior, doctor's label check."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from batch_helpers import TINY, TINY_TEMPLATE, VOCAB

from robot_llm.llm import generate as gen
from robot_llm.llm import scoring
from robot_llm.llm.engine.memory import Yalm
from robot_llm.llm.tokenizer import YalmTokenizer
from robot_llm.night.plan import plan_night
from robot_llm.night.preflight import preflight
from robot_llm.night.stance import StanceSpec, label_measure, parse_stance_spec, stance_from_pieces
from robot_llm.night.worker import run_queue
from robot_llm.prompting.loading import load_template
from robot_llm.prompting.stance_prompt import content_free_context, stance_label_problems
from robot_llm.prompting.template import TemplateError

CALIBRATED = TINY_TEMPLATE.replace('name: tiny\nversion: "1"', 'name: tiny\nversion: "2"').replace(
    '    " flat": 0\n', '    " flat": 0\n  method: mean\n  calibrate: true\n'
)
LABELS = ((" up", 1.0), (" down", -1.0), (" flat", 0.0))


def _template(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "tiny.j2"
    path.write_text(text, encoding="utf-8")
    return path


def test_methods_compare_labels_of_different_lengths_fairly() -> None:
    # One piece at -2.0 against four pieces at -1.0 each: the sum prefers the short label, the mean the long one.
    pieces = [[-2.0], [-1.0, -1.0, -1.0, -1.0], [-3.0, -3.0]]
    assert [label_measure(p, "sum") for p in pieces] == [-2.0, -4.0, -6.0]
    assert [label_measure(p, "mean") for p in pieces] == [-2.0, -1.0, -3.0]
    assert [label_measure(p, "first") for p in pieces] == [-2.0, -1.0, -3.0]
    raw = stance_from_pieces(StanceSpec(" so", LABELS, "sum"), pieces)
    fair = stance_from_pieces(StanceSpec(" so", LABELS, "mean"), pieces)
    assert raw.label == "up" and fair.label == "down"
    # label_logprobs stay the summed log-probabilities whatever the method.
    assert fair.label_logprobs == {" up": -2.0, " down": -4.0, " flat": -6.0}


def test_calibration_divides_out_the_content_free_prior() -> None:
    spec = StanceSpec(" so", LABELS, "mean", calibration="N/A so")
    pieces = [[-1.0], [-3.0], [-2.0]]
    plain = stance_from_pieces(spec, pieces)
    assert plain.label == "up"
    # The model prefers " up" by 2.5 nats whatever the news: divided out, " flat" leads.
    calibrated = stance_from_pieces(spec, pieces, prior=[-0.5, -3.0, -2.5])
    assert calibrated.label == "flat"
    probs = [math.exp(-0.5), math.exp(0.0), math.exp(0.5)]
    assert calibrated.score == pytest.approx(max(probs) / sum(probs))
    assert calibrated.stance == pytest.approx((probs[0] - probs[1]) / sum(probs))


def test_request_params_name_the_method(tmp_path: Path) -> None:
    spec = parse_stance_spec({"cue": " so", "labels": {" up": 1, " down": -1}})
    assert spec is not None and (spec.method, spec.calibration) == ("sum", None)  # requests planned before
    with pytest.raises(ValueError, match=r"params\.stance\.method"):
        parse_stance_spec({"cue": " so", "labels": {" up": 1, " down": -1}, "method": "median"})
    bad = CALIBRATED.replace("method: mean", "method: median")
    with pytest.raises(TemplateError, match=r"tiny.j2:\d+: stance.method"):
        load_template(_template(tmp_path, bad))


def test_label_split_check(tmp_path: Path) -> None:
    tokenizer = YalmTokenizer(VOCAB)
    pieces = {label: len(tokenizer.encode_pieces_ids(label)) for label, _ in LABELS}
    assert len(set(pieces.values())) > 1  # the fixture vocabulary splits them unevenly
    errors, warnings = stance_label_problems(load_template(_template(tmp_path, TINY_TEMPLATE)), tokenizer)
    assert errors == [] and len(warnings) == 1 and "split unevenly" in warnings[0] and "'mean'" in warnings[0]
    first = CALIBRATED.replace("method: mean", "method: first")
    errors, _ = stance_label_problems(load_template(_template(tmp_path, first)), tokenizer)
    assert len(errors) == 1 and "one distinct piece" in errors[0]


def test_content_free_context_has_no_data(tmp_path: Path, night) -> None:  # type: ignore[no-untyped-def]
    from zoneinfo import ZoneInfo

    template = load_template(_template(tmp_path, CALIBRATED))
    context = content_free_context(template, night, ZoneInfo("UTC"))
    assert context == "N/A:\n N/A so"  # the prompt (no news) as rendered, a thesis of N/A, the cue


def test_doctor_warns_about_unevenly_split_labels(benv) -> None:  # type: ignore[no-untyped-def]
    check = {c.name: c for c in preflight(benv.config())}["templates"]
    assert check.ok is True and check.warning and "split unevenly" in check.message
    assert check.line().startswith("warn templates:")


def test_a_calibrated_night_scores_the_prior_once(benv, night, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    (benv.prompts_dir / "tiny.j2").write_text(CALIBRATED, encoding="utf-8")
    config = benv.config(model={"max_batch_size": 1})  # three batches, one night
    assert plan_night(config, benv.engine, night).created == 3
    rescored: list[str] = []
    real = scoring.score_pieces

    def counting(model, tokenizer, prompt, continuations, **kw):  # type: ignore[no-untyped-def]
        rescored.append(prompt)
        return real(model, tokenizer, prompt, continuations, **kw)

    real_rescore = gen._rescore

    def rescoring(rows, *args, **kw):  # type: ignore[no-untyped-def]
        rescored.extend(r.prompt for r in rows)  # a thesis the cache could not serve
        return real_rescore(rows, *args, **kw)

    monkeypatch.setattr(gen, "_rescore", rescoring)
    monkeypatch.setattr(scoring, "score_pieces", counting)  # the runtime's re-prefill (the calibration)
    summary = run_queue(config, benv.engine, as_of=night, progress=False, preflight=False)
    assert summary.done == 3
    # Labels were read from each row's cache; only the content-free prior was scored, once.
    (calibration,) = {r.params["stance"]["calibration"] for r in benv.requests()}
    assert rescored == [calibration] and calibration == "N/A:\n N/A so"

    model = Yalm.from_release(str(TINY / "weights"), _tiny_config())
    tokenizer = YalmTokenizer(VOCAB)
    labels = [name for name, _ in LABELS]
    prior = [sum(p) / len(p) for p in real(model, tokenizer, calibration, labels)]
    requests = {r.id: r for r in benv.requests()}
    for t in benv.theses():
        pieces = real(model, tokenizer, requests[t.request_id].prompt + t.text + " so", labels)
        want = stance_from_pieces(StanceSpec(" so", LABELS, "mean"), pieces, prior)
        assert t.stance == pytest.approx(want.stance, abs=1e-3) and t.stance_label == want.label
        assert t.label_logprobs == pytest.approx(want.label_logprobs, abs=1e-3)


def _tiny_config():  # type: ignore[no-untyped-def]
    from robot_llm.llm.families.yalm import YalmConfig

    return YalmConfig.from_json(TINY / "config.json")
