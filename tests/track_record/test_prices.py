"""Prices in: a CSV folder, freqtrade's data folder and signals into the ``prices`` table (SQLite, PostgreSQL)."""

from __future__ import annotations

import json
import sys
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
from sqlalchemy import select
from track_helpers import MSK, config_file

from robot_llm.commands.main import main
from robot_llm.config import ConfigError, load_config
from robot_llm.ingest.prices import ingest_prices
from robot_llm.store.db import Price, Signal, make_engine, session_scope

NY = "America/New_York"


def _stored(db_url: str) -> dict[tuple[str, datetime], float]:
    engine = make_engine(db_url)
    try:
        with engine.connect() as conn:
            return {(t, when): c for t, when, c in conn.execute(select(Price.ticker, Price.time, Price.close))}
    finally:
        engine.dispose()


def test_csv_rows_times_rejects_and_reingest(tmp_path: Path, db_url: str, capsys) -> None:
    folder = tmp_path / "prices"
    folder.mkdir()
    (folder / "SBER.csv").write_text(
        "Time,Open,Close,Volume\n"
        "2026-11-30,300,301.5,10\n"  # a date: that day's close, 18:50 Moscow
        "2026-12-01T18:50:00+03:00,301,302.25,11\n"
        "2026-12-02T18:50:00,302,303,12\n"  # no zone
        "2026-12-03,303,-1,13\n"
        "2026-13-01,1,2,3\n"
        "\n"
        "2026-12-04T15:50:00Z,303,304,14\n"
        "2026-12-04T18:50:00+03:00,303,305,14\n"  # the same moment again, another close
        "2026-12-05,abc\n",
        encoding="utf-8",
    )
    (folder / "AAPL.csv").write_text("time,close\n2026-11-30,230.1\n", encoding="utf-8")
    (folder / "MSFT.csv").write_text("time,close\n2026-11-30,500\n", encoding="utf-8")  # not an instrument
    cfg = config_file(
        tmp_path, db_url, {"csv": "prices", "close_times": {"AAPL": f"16:00 {NY}"}}, ("SBER", "AAPL", "GAZP")
    )
    assert main(["prices", "ingest", "-c", str(cfg)]) == 0
    out = capsys.readouterr().out
    sber = folder / "SBER.csv"
    assert f"{sber}: 3 read, 3 stored, 0 already stored, 0 conflicting, 5 rejected" in out
    assert f"{sber}:4: time '2026-12-02T18:50:00' has no zone" in out
    assert f"{sber}:5: close must be a positive number, got '-1'" in out
    assert f"{sber}:6: invalid date '2026-13-01'" in out
    assert f"{sber}:9: 2026-12-04T15:50:00+00:00 is also on line 8 with another close" in out
    assert f"{sber}:10: expected at least 3 columns, got 2" in out
    assert "MSFT" not in out
    stored = _stored(db_url)
    assert stored == {
        ("SBER", datetime(2026, 11, 30, 15, 50, tzinfo=timezone.utc)): 301.5,
        ("SBER", datetime(2026, 12, 1, 15, 50, tzinfo=timezone.utc)): 302.25,
        ("SBER", datetime(2026, 12, 4, 15, 50, tzinfo=timezone.utc)): 304.0,
        ("AAPL", datetime(2026, 11, 30, 21, 0, tzinfo=timezone.utc)): 230.1,  # 16:00 in New York
    }
    # Again: nothing new. A changed close is reported and the stored one kept.
    (folder / "AAPL.csv").write_text("time,close\n2026-11-30,231\n2026-12-01,232\n", encoding="utf-8")
    assert main(["prices", "ingest", "-c", str(cfg)]) == 0
    out = capsys.readouterr().out
    assert f"{sber}: 3 read, 0 stored, 3 already stored, 0 conflicting, 5 rejected" in out
    aapl = folder / "AAPL.csv"
    assert f"{aapl}: 2 read, 1 stored, 0 already stored, 1 conflicting" in out
    assert f"{aapl}:2: AAPL 2026-11-30T21:00:00+00:00 is stored with close 230.1, not 231.0; kept the stored one" in out
    after = _stored(db_url)
    assert len(after) == 5 and after[("AAPL", datetime(2026, 11, 30, 21, 0, tzinfo=timezone.utc))] == 230.1


def test_a_bad_header_fails_the_file_only(tmp_path: Path, db_url: str, capsys) -> None:
    folder = tmp_path / "prices"
    folder.mkdir()
    (folder / "SBER.csv").write_text("date,price\n2026-11-30,1\n", encoding="utf-8")
    (folder / "GAZP.csv").write_text("time,close\n2026-11-30,150\n", encoding="utf-8")
    cfg = config_file(tmp_path, db_url, {"csv": "prices"}, ("SBER", "GAZP"))
    assert main(["prices", "ingest", "-c", str(cfg)]) == 1
    out = capsys.readouterr().out
    assert f"{folder / 'SBER.csv'}:1: the header must name the columns time and close" in out
    assert list(_stored(db_url)) == [("GAZP", datetime(2026, 11, 30, 15, 50, tzinfo=timezone.utc))]


