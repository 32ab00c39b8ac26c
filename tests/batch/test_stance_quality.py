"""A stance a trader can trust: no inputs -> explicit abstention, checks flagged on the row, calibration modes,
example order per prompt, doctor's stance warnings. Real SQLite / PostgreSQL, the tiny YaLM fixture."""

from __future__ import annotations

import math
from datetime import timedelta
from pathlib import Path

import pytest
from batch_helpers import TINY_TEMPLATE

from robot_llm.forecasts import Forecasts
from robot_llm.night.plan import plan_night
from robot_llm.night.stance import Calibration, StanceSpec, parse_stance_spec, softmax
from robot_llm.night.worker import run_queue
from robot_llm.prompting.context import example_variant
from robot_llm.prompting.loading import load_template
from robot_llm.prompting.template import TemplateError
from robot_llm.store.db import NewsItem, NewsTicker, Signal, session_scope
from robot_llm.thesis.checks import (
    FLAG_ECHO,
    FLAG_EXAMPLE,
    FLAG_REPEATED,
    degeneration_flags,
    thesis_direction,
)
from robot_llm.thesis.priors import prior_warnings, template_warnings

REPO = Path(__file__).resolve().parents[2]
LABELS = ((" up", 1.0), (" down", -1.0), (" flat", 0.0))


def _news(benv, night, ticker: str, title: str, key: str) -> int:  # type: ignore[no-untyped-def]
    with session_scope(benv.engine) as s:
        item = NewsItem(
            feed="wire", item_key=key, title=title, summary="", fetched_at=night - timedelta(hours=2), content_hash=key
        )
        item.tickers.append(NewsTicker(ticker=ticker))
        s.add(item)
        s.flush()
        return item.id


def test_no_inputs_is_an_explicit_abstention_without_generation(benv, night) -> None:  # type: ignore[no-untyped-def]
    config = benv.config(prompts={"abstain_without_inputs": True})
    _news(benv, night, "T000", "Company 0 raises its dividend", "k0")
    with session_scope(benv.engine) as s:  # T001 has a signal and no news: it still gets a thesis
        s.add(
            Signal(
                ticker="T001",
                generated_at=night - timedelta(hours=3),
                received_at=night - timedelta(hours=3),
                horizon="1d",
                direction=1,
                model="robot",
                source="test",
            )
        )
    plan = plan_night(config, benv.engine, night)
    assert (plan.created, plan.no_news, plan.no_inputs) == (3, 2, 1)
    ((template, reason),) = plan.no_news_reasons
    assert template == "tiny" and "tagged" in reason  # news was fetched in time, none names T001/T002

    summary = run_queue(config, benv.engine, as_of=night, progress=False, preflight=False)
    assert summary.done == 3
    theses = {t.ticker: t for t in benv.theses()}
    abstained = theses["T002"]
    assert (abstained.kind, abstained.text, abstained.stance, abstained.stance_label) == ("no_inputs", "", None, None)
    assert abstained.completion_tokens == 0 and abstained.finish_reason == "abstain"
    assert abstained.available_at >= night  # point-in-time like any thesis
    for ticker in ("T000", "T001"):
        assert theses[ticker].kind == "thesis" and theses[ticker].stance is not None
        assert set(theses[ticker].stance_probs) == {"up", "down", "flat"}
        assert math.isclose(sum(theses[ticker].stance_probs.values()), 1.0, rel_tol=1e-9)
        assert theses[ticker].text_stance == theses[ticker].stance

    forecasts = Forecasts.open(benv.db_url)
    try:
        record = forecasts.latest("T002", abstained.available_at + timedelta(seconds=1))
        assert record is not None and record.abstained and record.stance is None
        assert not forecasts.latest("T000", theses["T000"].available_at + timedelta(seconds=1)).abstained
    finally:
        forecasts.close()


