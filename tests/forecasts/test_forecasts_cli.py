"""``robot-llm forecasts show|export`` on a seeded database (SQLite and PostgreSQL)."""

from __future__ import annotations

import csv
import json
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
from sqlalchemy.engine import Engine

from robot_llm.commands.main import main
from robot_llm.store.db import Thesis, session_scope, utcnow
from tests.forecasts.conftest import seed_thesis, write_config

UTC = timezone.utc
T = datetime(2026, 11, 30, 6, 0, tzinfo=UTC)  # 09:00 Moscow


ITEMS = [
    {"news_id": 3, "stance": 0.4, "label": "рост", "probs": {"рост": 0.6, "падение": 0.2}},
    {"news_id": 4, "stance": None, "label": None, "probs": {}},  # an item the night could not place
]


def _with_items(engine: Engine, thesis: int) -> None:
    with session_scope(engine) as s:
        row = s.get(Thesis, thesis)
        assert row is not None
        row.item_stances, row.item_stance = ITEMS, 0.4


@pytest.fixture
def config(db_url: str, tmp_path: Path) -> Path:
    return write_config(tmp_path, db_url)


def test_show(engine: Engine, config: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sber = seed_thesis(
        engine,
        ticker="SBER",
        as_of=T - timedelta(hours=10),
        available_at=T - timedelta(hours=8),
        stance=0.7,
        score=0.9,
        stance_label="рост",
        text="Первая строка.\nВторая строка.",
        news_ids=(3, 4),
        signal_ids=(1,),
    )
    _with_items(engine, sber)
    stale = seed_thesis(
        engine,
        ticker="GAZP",
        as_of=T - timedelta(days=3),
        available_at=T - timedelta(days=3),
        valid_until=T - timedelta(days=2),
    )
    assert main(["forecasts", "show", "-c", str(config), "--as-of", "2026-11-30T09:00+03:00"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == "theses available as of 2026-11-30T09:00:00+03:00 (Europe/Moscow)"
    assert f"SBER: рост (stance +0.70, score 0.90)  [thesis {sber}]" in out
    assert "  | Первая строка.\n  | Вторая строка." in out
    assert "inputs: news [3, 4], signals [1]; item stances 1/2, mean +0.40" in out
    assert "GAZP: no valid thesis (abstains)" in out

    argv = ["forecasts", "show", "-c", str(config), "--as-of", T.isoformat(), "--json", "--include-stale"]
    assert main(argv) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["as_of"] == T.isoformat()
    by_ticker = {item["ticker"]: item["thesis"] for item in data["theses"]}
    assert by_ticker["SBER"]["id"] == sber and by_ticker["SBER"]["news_ids"] == [3, 4]
    assert by_ticker["SBER"]["item_stances"] == ITEMS and by_ticker["SBER"]["item_stance"] == 0.4
    assert by_ticker["SBER"]["available_at"] == (T - timedelta(hours=8)).isoformat()
    assert by_ticker["GAZP"]["id"] == stale

    # Before the SBER thesis was committed, it is not shown.
    early = (T - timedelta(hours=9)).isoformat()
    assert main(["forecasts", "show", "-c", str(config), "--ticker", "SBER", "--as-of", early, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["theses"] == [{"ticker": "SBER", "thesis": None}]


def test_show_refuses_a_time_without_zone(config: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["forecasts", "show", "-c", str(config), "--as-of", "2026-11-30T09:00"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: the time '2026-11-30T09:00' has no zone") and err.count("\n") == 1


def test_export(engine: Engine, config: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ids = [
        seed_thesis(
            engine, ticker=t, as_of=T + timedelta(hours=h - 2), available_at=T + timedelta(hours=h), news_ids=(h,)
        )
        for t, h in [("SBER", 0), ("GAZP", 1), ("SBER", 2), ("SBER", 3)]
    ]
    _with_items(engine, ids[2])
    target = tmp_path / "out.csv"
    argv = ["forecasts", "export", "-c", str(config), "--since", T.isoformat(), "--until", "2026-11-30T08:00Z"]
    assert main([*argv, "--format", "csv", "--output", str(target)]) == 0
    assert "exported 3 theses" in capsys.readouterr().err
    rows = list(csv.DictReader(target.open(encoding="utf-8")))
    assert [int(r["id"]) for r in rows] == ids[:3]  # both bounds included, in order of availability
    assert rows[2]["ticker"] == "SBER" and json.loads(rows[2]["news_ids"]) == [2]
    assert json.loads(rows[2]["item_stances"]) == ITEMS and json.loads(rows[0]["item_stances"]) == []
    assert datetime.fromisoformat(rows[1]["available_at"]) == T + timedelta(hours=1)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out.csv")]  # no temp file left

    assert main([*argv, "--format", "jsonl", "--ticker", "SBER"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [x["id"] for x in lines] == [ids[0], ids[2]]
    assert lines[0]["valid_until"] == (T + timedelta(days=1)).isoformat()


def test_export_relative_since(engine: Engine, config: Path, capsys: pytest.CaptureFixture[str]) -> None:
    now = utcnow()
    recent = seed_thesis(engine, ticker="SBER", as_of=now - timedelta(hours=3), available_at=now - timedelta(hours=2))
    seed_thesis(engine, ticker="SBER", as_of=now - timedelta(days=4), available_at=now - timedelta(days=3))
    assert main(["forecasts", "export", "-c", str(config), "--since", "1d", "--format", "jsonl"]) == 0
    assert [json.loads(line)["id"] for line in capsys.readouterr().out.splitlines()] == [recent]