def test_freqtrade_json_and_feather(tmp_path: Path, db_url: str) -> None:
    data = tmp_path / "user_data" / "data" / "binance"
    data.mkdir(parents=True)
    opened = datetime(2026, 11, 30, tzinfo=timezone.utc)
    ms = int(opened.timestamp() * 1000)
    candles = [
        [ms, 1, 2, 0.5, 95000.5, 10],
        [ms + 86_400_000, 1, 2, 0.5, "x", 10],
        [ms + 2 * 86_400_000, 1, 2, 0.5, 96000, 1],
    ]
    (data / "BTC_USDT-1d.json").write_text(json.dumps(candles), encoding="utf-8")
    pd = pytest.importorskip("pandas")
    pytest.importorskip("pyarrow")
    frame = pd.DataFrame(
        {
            "date": pd.to_datetime([opened, opened + timedelta(days=1)], utc=True),
            "open": [1.0, 1.0],
            "high": [2.0, 2.0],
            "low": [0.5, 0.5],
            "close": [3500.0, 3600.0],
            "volume": [1.0, 1.0],
        }
    )
    frame.to_feather(data / "ETH_USDT-1d.feather")
    prices = {"freqtrade": {"data_dir": str(data), "timeframe": "1d", "pairs": {"BTC": "BTC/USDT", "ETH": "ETH/USDT"}}}
    config = load_config(config_file(tmp_path, db_url, prices, ("BTC", "ETH")))
    engine = make_engine(db_url)
    try:
        results = {r.ticker: r for r in ingest_prices(config, engine)}
    finally:
        engine.dispose()
    assert results["BTC"].rejects == [f"{data / 'BTC_USDT-1d.json'}:candle 2: could not convert string to float: 'x'"]
    day = timedelta(days=1)
    # A candle is dated by its open; its close is known when it ends.
    assert _stored(db_url) == {
        ("BTC", opened + day): 95000.5,
        ("BTC", opened + 3 * day): 96000.0,
        ("ETH", opened + day): 3500.0,
        ("ETH", opened + 2 * day): 3600.0,
    }


def test_feather_without_pyarrow_says_what_to_install(tmp_path: Path, db_url: str, monkeypatch) -> None:
    data = tmp_path / "ft"
    data.mkdir()
    (data / "BTC_USDT-1h.feather").write_bytes(b"not read")
    prices = {"freqtrade": {"data_dir": str(data), "timeframe": "1h", "pairs": {"BTC": "BTC/USDT"}}}
    config = load_config(config_file(tmp_path, db_url, prices, ("BTC",)))
    monkeypatch.setitem(sys.modules, "pandas", None)  # what an install without the extra looks like
    engine = make_engine(db_url)
    try:
        (result,) = ingest_prices(config, engine)
    finally:
        engine.dispose()
    assert result.error == f"{data / 'BTC_USDT-1h.feather'}: reading feather needs pandas and pyarrow: " + (
        "pip install 'robot-llm[feather]'"
    )


def test_signals_that_carry_a_price(tmp_path: Path, db_url: str) -> None:
    engine = make_engine(db_url)
    when = datetime(2026, 11, 30, 18, 45, tzinfo=MSK)
    try:
        with session_scope(engine) as s:
            for i, extras in enumerate(({"close": 301.2}, {"close": "n/a"}, {"features": 3})):
                s.add(
                    Signal(
                        ticker="SBER",
                        generated_at=when + timedelta(minutes=i),
                        received_at=when,
                        horizon="1d",
                        direction=1,
                        target=None,
                        confidence=None,
                        model="gbm",
                        extras=extras,
                        source="robot",
                    )
                )
        config = load_config(config_file(tmp_path, db_url, {"signal_price": "close"}, ("SBER",)))
        (result,) = ingest_prices(config, engine)
        (again,) = ingest_prices(config, engine)
    finally:
        engine.dispose()
    assert (result.stored, len(result.rejects)) == (
        1,
        1,
    ) and "extras.close must be a positive number" in result.rejects[0]
    assert (again.stored, again.duplicates) == (0, 1)
    assert _stored(db_url) == {("SBER", when.astimezone(timezone.utc)): 301.2}


def test_the_prices_section_is_checked(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'x.sqlite'}"
    config = load_config(config_file(tmp_path, url, {"csv": "prices", "horizons": ["1d", "5d"], "benchmark": "IMOEX"}))
    assert config.prices.horizons == (timedelta(days=1), timedelta(days=5)) and config.prices.enabled
    assert config.prices.csv == tmp_path / "prices"
    assert not load_config(config_file(tmp_path, url, {})).prices.enabled
    for prices, message in (
        ({"horizons": ["often"]}, "prices.horizons[0]: expected a duration like '15m', got 'often'"),
        ({"horizons": []}, "give at least one horizon"),
        ({"close_times": {"MSFT": "16:00"}}, "prices.close_times.MSFT: unknown ticker 'MSFT'"),
        ({"close_times": {"SBER": "16:00 Mars/Base"}}, "unknown time zone 'Mars/Base'"),
        ({"min_count": 2}, "prices.min_count: "),
        ({"freqtrade": {"data_dir": ".", "timeframe": "1M", "pairs": {"SBER": "X/Y"}}}, "freqtrade timeframe"),
        ({"bootstrap_count": 3}, "prices.bootstrap_count: unknown key"),
    ):
        with pytest.raises(ConfigError) as err:
            load_config(config_file(tmp_path, url, prices))
        assert message in str(err.value) and str(err.value).startswith(f"{tmp_path / 'robot-llm.yaml'}:"), err.value
