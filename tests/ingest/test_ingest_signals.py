"""Robot signals: drop-folder files (JSONL, CSV) and publish(), on SQLite and PostgreSQL."""

from __future__ import annotations

import os
import shutil
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
from ingest_helpers import DEMO, make_config
from sqlalchemy import select
from sqlalchemy.engine import Engine

from robot_llm.ingest.signals import ingest_signals, pending_files
from robot_llm.signals import SignalError, close, make_signal, publish, publish_many
from robot_llm.store.db import Signal, session_scope


def _signals(engine: Engine) -> list[Signal]:
    with session_scope(engine) as s:
        return list(s.scalars(select(Signal).order_by(Signal.ticker, Signal.horizon, Signal.id)))


def _url(engine: Engine) -> str:
    return engine.url.render_as_string(hide_password=False).replace("postgresql+psycopg://", "postgresql://")


def test_mixed_files_rejects_tmp_and_redrop(engine: Engine, tmp_path: Path) -> None:
    drop = tmp_path / "drop"
    drop.mkdir()
    config = make_config(tmp_path, _url(engine), drop_dirs=[drop])
    shutil.copy(DEMO / "signals" / "sample-signals.jsonl", drop / "sample-signals.jsonl")
    shutil.copy(DEMO / "signals" / "sample-signals.csv", drop / "sample-signals.csv")
    (drop / "half.jsonl.tmp").write_text('{"ticker": "SBER", "generated_at": "2026-11-2')  # still being written
    (drop / ".hidden.jsonl").write_text('{"ticker": "SBER"}\n')
    (drop / "notes.txt").write_text("not a signal file\n")

    results = {r.path.name: r for r in ingest_signals(config, engine)}
    assert sorted(results) == ["sample-signals.csv", "sample-signals.jsonl"]
    jsonl, csv = results["sample-signals.jsonl"], results["sample-signals.csv"]
    assert (jsonl.rows, jsonl.stored, jsonl.duplicates, len(jsonl.rejects)) == (5, 4, 0, 1)
    assert (csv.rows, csv.stored, len(csv.rejects)) == (4, 3, 1)
    assert csv.unknown_tickers == ("MSFT",)

    assert (drop / "sample-signals.jsonl.rejects").read_text(encoding="utf-8") == (
        "sample-signals.jsonl:5: generated_at: 2026-11-27 18:45:00 has no time zone; add one (e.g. +03:00 or Z) — "
        "naive times are refused; confidence: must be between 0 and 1, got 1.7\n"
    )
    assert (drop / "sample-signals.csv.rejects").read_text(encoding="utf-8") == (
        "sample-signals.csv:5: unknown ticker 'MSFT' (not in the config's instruments)\n"
    )
    # Taken files moved; the partial, hidden and foreign ones left alone.
    assert sorted(p.name for p in (drop / "processed").iterdir()) == ["sample-signals.csv", "sample-signals.jsonl"]
    assert sorted(p.name for p in drop.iterdir() if p.is_file()) == [
        ".hidden.jsonl",
        "half.jsonl.tmp",
        "notes.txt",
        "sample-signals.csv.rejects",
        "sample-signals.jsonl.rejects",
    ]

    stored = _signals(engine)
    assert len(stored) == 7
    sber = next(s for s in stored if s.ticker == "SBER")
    assert sber.generated_at == datetime(2026, 11, 27, 15, 45, tzinfo=timezone.utc)
    assert (sber.direction, sber.target, sber.confidence, sber.model, sber.horizon) == (1, 312.5, 0.64, "gbm-v7", "1d")
    assert sber.extras == {"features": 42, "regime": "trend"}
    assert sber.source == "robot0:sample-signals.jsonl:1"
    gazp = next(s for s in stored if s.ticker == "GAZP")
    assert gazp.direction == 0 and gazp.target is None
    nvda_week = next(s for s in stored if s.ticker == "NVDA" and s.horizon == "1w")
    assert nvda_week.extras == {"regime": "trend"}  # CSV: other non-empty columns become extras
    assert nvda_week.generated_at == datetime(2026, 11, 27, 18, 0, tzinfo=timezone.utc)

    # The robot finishes its .tmp file and renames it; the same file dropped again adds nothing.
    (drop / "half.jsonl.tmp").write_text(
        '{"ticker": "sber", "generated_at": "2026-11-28T10:00:00Z", "horizon": "4h", "target": 300, "model": "m"}\n'
    )
    (drop / "half.jsonl.tmp").rename(drop / "half.jsonl")
    shutil.copy(DEMO / "signals" / "sample-signals.jsonl", drop / "sample-signals.jsonl")
    again = {r.path.name: r for r in ingest_signals(config, engine)}
    assert (again["half.jsonl"].stored, again["half.jsonl"].rejects) == (1, ())
    assert (again["sample-signals.jsonl"].stored, again["sample-signals.jsonl"].duplicates) == (0, 4)
    assert len(_signals(engine)) == 8
    assert next(s for s in _signals(engine) if s.model == "m").ticker == "SBER"  # stored as configured
    processed = sorted(p.name for p in (drop / "processed").iterdir())
    assert len(processed) == 4 and processed.count("sample-signals.jsonl") == 1  # the second copy kept apart
    assert ingest_signals(config, engine) == []


