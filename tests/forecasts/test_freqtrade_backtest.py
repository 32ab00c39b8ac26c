"""The freqtrade adapter inside freqtrade's own backtesting engine (the ``freqtrade`` extra).

Generated hourly candles in a user-data folder, a thesis database whose theses became
available at known moments (some mid-candle, one on a candle boundary, one with an early
``as_of`` but a late ``available_at``), and an example strategy that is ``ThesisStrategy``
mixed into freqtrade's ``IStrategy``. ``freqtrade backtesting`` runs as a user runs it, in
its own process; only the exchange's market list is supplied (``freqtrade_offline.py``).
Every entry and exit must happen at the first candle open at or after the thesis that
caused it became available, never earlier.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from robot_llm.store.db import make_engine
from robot_llm.store.migrate import upgrade
from tests.forecasts.conftest import seed_thesis, write_config

REPO = Path(__file__).resolve().parents[2]
UTC = timezone.utc
START = datetime(2026, 11, 2, tzinfo=UTC)
CANDLES = 72  # three days of 1h candles

STRATEGY = '''
from freqtrade.strategy import IStrategy

from robot_llm.strategies.freqtrade_adapter import ThesisStrategy


class RobotThesis(ThesisStrategy, IStrategy):
    """Long while the latest available thesis is bullish, out when it turns bearish."""

    INTERFACE_VERSION = 3
    timeframe = "1h"
    minimal_roi = {{"0": 100.0}}  # no take-profit: only the theses open and close trades
    stoploss = -0.99
    robot_llm_config = {config!r}
'''


def _freqtrade_installed() -> None:
    try:
        import freqtrade  # noqa: F401
    except ModuleNotFoundError:
        if os.environ.get("CI") == "true":
            pytest.fail("freqtrade must be installed in CI: pip install -e '.[freqtrade]'")
        pytest.skip("freqtrade is not installed (pip install -e '.[freqtrade]')")


def _candles(datadir: Path) -> None:
    import pandas as pd
    from freqtrade.data.history import get_datahandler
    from freqtrade.enums import CandleType

    dates = pd.date_range(START, periods=CANDLES, freq="1h", tz="UTC")
    close = [100.0 + i * 0.5 for i in range(CANDLES)]
    frame = pd.DataFrame(
        {
            "date": dates,
            "open": close,
            "high": [c + 1 for c in close],
            "low": [c - 1 for c in close],
            "close": close,
            "volume": [10.0] * CANDLES,
        }
    )
    get_datahandler(datadir, "feather").ohlcv_store("BTC/USDT", "1h", frame, CandleType.SPOT)


def _theses(db_url: str) -> dict[str, tuple[int, datetime]]:
    """Theses with known availability; returns name -> (id, available_at)."""
    upgrade(db_url)
    engine = make_engine(db_url)
    day = timedelta(days=1)
    plan = {
        # name: (as_of, available_at, stance)
        "bull1": (START + timedelta(hours=5), START + timedelta(hours=7, minutes=20), 0.8),  # mid-candle
        "bear1": (START + timedelta(hours=14), START + timedelta(hours=15, minutes=40), -0.8),
        "bull2": (START + day, START + day + timedelta(hours=3), 0.8),  # exactly on a candle boundary
        "bear2": (START + day + timedelta(hours=8), START + day + timedelta(hours=9, minutes=30), -0.8),
        # Written from data of 10:00 but committed at 20:10: usable from 21:00, not from 11:00.
        "bull3": (START + day + timedelta(hours=10), START + day + timedelta(hours=20, minutes=10), 0.8),
    }
    out = {}
    try:
        for name, (as_of, available_at, stance) in plan.items():
            thesis_id = seed_thesis(
                engine,
                ticker="BTC",
                as_of=as_of,
                available_at=available_at,
                valid_until=available_at + 3 * day,
                stance=stance,
                score=0.9,
            )
            out[name] = (thesis_id, available_at)
    finally:
        engine.dispose()
    return out


def _next_open(moment: datetime) -> datetime:
    """The first candle open at or after ``moment`` (where a signal computed at a close acts)."""
    hour = moment.replace(minute=0, second=0, microsecond=0)
    return hour if hour == moment else hour + timedelta(hours=1)


@pytest.mark.slow
def test_freqtrade_backtest_enters_only_after_theses_became_available(tmp_path: Path) -> None:
    _freqtrade_installed()
    user_data = tmp_path / "user_data"
    for sub in ("data/binance", "strategies", "backtest_results"):
        (user_data / sub).mkdir(parents=True)
    _candles(user_data / "data" / "binance")
    robot_config = write_config(tmp_path, "sqlite:///theses.sqlite", tickers=("BTC",))
    theses = _theses(f"sqlite:///{tmp_path / 'theses.sqlite'}")
    (user_data / "strategies" / "robot_thesis.py").write_text(
        STRATEGY.format(config=str(robot_config)), encoding="utf-8"
    )
    config = {
        "max_open_trades": 1,
        "stake_currency": "USDT",
        "stake_amount": 100,
        "dry_run": True,
        "dry_run_wallet": 1000,
        "timeframe": "1h",
        "trading_mode": "spot",
        "exchange": {"name": "binance", "key": "", "secret": "", "pair_whitelist": ["BTC/USDT"]},
        "pairlists": [{"method": "StaticPairList"}],
        "entry_pricing": {"price_side": "same"},
        "exit_pricing": {"price_side": "same"},
        "dataformat_ohlcv": "feather",
    }
    (tmp_path / "config.json").write_text(json.dumps(config), encoding="utf-8")

    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "tests" / "forecasts" / "freqtrade_offline.py"),
            "backtesting",
            "--config",
            str(tmp_path / "config.json"),
            "--userdir",
            str(user_data),
            "--strategy",
            "RobotThesis",
            "--timerange",
            f"{START:%Y%m%d}-{START + timedelta(hours=CANDLES):%Y%m%d}",
            "--export",
            "trades",
            "--cache",
            "none",
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]

    from freqtrade.data.btanalysis import load_backtest_data

    trades = load_backtest_data(user_data / "backtest_results").sort_values("open_date")
    got = [
        (row.open_date.to_pydatetime(), row.enter_tag, row.close_date.to_pydatetime()) for row in trades.itertuples()
    ]
    end = START + timedelta(hours=CANDLES - 1)  # still open at the end: closed on the last candle
    expected = [
        (_next_open(theses["bull1"][1]), f"thesis:{theses['bull1'][0]}", _next_open(theses["bear1"][1])),
        (_next_open(theses["bull2"][1]), f"thesis:{theses['bull2'][0]}", _next_open(theses["bear2"][1])),
        (_next_open(theses["bull3"][1]), f"thesis:{theses['bull3'][0]}", end),
    ]
    assert got == expected
    # And, the property itself: no trade opened before the thesis that caused it existed.
    available = {f"thesis:{tid}": at for tid, at in theses.values()}
    assert all(opened >= available[tag] for opened, tag, _ in got)
