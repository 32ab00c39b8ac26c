"""Per-news-item stances in the night (``stance.news.items``): one per news id, stored beside the thesis's
stance and read back from the read API. Real SQLite / PostgreSQL, the tiny YaLM fixture."""

from __future__ import annotations

from datetime import timedelta

import pytest
from batch_helpers import TINY, TINY_TEMPLATE, VOCAB, add_news

from robot_llm.forecasts import Forecasts
from robot_llm.night.plan import plan_night
from robot_llm.night.stance import StanceSpec, parse_stance_spec, stance_from_pieces
from robot_llm.night.worker import run_queue
from robot_llm.thesis.items import item_spans

LABELS = ((" up", 1.0), (" down", -1.0), (" flat", 0.0))
# The news as "- " lines between the ticker and the forecast slot (":"), per-item stances asked.
TEMPLATE = TINY_TEMPLATE.replace(
    "{{ instrument.ticker }}{% for item in news %} {{ item.text }}{% endfor %}:",
    "{{ instrument.ticker }}\n{% for item in news %}- {{ item.text }}\n{% endfor %}:",
).replace('    " flat": 0\n', '    " flat": 0\n  news:\n    cue: " so"\n    before: "\\n:"\n    items: true\n')


def test_each_news_item_gets_a_stance_stored_and_read_back(benv, night) -> None:  # type: ignore[no-untyped-def]
    from robot_llm.llm.engine.memory import Yalm
    from robot_llm.llm.families.yalm import YalmConfig
    from robot_llm.llm.scoring import score_pieces
    from robot_llm.llm.tokenizer import YalmTokenizer

    (benv.prompts_dir / "tiny.j2").write_text(TEMPLATE, encoding="utf-8")
    config = benv.config()
    add_news(benv, night, "T000", "Company cuts jobs", "a", 3)
    add_news(benv, night, "T000", "Company raises its dividend", "b", 2)
    add_news(benv, night, "T001", "Company wins a contract", "c", 2)
    plan_night(config, benv.engine, night)
    assert run_queue(config, benv.engine, as_of=night, progress=False, preflight=False).done == 3
    model = Yalm.from_release(str(TINY / "weights"), YalmConfig.from_json(TINY / "config.json"))
    tokenizer = YalmTokenizer(VOCAB)
    requests = {r.id: r for r in benv.requests()}
    names = [name for name, _ in LABELS]
    theses = {t.ticker: t for t in benv.theses()}
    assert [len(theses[t].item_stances) for t in ("T000", "T001", "T002")] == [2, 1, 0]
    assert theses["T002"].item_stance is None  # no news: no item stance
    for t in (theses["T000"], theses["T001"]):
        req = requests[t.request_id]
        spans = item_spans(req.prompt, parse_stance_spec(req.params["stance"]), len(req.news_ids))
        assert len(spans) == len(t.news_ids)
        assert [e["news_id"] for e in t.item_stances] == list(t.news_ids)  # oldest first, as the prompt shows them
        assert all(e["stance"] is not None and set(e["probs"]) == {"up", "down", "flat"} for e in t.item_stances)
        # The first item sees all the prompt before it: a plain re-prefill up to its line's end (mode none).
        first = score_pieces(model, tokenizer, req.prompt[: spans[0][1]] + " so", names)
        want = stance_from_pieces(StanceSpec(" so", LABELS, "sum"), first)
        assert t.item_stances[0]["stance"] == pytest.approx(want.stance, abs=1e-3)
        mean = sum(e["stance"] for e in t.item_stances) / len(t.item_stances)
        assert t.item_stance == pytest.approx(mean, abs=1e-9)
        assert t.stance == t.text_stance  # the stored stance's source is unchanged (the thesis's, here)
    with Forecasts.open(benv.db_url) as fc:
        record = fc.latest("T000", theses["T000"].available_at + timedelta(seconds=1))
        assert record is not None and record.item_stance == pytest.approx(theses["T000"].item_stance)
        assert [i.news_id for i in record.item_stances] == list(theses["T000"].news_ids)
        assert record.item_stances[1].label in {"up", "down", "flat"}


def test_item_spans_need_one_bullet_line_per_news_id() -> None:
    spec = parse_stance_spec(
        {"cue": " so", "labels": {" up": 1, " down": -1}, "news": {"cue": " so", "before": "\n:", "items": True}}
    )
    prompt = "T000\n- first\n- second\n:"
    assert [prompt[a:b] for a, b in item_spans(prompt, spec, 2)] == ["- first", "- second"]
    assert item_spans(prompt, spec, 1) == ()  # more lines than news ids: not placed, never guessed
    assert item_spans(prompt, spec, 3) == ()
    assert item_spans("T000\n- only one line, no anchor", spec, 1) == ()
    with pytest.raises(ValueError, match=r"params\.stance\.news\.items"):
        parse_stance_spec(
            {"cue": " so", "labels": {" up": 1, " down": -1}, "news": {"cue": "x", "before": "y", "items": 1}}
        )