def test_csv_header_problems_and_odd_rows(engine: Engine, tmp_path: Path) -> None:
    drop = tmp_path / "drop"
    drop.mkdir()
    config = make_config(tmp_path, _url(engine), drop_dirs=[drop, tmp_path / "not-there"])
    (drop / "a-no-model.csv").write_text("ticker,generated_at,horizon,direction\nSBER,2026-11-27T10:00Z,1d,up\n")
    (drop / "b-semicolon.csv").write_bytes(
        "\ufeffTicker;Generated_At;Horizon;Target;Model;Extras;note\n"
        'GAZP;2026-11-27T10:00:00+03:00;1d;160,5;m;{"k": 1};hello\n'
        "GAZP;2026-11-27T10:00:00+03:00;1d;;m;;\n"
        "GAZP;2026-11-27T10:00:00+03:00;2d;1;m\n"
        "LKOH;2026-11-27T10:00:00+03:00;soon;up;m;;\n".encode()
    )
    (drop / "c-latin1.jsonl").write_bytes(b'{"ticker": "SBER"}\n{"model": "caf\xe9"}\n')
    results = {r.path.name: r for r in ingest_signals(config, engine)}
    assert "does not exist" in (results["not-there"].error or "")
    assert (drop / "a-no-model.csv.rejects").read_text() == (
        "a-no-model.csv:1: the header lacks column(s) model; no row of this file was read\n"
    )
    assert (drop / "b-semicolon.csv.rejects").read_text().splitlines() == [
        "b-semicolon.csv:3: give a direction, a target or both",
        "b-semicolon.csv:4: 5 fields, but the header has 7",
        "b-semicolon.csv:5: horizon: expected a duration like '4h', '1d' or '1w', got 'soon'; "
        "target: expected a number, got 'up'",
    ]
    assert results["b-semicolon.csv"].stored == 1
    (gazp,) = _signals(engine)
    assert (gazp.target, gazp.extras) == (160.5, {"note": "hello", "k": 1})
    assert (drop / "c-latin1.jsonl.rejects").read_text().startswith("c-latin1.jsonl:2: not UTF-8 text")


def test_rows_stay_stored_when_the_file_cannot_be_moved(engine: Engine, tmp_path: Path) -> None:
    drop = tmp_path / "drop"
    drop.mkdir()
    (drop / "processed").write_text("a file where the processed/ folder should be")
    config = make_config(tmp_path, _url(engine), drop_dirs=[drop])
    shutil.copy(DEMO / "signals" / "sample-signals.csv", drop / "s.csv")
    (result,) = ingest_signals(config, engine)
    assert result.stored == 3 and result.moved_to is None
    assert "stored, but cannot write its rejects or move it to processed/" in (result.error or "")
    assert (drop / "s.csv").exists() and len(_signals(engine)) == 3
    (again,) = ingest_signals(config, engine)  # still there: read again, nothing stored twice
    assert (again.stored, again.duplicates) == (0, 3) and len(_signals(engine)) == 3


