"""plan_night and `prompts render` on real SQLite and PostgreSQL databases."""

from __future__ import annotations

import hashlib
from datetime import timedelta
from pathlib import Path

import pytest
from prompting_helpers import AS_OF, add_news, add_signal
from sqlalchemy import func, select

from robot_llm.commands.main import main
from robot_llm.night.plan import NightNotPlannable, check_templates, derive_seed, plan_night
from robot_llm.store.db import GenerationRequest, Run, session_scope

PARAM_KEYS = {"max_new_tokens", "greedy", "temperature", "top_k", "top_p", "seed", "stop", "stance"}

# The plan is made an hour after the night's cut-off (the clock, not the test machine's date).
PLANNED_AT = AS_OF + timedelta(hours=1)


def seed_night(engine) -> dict[str, int]:
    """News and signals around AS_OF; the names say which must be seen by SBER's prompt."""
    h = timedelta(hours=1)
    with session_scope(engine) as s:
        ids = {
            "seen_old": add_news(
                s,
                title="Сбербанк отчитался о прибыли",
                tickers=("SBER",),
                fetched_at=AS_OF - 2 * h,
                published_at=AS_OF - 3 * h,
            ),
            "seen_at_cutoff": add_news(s, title="Сбер открыл офис", tickers=("SBER",), fetched_at=AS_OF),
            # fetched after the cut-off although the feed dates it earlier: we did not know it yet
            "late": add_news(
                s,
                title="Сбербанк: утечка из будущего",
                tickers=("SBER",),
                fetched_at=AS_OF + h,
                published_at=AS_OF - 5 * h,
            ),
            "stale": add_news(s, title="Сбербанк: старая новость", tickers=("SBER",), fetched_at=AS_OF - 72 * h),
            "archive": add_news(
                s, title="Сбербанк: архив ленты", tickers=("SBER",), fetched_at=AS_OF - h, published_at=AS_OF - 240 * h
            ),
            "other": add_news(s, title="Газпром снизил добычу", tickers=("GAZP",), fetched_at=AS_OF - h),
            "sig_seen": add_signal(s, ticker="SBER", generated_at=AS_OF - 3 * h, received_at=AS_OF - 2 * h),
            "sig_other_model": add_signal(
                s, ticker="SBER", model="arima", direction=-1, generated_at=AS_OF - 1.5 * h, received_at=AS_OF - h
            ),
            "sig_superseded": add_signal(s, ticker="SBER", generated_at=AS_OF - 20 * h, received_at=AS_OF - 19 * h),
            "sig_late": add_signal(s, ticker="SBER", generated_at=AS_OF - h, received_at=AS_OF + timedelta(minutes=10)),
        }
    return ids


def requests(engine) -> list[GenerationRequest]:
    with session_scope(engine) as s:
        return list(
            s.scalars(select(GenerationRequest).order_by(GenerationRequest.ticker, GenerationRequest.template_name))
        )


def test_plan_is_point_in_time_and_idempotent(engine, make_config, tokenizer):
    config = make_config()
    ids = seed_night(engine)
    result = plan_night(config, engine, AS_OF, tokenizer=tokenizer, now=PLANNED_AT)
    assert (result.created, result.existing, result.skipped) == (4, 0, ())
    assert result.as_of == AS_OF

    rows = requests(engine)
    assert [(r.ticker, r.template_name) for r in rows] == [
        ("GAZP", "thesis_en"),
        ("GAZP", "thesis_ru"),
        ("SBER", "thesis_en"),
        ("SBER", "thesis_ru"),
    ]
    sber = rows[3]
    assert sber.as_of == AS_OF and sber.status == "pending" and sber.attempts == 0
    assert sber.news_ids == [ids["seen_old"], ids["seen_at_cutoff"]]
    assert sber.signal_ids == [ids["sig_other_model"], ids["sig_seen"]]
    assert "утечка из будущего" not in sber.prompt and "старая новость" not in sber.prompt
    assert "архив ленты" not in sber.prompt and "Газпром" not in sber.prompt
    assert "отчитался о прибыли" in sber.prompt
    assert sber.prompt_tokens == len(tokenizer.encode(sber.prompt))
    assert sber.prompt_sha256 == hashlib.sha256(sber.prompt.encode()).hexdigest()
    assert sber.template_version == "2"
    assert sber.valid_until == AS_OF + config.prompts.valid_for
    assert set(sber.params) == PARAM_KEYS
    assert sber.params["stance"]["labels"] == {" рост": 1.0, " падение": -1.0, " нейтрально": 0.0}
    assert sber.params["stop"] and sber.params["max_new_tokens"] == 96
    assert rows[0].news_ids == [ids["other"]] and rows[0].signal_ids == []

    # seeds: deterministic from (config seed, night, ticker, template), different per ticker
    for r in rows:
        assert r.params["seed"] == derive_seed(config.prompts.generation.seed, AS_OF, r.ticker, r.template_name)
    assert len({r.params["seed"] for r in rows}) == 4

    again = plan_night(config, engine, AS_OF, tokenizer=tokenizer, now=PLANNED_AT)
    assert (again.created, again.existing) == (0, 4)
    with session_scope(engine) as s:
        assert s.scalar(select(func.count()).select_from(GenerationRequest)) == 4
        runs = list(s.scalars(select(Run).where(Run.kind == "plan").order_by(Run.id)))
    assert [r.status for r in runs] == ["ok", "ok"]
    assert [r.counts["created"] for r in runs] == [4, 0] and runs[1].counts["existing"] == 4
    assert all(r.as_of == AS_OF and r.done == r.total == 4 and r.finished_at for r in runs)
    assert [r.prompt for r in requests(engine)] == [r.prompt for r in rows]  # untouched


