"""``batch plan``, ``batch run``, ``batch status`` and ``report`` through the real CLI entry point."""

from __future__ import annotations

import json
from datetime import timedelta

from robot_llm.commands.main import main
from robot_llm.store.db import Run


def test_plan_run_status_and_report_commands(benv, night, capsys):
    config_file = benv.write_config(batch={"max_attempts": 1})
    as_of = night.isoformat()

    assert main(["batch", "plan", "-c", str(config_file), "--as-of", as_of]) == 0
    assert "3 new request(s), 0 already planned" in capsys.readouterr().out
    # One request the model cannot take: its prompt is longer than the window.
    benv.seed(1, night, start=3, prompt=lambda i: "news " * 80 + ":")

    assert main(["batch", "status", "-c", str(config_file)]) == 0
    assert "pending 4, running 0, done 0, failed 0" in capsys.readouterr().out

    # A request that failed for good makes the run fail (exit 1): the night lacks a thesis.
    assert main(["batch", "run", "-c", str(config_file), "--as-of", as_of, "--skip-preflight"]) == 1
    captured = capsys.readouterr()
    out = captured.out
    assert "3 thesis(es) stored, 1 failed" in out and "window is 64" in out
    assert "error: generate run" in captured.err

    assert main(["batch", "status", "-c", str(config_file)]) == 0
    assert "pending 0, running 0, done 3, failed 1" in capsys.readouterr().out

    (generate,) = benv.runs()
    day = generate.started_at.date().isoformat()  # the config's timezone is UTC
    assert main(["report", "-c", str(config_file), "--date", day, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["day"] == day and data["theses"] == benv.thesis_count() == 3
    assert data["theses_by_template"] == {"tiny": 3}
    kinds = {(r["kind"], r["status"]) for r in data["runs"]}
    assert {("plan", "ok"), ("generate", "failed")} <= kinds
    (failure,) = data["failures"]
    assert failure["ticker"] == "T003" and "window is 64" in failure["error"]
    assert data["tokens_per_s"] > 0 and data["new_tokens"] == generate.counts["new_tokens"]

    assert main(["report", "-c", str(config_file)]) == 0  # default day: the latest night's
    text = capsys.readouterr().out
    assert f"report for {day}" in text and "theses stored: 3 (tiny: 3)" in text
    assert "failed requests: 1" in text and "#4 T003 tiny after 1 attempt(s)" in text
    assert f"#{generate.id} generate" in text and "tokens/s" in text
    # Each report is a recorded job too.
    assert [r.status for r in benv.runs("report")] == ["ok", "ok"]
    assert all(isinstance(r, Run) and r.counts["theses"] == 3 for r in benv.runs("report"))


def test_report_of_a_day_without_runs(benv, capsys):
    assert main(["report", "-c", str(benv.write_config()), "--date", "2020-01-02"]) == 0
    out = capsys.readouterr().out
    assert "no runs started that day" in out and "theses stored: 0" in out


def test_batch_plan_refuses_a_future_night_and_one_past_valid_until(benv, night, capsys):
    config_file = benv.write_config()
    future = (night + timedelta(days=1)).isoformat()
    over = (night - timedelta(days=2)).isoformat()  # prompts.valid_for is a day
    assert main(["batch", "plan", "-c", str(config_file), "--as-of", future]) == 2
    assert "has not come yet" in capsys.readouterr().err
    assert main(["batch", "plan", "-c", str(config_file), "--as-of", over]) == 2
    assert "is over" in capsys.readouterr().err
    assert benv.requests() == []