def test_pending_files_skips_empty_and_sorts_by_age(tmp_path: Path) -> None:
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "new.csv").write_text("x\n")
    (tmp_path / "old.JSONL").write_text("x\n")
    (tmp_path / "sub.jsonl").mkdir()
    os.utime(tmp_path / "old.JSONL", (1, 1))
    assert [p.name for p in pending_files(tmp_path)] == ["old.JSONL", "new.csv"]


def test_publish_round_trip_and_drop_dir(engine: Engine, tmp_path: Path) -> None:
    drop = tmp_path / "drop"
    drop.mkdir()
    config_path = make_config(tmp_path, _url(engine), drop_dirs=[drop]).source
    assert config_path is not None
    when = datetime(2026, 11, 27, 18, 45, tzinfo=timezone(timedelta(hours=3)))
    first = publish(
        "SBER",
        when,
        horizon="1d",
        direction="down",
        target=290.0,
        confidence=0.7,
        model="py-bot",
        extras={"bar": 17},
        config=config_path,
    )
    assert first.stored == 1 and first.duplicates == 0 and len(first.ids) == 1
    assert (
        publish("SBER", when.isoformat(), horizon="1d", direction=-1, model="py-bot", config=config_path).duplicates
        == 1
    )
    (row,) = _signals(engine)
    assert row.id == first.ids[0]
    assert (row.generated_at, row.direction, row.target, row.extras, row.source) == (
        datetime(2026, 11, 27, 15, 45, tzinfo=timezone.utc),
        -1,
        290.0,
        {"bar": 17},
        "publish",
    )

    with pytest.raises(SignalError, match=r"signal #2: unknown ticker 'TSLA'") as info:
        publish_many(
            [
                {"ticker": "GAZP", "generated_at": when, "horizon": "1d", "direction": 1, "model": "py-bot"},
                {"ticker": "TSLA", "generated_at": when, "horizon": "1d", "direction": 1, "model": "py-bot"},
            ],
            config=config_path,
        )
    assert info.value.unknown_ticker == "TSLA"
    assert len(_signals(engine)) == 1  # all or nothing

    written = publish("YDEX", when, horizon="4h", target=4400, model="py-bot", drop_dir=drop)
    assert written.path is not None and written.path.parent == drop and written.path.suffix == ".jsonl"
    assert [p.name for p in drop.iterdir()] == [written.path.name]  # no .tmp left behind
    (result,) = ingest_signals(make_config(tmp_path, _url(engine), drop_dirs=[drop]), engine)
    assert result.stored == 1
    assert {s.ticker for s in _signals(engine)} == {"SBER", "YDEX"}
    close()


@pytest.mark.parametrize(
    ("data", "problem"),
    [
        ({"generated_at": "2026-11-27T10:00:00"}, "has no time zone"),
        ({"generated_at": datetime(2026, 11, 27, 10)}, "has no time zone"),
        ({"generated_at": "yesterday"}, "expected an ISO 8601 time"),
        ({"generated_at": (datetime.now(timezone.utc) + timedelta(hours=1)).isoformat()}, "is in the future"),
        ({"direction": "sideways"}, "direction: expected up/down/flat"),
        ({"direction": True}, "direction: expected up/down/flat"),
        ({"confidence": -0.1}, "confidence: must be between 0 and 1"),
        ({"target": "nan"}, "target: expected a finite number"),
        ({"horizon": 1}, "horizon: expected non-empty text"),
        ({"model": ""}, "missing model"),
        ({"extras": [1, 2]}, "extras: expected an object"),
        ({"confidance": 0.5}, "unknown field(s) 'confidance'"),
        ({"direction": None, "target": None}, "give a direction, a target or both"),
    ],
)
def test_schema_refusals(data: dict[str, object], problem: str) -> None:
    base: dict[str, object] = {
        "ticker": "SBER",
        "generated_at": "2026-11-27T10:00:00Z",
        "horizon": "1d",
        "direction": "up",
        "model": "m",
    }
    with pytest.raises(SignalError) as info:
        make_signal({**base, **data}, known_tickers=["SBER"])
    assert problem in str(info.value)
    assert make_signal(base, known_tickers=["SBER"]).direction == 1