def test_instrument_that_cannot_fit_is_skipped_with_reason(engine, make_config, tokenizer):
    config = make_config(model={"max_positions": 256}, prompts={"templates": ["thesis_ru"]})
    result = plan_night(config, engine, AS_OF, tokenizer=tokenizer, now=PLANNED_AT)
    assert result.created == 0 and len(result.skipped) == 2
    assert {(t, n) for t, n, _ in result.skipped} == {("SBER", "thesis_ru"), ("GAZP", "thesis_ru")}
    assert all("without any news" in reason for _, _, reason in result.skipped)
    assert requests(engine) == []
    with session_scope(engine) as s:
        run = s.scalars(select(Run).where(Run.kind == "plan")).one()
    assert run.status == "ok" and run.counts["skipped"] == 2
    assert run.counts["skipped_reasons"][0]["template"] == "thesis_ru"


def test_prompts_render_cli_prints_exactly_the_planned_prompt(engine, db_url, make_config, tokenizer, capsys):
    config = make_config(db_url=db_url)
    seed_night(engine)
    with session_scope(engine) as s:  # 13 fresh items: the template shows 12, the oldest is left out
        for i in range(11):
            add_news(s, title=f"Сбер: заметка {i}", tickers=("SBER",), fetched_at=AS_OF - timedelta(minutes=60 - i))
    plan_night(config, engine, AS_OF, tokenizer=tokenizer, now=PLANNED_AT)
    planned = {r.template_name: r for r in requests(engine) if r.ticker == "SBER"}
    assert len(planned["thesis_ru"].news_ids) == 12

    path = str(Path(config.source))
    code = main(["prompts", "render", "-c", path, "--ticker", "SBER", "--as-of", "2026-11-25T23:00"])
    out, err = capsys.readouterr()
    assert code == 0
    assert out == planned["thesis_ru"].prompt  # byte for byte what the worker will send
    assert f"prompt tokens: {planned['thesis_ru'].prompt_tokens} (BOS included)" in err
    assert "dropped news: 1" in err and "(max_items, mentions 1)" in err
    assert "заметка" not in err.split("dropped news: 1")[1] and "отчитался" in err  # the oldest went

    code = main(
        ["prompts", "render", "-c", path, "--ticker", "SBER", "--template", "thesis_en", "--as-of", "2026-11-25T20:00Z"]
    )
    out, err = capsys.readouterr()
    assert code == 0 and out == planned["thesis_en"].prompt

    code = main(["prompts", "render", "-c", path, "--ticker", "NOPE"])
    out, err = capsys.readouterr()
    assert code == 2 and "unknown ticker 'NOPE'" in err and out == ""


def test_check_templates_reports_every_broken_template_and_instrument(make_config, tokenizer):
    assert check_templates(make_config(), tokenizer) == []
    config = make_config(prompts={"templates": ["thesis_ru", "broken", "missing"]})
    (config.prompts.dir / "broken.j2").write_text(
        "---\nname: broken\nversion: '1'\nlanguage: ru\n---\n{{ news[0].title }} {{ forecast.nope }}\n",
        encoding="utf-8",
    )
    problems = check_templates(config, tokenizer=tokenizer)
    assert len(problems) == 3  # broken for each of the 2 instruments, missing once
    assert sorted(p.split("(instrument ")[1] for p in problems if "broken.j2:6:" in p and "nope" in p) == [
        "GAZP)",
        "SBER)",
    ]
    assert any("'missing' not found" in p for p in problems)
    small = make_config(model={"max_positions": 256})
    too_long = check_templates(small, tokenizer=tokenizer)  # 2 templates x 2 instruments cannot fit
    assert len(too_long) == 4 and all(".j2: template" in p and "without any news" in p for p in too_long)


def test_prompts_render_on_an_unmigrated_database_says_so(make_config, capsys):
    config = make_config()  # a fresh SQLite file that was never migrated
    code = main(["prompts", "render", "-c", str(config.source), "--ticker", "SBER"])
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    assert "is it migrated? run `robot-llm db upgrade" in err


def test_a_future_night_and_a_night_past_valid_until_are_refused_and_nothing_is_stored(engine, make_config, tokenizer):
    config = make_config()  # prompts.valid_for: 1 day
    seed_night(engine)
    with pytest.raises(NightNotPlannable, match="has not come yet"):
        plan_night(config, engine, AS_OF, tokenizer=tokenizer, now=AS_OF - timedelta(minutes=5))
    with pytest.raises(NightNotPlannable, match=r"is over: its theses would be valid until .* which has passed"):
        plan_night(config, engine, AS_OF, tokenizer=tokenizer, now=AS_OF + config.prompts.valid_for)
    assert requests(engine) == []
    with session_scope(engine) as s:
        assert s.scalars(select(Run)).all() == []  # refused before anything was recorded
    # At the cut-off itself and up to just before valid_until it plans.
    assert plan_night(config, engine, AS_OF, tokenizer=tokenizer, now=AS_OF).created == 4