def test_the_worker_abstains_without_running_the_model(benv, night, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from robot_llm.night import worker

    config = benv.config(prompts={"abstain_without_inputs": True})
    plan_night(config, benv.engine, night)

    class NoModel:
        model_id = "none"

        def generate(self, *args, **kwargs):  # type: ignore[no-untyped-def]
            raise AssertionError("a prompt without inputs must not be generated")

        def close(self) -> None:
            pass

    monkeypatch.setattr(worker, "open_configured_model", lambda *_args, **_kwargs: NoModel())
    summary = run_queue(config, benv.engine, as_of=night, progress=False, preflight=False)
    assert (summary.done, summary.failed, summary.new_tokens) == (3, 0, 0)
    assert {t.kind for t in benv.theses()} == {"no_inputs"}


def test_plan_says_why_a_night_has_no_news(benv, night) -> None:  # type: ignore[no-untyped-def]
    config = benv.config(prompts={"abstain_without_inputs": True})
    with session_scope(benv.engine) as s:  # fetched after the cut-off: the first fetch of the morning
        item = NewsItem(
            feed="wire",
            item_key="late",
            title="T000 news",
            summary="",
            fetched_at=night + timedelta(minutes=30),
            content_hash="late",
        )
        item.tickers.append(NewsTicker(ticker="T000"))
        s.add(item)
    plan = plan_night(config, benv.engine, night)
    assert plan.no_inputs == 3
    assert "after it" in plan.no_news_reasons[0][1] and "--as-of now" in plan.no_news_reasons[0][1]


def test_flags_on_rows_and_counted_in_the_run(benv, night) -> None:  # type: ignore[no-untyped-def]
    config = benv.config()
    for i in range(3):
        _news(benv, night, f"T00{i}", f"Company {i} raises its dividend", f"k{i}")
    plan_night(config, benv.engine, night)
    summary = run_queue(config, benv.engine, as_of=night, progress=False, preflight=False)
    assert summary.done == 3
    theses = benv.theses()
    run = benv.runs()[-1]
    counted: dict[str, int] = {}
    for t in theses:
        for flag in t.flags:
            counted[flag] = counted.get(flag, 0) + 1
    assert run.counts["flags"] == counted
    from robot_llm.report.summary import build_report, format_report

    report = build_report(config, benv.engine, run.started_at.astimezone(config.tz).date())
    assert report.stance_flags() == counted
    if counted:
        assert "theses flagged: " in format_report(report, config)
    texts = [t.text for t in theses]
    repeats = sum(1 for i, x in enumerate(texts) if x.strip() and x in texts[:i])
    assert counted.get(FLAG_REPEATED, 0) >= repeats  # every later copy of a sentence is flagged
    assert "tiny" in run.counts["label_priors"] and set(run.counts["label_priors"]["tiny"]["rows"]) == {
        " up",
        " down",
        " flat",
    }


def test_thesis_direction_reads_the_verdict_in_both_languages() -> None:
    assert thesis_direction("The loss weighs on the stock, which is likely to fall.", "en") == -1
    assert thesis_direction("Higher exports support demand for the shares, which may rise.", "en") == 1
    assert thesis_direction("Southern Steel reported a loss; the shares may rise.", "en") == 1  # the last clause wins
    assert thesis_direction("Nothing in it changes the outlook, the shares may stay flat.", "en") == 0
    assert thesis_direction("Company X holds a meeting.", "en") is None
    assert thesis_direction("Рост экспорта поддерживает спрос, акции могут подорожать.", "ru") == 1
    assert thesis_direction("Убыток давит на котировки, акции, вероятно, подешевеют.", "ru") == -1


def test_degeneration_flags() -> None:
    prompt = (
        "Company: Southern Steel\nNews:\n- Southern Steel reported a loss.\nThesis: The loss weighs on the stock, "
        "which is likely to fall.\n\nCompany: Acme\nNews:\n- Acme opens a plant in Ohio.\nThesis:"
    )
    news = ["Acme opens a plant in Ohio."]
    assert degeneration_flags(" The loss weighs on the stock, which is likely to fall.", prompt, news, []) == [
        FLAG_EXAMPLE
    ]
    assert degeneration_flags(" Acme opens a plant in Ohio.", prompt, news, []) == [FLAG_ECHO]
    assert degeneration_flags(" A new plant adds capacity.", prompt, news, ["a new plant adds capacity"]) == [
        FLAG_REPEATED
    ]
    assert degeneration_flags(" The Ohio plant adds capacity, which supports the shares.", prompt, news, []) == []

    # The prompt shows the headline only, the stored item has a summary too; the night closed the
    # thesis with its verdict phrase (stance.verdicts): the model's own words are the headline, an echo.
    shown = "Company: Southern Steel\nNews:\n- Southern Steel reported a loss\nThesis:"
    item = ["Southern Steel reported a loss. The blast furnace stops for a month."]
    verdicts = ["this weighs on the shares, they may fall.", "this supports the shares, they may rise."]
    closed = "Southern Steel reported a loss; this weighs on the shares, they may fall."
    assert degeneration_flags(closed, shown, item, [], verdicts) == [FLAG_ECHO]
    assert degeneration_flags(closed, shown, item, [], []) == []  # the phrase counted: not half a copy
    # Two instruments whose facts differ are no repeat, though both end with the same verdict.
    other = "Northern Timber cut its dividend; this weighs on the shares, they may fall."
    assert degeneration_flags(other, shown, item, [closed], verdicts) == []
    assert degeneration_flags(closed, shown, item, [closed], verdicts) == [FLAG_ECHO, FLAG_REPEATED]


def test_batch_calibration_divides_out_the_nights_mean_so_far() -> None:
    spec = StanceSpec(" so", LABELS, "sum", mode="batch")
    rows = [[[-0.1], [-3.0], [-4.0]], [[-0.5], [-1.5], [-4.0]]]
    calibration = Calibration()
    got = calibration.stances(None, [(spec, r) for r in rows])  # type: ignore[arg-type]
    dists = [softmax([p[0] for p in r]) for r in rows]
    prior = [math.log(sum(d[i] for d in dists) / 2) for i in range(3)]
    for r, st in zip(rows, got, strict=True):
        assert st is not None
        want = softmax([p[0] - q for p, q in zip(r, prior, strict=True)])
        assert st.probs == pytest.approx(dict(zip(["up", "down", "flat"], want, strict=True)))
    # A later batch sees the mean of every row so far, never one after it.
    later = calibration.stances(None, [(spec, [[-2.0], [-0.2], [-4.0]])])[0]  # type: ignore[arg-type]
    assert later is not None and later.probs != got[0].probs  # type: ignore[union-attr]
    assert len(calibration.seen[(" so", "sum", LABELS, "thesis")]) == 3


def test_calibration_modes_in_requests_and_templates(tmp_path: Path) -> None:
    base = {"cue": " so", "labels": {" up": 1, " down": -1}}
    assert parse_stance_spec({**base, "calibration": "N/A so"}).mode == "content-free"  # type: ignore[union-attr]
    assert parse_stance_spec({**base, "calibration_mode": "batch"}).prior_contexts() == ()  # type: ignore[union-attr]
    with pytest.raises(ValueError, match="calibration_contexts"):
        parse_stance_spec({**base, "calibration_mode": "domain"})
    with pytest.raises(ValueError, match="calibration_mode"):
        parse_stance_spec({**base, "calibration_mode": "magic"})
    bad = TINY_TEMPLATE.replace('    " flat": 0\n', '    " flat": 0\n  calibrate: true\n  calibration: batch\n')
    path = tmp_path / "tiny.j2"
    path.write_text(bad, encoding="utf-8")
    with pytest.raises(TemplateError, match="contradicts"):
        load_template(path)


def test_a_domain_calibrated_night_averages_random_in_domain_words(benv, night) -> None:  # type: ignore[no-untyped-def]
    text = TINY_TEMPLATE.replace('    " flat": 0\n', '    " flat": 0\n  calibration: domain\n  domain_samples: 3\n')
    (benv.prompts_dir / "tiny.j2").write_text(text, encoding="utf-8")
    config = benv.config()
    _news(benv, night, "T000", "dividend raised again", "k0")
    plan_night(config, benv.engine, night)
    (contexts,) = {tuple(r.params["stance"]["calibration_contexts"]) for r in benv.requests()}
    assert len(contexts) == 3 and len(set(contexts)) > 1
    for context in contexts:
        assert context.endswith(" so") and "N/A" in context
        assert {w for w in context.replace(":", " ").split() if w not in ("N/A", "so")} <= {
            "dividend",
            "raised",
            "again",
        }
    assert run_queue(config, benv.engine, as_of=night, progress=False, preflight=False).done == 3


@pytest.mark.parametrize("name", ["brief_en", "brief_ru", "stance_en", "stance_ru"])
def test_shipped_examples_are_balanced_and_no_verdict_always_comes_last(name: str, night) -> None:  # type: ignore[no-untyped-def]
    from zoneinfo import ZoneInfo

    from robot_llm.prompting.context import InstrumentView, RenderContext
    from robot_llm.prompting.render import render_prompt

    template = load_template(REPO / "prompts" / f"{name}.j2")
    assert template.stance is not None and template_warnings(template) == []
    cue = template.stance.cue.strip()
    last: set[str] = set()
    for i in range(30):
        ticker = f"X{i:02d}"
        context = RenderContext(
            instrument=InstrumentView(ticker, ticker, (), None),
            as_of=night.astimezone(ZoneInfo("UTC")),
            language=template.language,
            news=(),
            signals=(),
            variant=example_variant(ticker, night),
        )
        verdicts = [
            line.split(":", 1)[1].strip()
            for line in render_prompt(template, context).splitlines()
            if line.startswith(cue)
        ]
        assert sorted(verdicts) == sorted(label.strip() for label in template.stance.labels)  # one example each
        last.add(verdicts[-1])
    assert last == {label.strip() for label in template.stance.labels}


def test_doctor_warns_about_no_neutral_example_and_priors_that_never_win(tmp_path: Path) -> None:
    path = tmp_path / "tiny.j2"
    path.write_text(TINY_TEMPLATE, encoding="utf-8")  # labels up/down/flat, no worked example at all
    (warning,) = template_warnings(load_template(path))
    assert "neutral label" in warning and "' flat'" in warning
    no_zero = TINY_TEMPLATE.replace('    " flat": 0\n', "")
    path.write_text(no_zero, encoding="utf-8")
    assert "value 0" in template_warnings(load_template(path))[0]
    priors = {"tiny": {"rows": {" up": -0.1, " down": -2.5, " flat": -6.6}, "prior": {" up": -0.2, " flat": -4.0}}}
    (line,) = prior_warnings(priors, {"tiny"})
    assert "' flat' -6.6" in line and "never win" in line
    assert prior_warnings(priors, {"other"}) == []


def test_doctor_reads_the_last_nights_priors(benv, night) -> None:  # type: ignore[no-untyped-def]
    from robot_llm.night.preflight import preflight

    config = benv.config()
    check = {c.name: c for c in preflight(config)}["stance"]
    assert check.ok is None and "no night" in check.message
    plan_night(config, benv.engine, night)
    run_queue(config, benv.engine, as_of=night, progress=False, preflight=False)
    check = {c.name: c for c in preflight(config)}["stance"]
    assert check.ok is True
    measured = benv.runs()[-1].counts["label_priors"]["tiny"]["rows"]
    assert check.warning == any(v < -5 for v in measured.values())


def test_the_news_stance_is_read_beside_the_thesis_and_stored_when_asked(benv, night) -> None:  # type: ignore[no-untyped-def]
    from batch_helpers import TINY, VOCAB

    from robot_llm.llm.engine.memory import Yalm
    from robot_llm.llm.families.yalm import YalmConfig
    from robot_llm.llm.scoring import score_pieces
    from robot_llm.llm.tokenizer import YalmTokenizer
    from robot_llm.night.stance import stance_from_pieces

    news = '  news:\n    cue: " so"\n    before: ":"\n  store: news\n'
    (benv.prompts_dir / "tiny.j2").write_text(
        TINY_TEMPLATE.replace('    " flat": 0\n', '    " flat": 0\n' + news), encoding="utf-8"
    )
    config = benv.config()
    for i in range(3):
        _news(benv, night, f"T00{i}", f"Company {i} raises its dividend", f"k{i}")
    plan_night(config, benv.engine, night)
    assert run_queue(config, benv.engine, as_of=night, progress=False, preflight=False).done == 3
    model = Yalm.from_release(str(TINY / "weights"), YalmConfig.from_json(TINY / "config.json"))
    tokenizer = YalmTokenizer(VOCAB)
    requests = {r.id: r for r in benv.requests()}
    names = [name for name, _ in LABELS]
    for t in benv.theses():
        prompt = requests[t.request_id].prompt
        assert t.news_stance is not None and t.text_stance is not None
        assert t.stance == t.news_stance  # the template stores the news stance
        pieces = score_pieces(model, tokenizer, prompt[: prompt.rfind(":")] + " so", names)
        want = stance_from_pieces(StanceSpec(" so", LABELS, "sum"), pieces)  # uncalibrated: mode none
        assert t.news_stance == pytest.approx(want.stance, abs=1e-3) and t.stance_label == want.label
        thesis = stance_from_pieces(
            StanceSpec(" so", LABELS, "sum"), score_pieces(model, tokenizer, prompt + t.text + " so", names)
        )
        assert t.text_stance == pytest.approx(thesis.stance, abs=1e-3)


def test_batch_plan_as_of_now_says_how_many_prompts_have_no_news(benv) -> None:  # type: ignore[no-untyped-def]
    import subprocess
    import sys

    config = benv.write_config(prompts={"abstain_without_inputs": True})
    out = subprocess.run(
        [sys.executable, "-m", "robot_llm.commands.main", "batch", "plan", "-c", str(config), "--as-of", "now"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert "3 new request(s)" in out.stdout
    assert "3 prompt(s) have no news, 3 of them no signals either" in out.stdout
    assert "no news for tiny: no news has been fetched at all" in out.stdout


def test_a_stance_head_beside_the_weights_is_read_from_the_news_stance_pass(benv, night, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A head file for these weights: the stored stance is the head's on the hidden state of the news stance's cue
    (the same pass: equal to a re-prefill of that context), and says so; the label-word news stance stays readable."""
    import json
    import random
    import shutil

    import torch
    from batch_helpers import TINY, VOCAB

    from robot_llm.llm.engine.memory import Yalm
    from robot_llm.llm.families.yalm import YalmConfig
    from robot_llm.llm.tokenizer import YalmTokenizer
    from robot_llm.night.model import open_configured_model
    from robot_llm.night.stance_head import FORMAT, HEAD_FILE, load_head, weights_id

    weights = tmp_path / "yalm-tiny"
    shutil.copytree(TINY, weights)
    news = '  news:\n    cue: " so"\n    before: ":"\n  store: news\n'
    (benv.prompts_dir / "tiny.j2").write_text(
        TINY_TEMPLATE.replace('    " flat": 0\n', '    " flat": 0\n' + news), encoding="utf-8"
    )
    config = benv.config(model={"checkpoint": str(weights)})
    opened = open_configured_model(config)
    model_id = weights_id(opened.model_id)
    opened.close()
    hidden = YalmConfig.from_json(TINY / "config.json").hidden_size
    rng = random.Random(3)
    head = {
        "version": "1",
        "labels": {" up": 1, " down": -1, " flat": 0},
        "weights": [[rng.gauss(0, 1) for _ in range(hidden)] for _ in range(3)],
        "bias": [0.1, -0.2, 0.0],
    }
    (weights / HEAD_FILE).write_text(
        json.dumps({"format": FORMAT, "model": model_id, "templates": {"tiny": head}}), encoding="utf-8"
    )
    for i in range(3):
        _news(benv, night, f"T00{i}", f"Company {i} cuts its dividend", f"k{i}")
    plan_night(config, benv.engine, night)
    assert run_queue(config, benv.engine, as_of=night, progress=False, preflight=False).done == 3

    model = Yalm.from_release(str(TINY / "weights"), YalmConfig.from_json(TINY / "config.json"))
    tokenizer = YalmTokenizer(VOCAB)
    template_head = load_head(weights / HEAD_FILE).templates["tiny"]
    requests = {r.id: r for r in benv.requests()}
    for t in benv.theses():
        prompt = requests[t.request_id].prompt
        model.forward(torch.tensor([tokenizer.encode(prompt[: prompt.rfind(":")] + " so")]))
        assert model.last_hidden is not None
        want = template_head.stance(model.last_hidden[0, -1].tolist())
        assert t.stance_source == "head" and t.stance == pytest.approx(want.stance, abs=1e-4)
        assert t.stance_label == want.label and t.stance_probs == pytest.approx(want.probs, abs=1e-4)
        assert t.news_stance is not None and t.news_stance != t.stance  # the label words' news stance stays


def test_a_stance_head_for_other_weights_or_damaged_is_not_used(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import json

    from robot_llm.night.stance_head import FORMAT, HEAD_FILE, find_head, load_head

    head = {"version": "1", "labels": {" up": 1, " down": -1}, "weights": [[1.0, 0.0], [0.0, 1.0]], "bias": [0, 0]}
    path = tmp_path / HEAD_FILE
    path.write_text(json.dumps({"format": FORMAT, "model": "tiny/fp32@abc", "templates": {"t": head}}))
    assert find_head(tmp_path, "night:tiny/fp32@abc") is not None
    assert find_head(tmp_path, "night:tiny/fp32@def") is None  # another store's weights
    assert find_head(None, "night:tiny/fp32@abc") is None
    result = load_head(path).templates["t"].stance([3.0, 1.0])
    assert result.label == "up" and result.stance > 0 and sum(result.probs.values()) == pytest.approx(1.0)
    path.write_text(path.read_text().replace('"bias": [0, 0]', '"bias": [0]'))
    with pytest.raises(ValueError, match=r"stance_head.json: templates.t: one weight row and one bias per label"):
        load_head(path)


VERDICTS = '  verdicts:\n    " up": "it may rise."\n    " down": "it may fall."\n    " flat": "it may stay flat."\n'


def test_the_thesis_is_closed_with_the_stored_stances_verdict(benv, night, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """With ``stance.verdicts`` the model writes the fact and the night closes it with the stored label's phrase."""
    from robot_llm.night.stance import close_thesis

    (benv.prompts_dir / "tiny.j2").write_text(
        TINY_TEMPLATE.replace('    " flat": 0\n', '    " flat": 0\n' + VERDICTS), encoding="utf-8"
    )
    config = benv.config()
    for i in range(2):
        _news(benv, night, f"T00{i}", f"Company {i} raises its dividend", f"k{i}")
    plan_night(config, benv.engine, night)
    assert run_queue(config, benv.engine, as_of=night, progress=False, preflight=False).done == 3
    phrases = {"up": "it may rise.", "down": "it may fall.", "flat": "it may stay flat."}
    assert any(t.text.strip() for t in benv.theses())
    for t in benv.theses():
        assert t.text.endswith("; " + phrases[t.stance_label]) or t.text.strip() == ""
        if t.text.strip():
            direction = thesis_direction(t.text, "en")
            assert direction == {"up": 1, "down": -1, "flat": 0}[t.stance_label]
            assert "disagrees" not in t.flags

    two = {"cue": " so", "labels": {" up": 1, " down": -1}}
    spec = parse_stance_spec({**two, "verdicts": {" up": "up!", " down": "no"}})
    assert spec is not None
    assert close_thesis(" Profits rose 5%;", spec, "up") == "Profits rose 5%; up!"
    assert close_thesis("  ", spec, "up") == "  "  # no fact written: nothing to close
    with pytest.raises(ValueError, match="verdicts"):
        parse_stance_spec({**two, "verdicts": {" up": "x"}})
    bad = tmp_path / "tiny.j2"
    two_verdicts = VERDICTS[: VERDICTS.rindex('    " flat"')]
    bad.write_text(TINY_TEMPLATE.replace('    " flat": 0\n', '    " flat": 0\n' + two_verdicts), encoding="utf-8")
    with pytest.raises(TemplateError, match=r"stance\.verdicts: one phrase per label"):
        load_template(bad)


def test_the_demo_ships_a_stance_head_for_its_templates_as_they_are() -> None:
    """The packaged head covers ``brief_en``/``brief_ru`` at their current versions and labels (a version bump
    without retraining would silently drop the head), and belongs to the demo's Gemma weights."""
    from robot_llm.night.stance_head import HEAD_FILE, load_head

    head = load_head(REPO / "robot_llm" / "demo_data" / HEAD_FILE)
    assert head.model.startswith("gemma3") and head.model.split("/")[1].startswith("bf16@")
    for name in ("brief_en", "brief_ru"):
        template = load_template(REPO / "prompts" / f"{name}.j2")
        assert template.stance is not None
        found = head.for_template(template.name, template.version)
        assert found is not None, f"{name} v{template.version} has no head: retrain (benchmarks/stance_head.py)"
        assert dict(found.labels) == template.stance.labels
        assert len(found.weights[0]) == 640  # Gemma 3 270M's hidden size


def test_the_demo_places_its_head_beside_a_converted_store_and_keeps_one_there(tmp_path: Path) -> None:
    from robot_llm.demo import place_stance_head
    from robot_llm.night.stance_head import HEAD_FILE

    place_stance_head(tmp_path)
    packaged = (REPO / "robot_llm" / "demo_data" / HEAD_FILE).read_bytes()
    assert (tmp_path / HEAD_FILE).read_bytes() == packaged
    (tmp_path / HEAD_FILE).write_text("{}", encoding="utf-8")  # the user's own head
    place_stance_head(tmp_path)
    assert (tmp_path / HEAD_FILE).read_text(encoding="utf-8") == "{}"
