"""The example strategies on a seeded database, and the freqtrade adapter's no-look-ahead guarantee."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from pathlib import Path
from types import ModuleType

import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sqlalchemy.engine import Engine

from robot_llm.forecasts import Forecasts, ForecastsError, ThesisRecord, to_dataframe
from tests.forecasts.conftest import seed_signal, seed_thesis, write_config

UTC = timezone.utc
T = datetime(2026, 11, 30, 6, 0, tzinfo=UTC)  # 09:00 in Moscow, a Monday morning


@pytest.fixture
def forecasts(db_url: str) -> Forecasts:
    fc = Forecasts.open(db_url)
    yield fc
    fc.close()


# --------------------------------------------------------------------------- (a) stance gate


def _night(engine: Engine, ticker: str, stance: float | None, score: float = 1.0, **kw: object) -> int:
    as_of = kw.pop("as_of", T - timedelta(hours=10))
    available_at = kw.pop("available_at", T - timedelta(hours=7))
    return seed_thesis(engine, ticker=ticker, as_of=as_of, available_at=available_at, stance=stance, score=score, **kw)


def test_stance_gate_decisions(engine: Engine, forecasts: Forecasts, stance_gate: ModuleType) -> None:
    sig = {}
    for ticker, direction, confidence in [
        ("AGREE", 1, 0.8),
        ("WEAK", 1, 0.8),
        ("DISAGREE", 1, 0.9),
        ("SHORT", -1, None),
        ("NOTHESIS", 1, 1.0),
        ("STALE", 1, 1.0),
        ("FUTURE", 1, 1.0),
        ("FLAT", 0, 1.0),
        ("NEUTRAL", 1, 1.0),
    ]:
        sig[ticker] = seed_signal(
            engine, ticker=ticker, generated_at=T - timedelta(hours=2), direction=direction, confidence=confidence
        )
    # A robot forecast delivered after the decision moment must not be used.
    seed_signal(engine, ticker="LATE", generated_at=T - timedelta(hours=1), received_at=T + timedelta(minutes=1))
    th = {
        "AGREE": _night(engine, "AGREE", 0.6, 0.5),
        "WEAK": _night(engine, "WEAK", 0.2, 0.5),
        "DISAGREE": _night(engine, "DISAGREE", -0.5),
        "SHORT": _night(engine, "SHORT", -0.9),
        "STALE": _night(engine, "STALE", 0.9, valid_until=T - timedelta(minutes=1)),
        "FUTURE": _night(engine, "FUTURE", -1.0, available_at=T + timedelta(seconds=1)),
        "FLAT": _night(engine, "FLAT", 0.9),
        "NEUTRAL": _night(engine, "NEUTRAL", 0.0),
    }
    tickers = [*sig, "LATE"]
    d = {x.ticker: x for x in stance_gate.decide_all(forecasts, tickers, T.astimezone(timezone(timedelta(hours=3))))}

    assert (d["AGREE"].action, d["AGREE"].thesis_id, d["AGREE"].signal_id) == ("long", th["AGREE"], sig["AGREE"])
    assert d["AGREE"].size == pytest.approx(0.8 * (1 + 0.6 * 0.5) / 2)
    assert d["AGREE"].agreement == pytest.approx(0.6)
    assert d["WEAK"].action == "long" and 0 < d["WEAK"].size < d["AGREE"].size  # size scales with agreement
    assert (d["DISAGREE"].action, d["DISAGREE"].size) == ("skip", 0.0)
    assert "disagrees" in d["DISAGREE"].reason and d["DISAGREE"].thesis_id == th["DISAGREE"]
    assert d["SHORT"].action == "short" and d["SHORT"].size == pytest.approx((1 + 0.9) / 2)
    # No thesis, a stale one, or one not yet available: the thesis abstains, the robot trades at half size.
    for ticker in ("NOTHESIS", "STALE", "FUTURE"):
        assert (d[ticker].action, d[ticker].size, d[ticker].thesis_id) == ("long", 0.5, None), ticker
        assert "abstains" in d[ticker].reason
    assert d["AGREE"].size > d["NOTHESIS"].size * 0.8  # agreeing never sizes below abstaining
    assert d["FLAT"].action == "skip" and "flat" in d["FLAT"].reason
    assert d["NEUTRAL"].action == "skip" and "does not support" in d["NEUTRAL"].reason
    assert d["LATE"].action == "skip" and d["LATE"].reason == "no robot forecast"

    strict = stance_gate.GateParams(abstain_size=0.0)
    assert stance_gate.decide(forecasts, "NOTHESIS", T, strict).action == "skip"
    # A minute after the late signal arrives, it is seen.
    assert stance_gate.decide(forecasts, "LATE", T + timedelta(minutes=1)).action == "long"
    with pytest.raises(ValueError, match="abstain_size"):
        stance_gate.GateParams(abstain_size=2.0)


def test_stance_gate_main(db_url: str, engine: Engine, tmp_path: Path, stance_gate: ModuleType, capsys) -> None:
    seed_signal(engine, ticker="SBER", generated_at=T - timedelta(hours=1), direction=1, confidence=1.0)
    seed_signal(engine, ticker="GAZP", generated_at=T - timedelta(hours=1), direction=1, confidence=1.0)
    _night(engine, "SBER", 0.8)
    _night(engine, "GAZP", -0.8)
    config = write_config(tmp_path, db_url)
    assert stance_gate.main(["-c", str(config), "--as-of", "2026-11-30T09:00+03:00"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "stance_gate decisions as of 2026-11-30T06:00:00+00:00"
    assert out[1].split()[:2] == ["SBER", "long"] and out[2].split()[:2] == ["GAZP", "skip"]
    assert stance_gate.main(["-c", str(config), "--as-of", "2026-11-30T09:00"]) == 2
    assert "has no zone" in capsys.readouterr().err


# --------------------------------------------------------------------------- (b) freqtrade adapter


def _record(i: int, available_at: datetime, *, as_of: datetime | None = None, valid: timedelta, stance: float = 1.0):
    return ThesisRecord(
        id=i,
        ticker="AAA",
        text=f"thesis {i}",
        stance=stance,
        stance_label="up" if stance > 0 else "down",
        score=1.0,
        as_of=as_of if as_of is not None else available_at - timedelta(hours=1),
        available_at=available_at,
        valid_until=available_at + valid,
        model_id="m",
        template_name="t",
        template_version="1",
        news_ids=(),
        signal_ids=(),
    )


def _candles(start: datetime, step: timedelta, closes: list[float]) -> pd.DataFrame:
    dates = pd.to_datetime([start + step * i for i in range(len(closes))], utc=True).astype("datetime64[ns, UTC]")
    opens = [closes[0], *closes[:-1]]
    return pd.DataFrame({"date": dates, "open": opens, "close": closes})


@settings(max_examples=60, deadline=None)
@given(
    timeframe=st.sampled_from(["5m", "1h", "1d"]),
    n=st.integers(1, 30),
    theses=st.lists(
        st.tuples(st.integers(-2000, 40 * 24 * 60), st.integers(-30, 3 * 24 * 60), st.integers(0, 600)), max_size=8
    ),
)
def test_adapter_never_attaches_a_thesis_before_it_exists(
    freqtrade_adapter: ModuleType, timeframe: str, n: int, theses: list[tuple[int, int, int]]
) -> None:
    step = freqtrade_adapter.parse_timeframe(timeframe)
    start = datetime(2026, 11, 1, tzinfo=UTC)
    candles = _candles(start, step, [100.0] * n)
    records = [
        _record(
            i + 1, start + timedelta(minutes=a), as_of=start + timedelta(minutes=a - lag), valid=timedelta(minutes=v)
        )
        for i, (a, v, lag) in enumerate(theses)
    ]
    merged = freqtrade_adapter.merge_theses(candles, to_dataframe(records), timeframe)
    assert list(merged["date"]) == list(candles["date"]) and len(merged) == n
    for row in merged.itertuples(index=False):
        close = row.date.to_pydatetime() + step
        available = [r for r in records if r.available_at <= close]
        latest = max(available, key=lambda r: (r.available_at, r.as_of, r.id), default=None)
        want = latest.id if latest is not None and close < latest.valid_until else None
        got = None if pd.isna(row.thesis_id) else int(row.thesis_id)
        assert got == want
        if got is not None:
            assert row.thesis_available_at.to_pydatetime() <= close, "thesis attached before it was available"


def test_adapter_regression_no_look_ahead(freqtrade_adapter: ModuleType) -> None:
    """LEAN-style: a thesis that 'knows' the next candle's jump wins every time only with look-ahead.

    Hourly candles; the jump happens in candle 3 (03:00-04:00). The thesis's data cut-off is
    02:30, inside candle 2, but it was committed at 03:20 — after candle 2 closed. A strategy
    enters at the next candle's open on a bullish thesis and exits at that candle's close.
    """
    step = timedelta(hours=1)
    start = datetime(2026, 12, 1, tzinfo=UTC)
    candles = _candles(start, step, [100.0, 100.0, 100.0, 150.0, 150.0, 150.0])
    thesis = _record(
        7,
        start + timedelta(hours=3, minutes=20),
        as_of=start + timedelta(hours=2, minutes=30),
        valid=timedelta(hours=6),
    )
    theses = to_dataframe([thesis])

    def backtest(frame: pd.DataFrame) -> list[float]:
        returns = []
        for k in range(len(frame) - 1):
            if not pd.isna(frame["thesis_id"].iloc[k]) and frame["thesis_stance"].iloc[k] > 0:
                nxt = candles.iloc[k + 1]
                returns.append(nxt["close"] / nxt["open"] - 1)
        return returns

    merged = freqtrade_adapter.merge_theses(candles, theses, "1h")
    assert pd.isna(merged["thesis_id"].iloc[2]), "thesis used on the candle that closed before it existed"
    assert int(merged["thesis_id"].iloc[3]) == 7  # first candle whose close (04:00) is after 03:20
    assert max(backtest(merged)) == 0.0  # it never catches the jump

    # The same backtest merged on the thesis's data cut-off (the mistake) catches it every time:
    # proof that this test would fail if the adapter looked ahead.
    leaky = candles.assign(_close=candles["date"] + step).sort_values("_close")
    leaky = pd.merge_asof(
        leaky, theses.rename(columns={"id": "thesis_id", "stance": "thesis_stance"}), left_on="_close", right_on="as_of"
    )
    assert backtest(leaky)[0] == pytest.approx(0.5)


def test_adapter_refuses_ambiguous_input(freqtrade_adapter: ModuleType) -> None:
    candles = _candles(datetime(2026, 12, 1, tzinfo=UTC), timedelta(hours=1), [1.0, 2.0])
    theses = to_dataframe([_record(1, datetime(2026, 12, 1, tzinfo=UTC), valid=timedelta(days=1))])
    with pytest.raises(ForecastsError, match="naive"):
        freqtrade_adapter.merge_theses(candles.assign(date=candles["date"].dt.tz_localize(None)), theses, "1h")
    with pytest.raises(ForecastsError, match="unsupported timeframe"):
        freqtrade_adapter.merge_theses(candles, theses, "1M")
    two = pd.concat([theses, theses.assign(ticker="BBB", id=2)], ignore_index=True)
    with pytest.raises(ForecastsError, match="one instrument at a time"):
        freqtrade_adapter.merge_theses(candles, two, "1h")


def test_thesis_strategy_on_a_database(engine: Engine, forecasts: Forecasts, freqtrade_adapter: ModuleType) -> None:
    start = datetime(2026, 11, 30, tzinfo=UTC)
    # One thesis from long before the frame (still valid at its start), then two during it.
    early = seed_thesis(
        engine,
        ticker="SBER",
        as_of=start - timedelta(days=3),
        available_at=start - timedelta(days=2),
        valid_until=start + timedelta(hours=5),
        stance=0.8,
        score=0.9,
    )
    bear = seed_thesis(
        engine,
        ticker="SBER",
        as_of=start + timedelta(hours=9),
        available_at=start + timedelta(hours=10, minutes=5),
        stance=-0.7,
    )
    bull = seed_thesis(
        engine, ticker="SBER", as_of=start + timedelta(hours=20), available_at=start + timedelta(hours=23), stance=0.6
    )
    seed_thesis(engine, ticker="GAZP", as_of=start, available_at=start + timedelta(hours=1), stance=1.0)
    strategy = freqtrade_adapter.ThesisStrategy()
    strategy.forecasts = forecasts
    frame = _candles(start, timedelta(hours=1), [100.0] * 30)
    meta = {"pair": "SBER/RUB"}
    frame = strategy.populate_indicators(frame, meta)
    frame = strategy.populate_exit_trend(strategy.populate_entry_trend(frame, meta), meta)
    seen = set()
    for row in frame.itertuples(index=False):
        close = row.date.to_pydatetime() + timedelta(hours=1)
        want = forecasts.latest("SBER", close)
        got = None if pd.isna(row.thesis_id) else int(row.thesis_id)
        assert got == (want.id if want else None), close  # the adapter agrees with latest() at every close
        seen.add(got)
        assert bool(row.enter_long) == (want is not None and want.stance >= 0.3)
        assert bool(row.exit_long) == (want is not None and want.stance <= -0.3)
        if row.enter_long:
            assert row.enter_tag == f"thesis:{want.id}"
    assert seen == {early, None, bear, bull}


def test_adapter_main(db_url: str, engine: Engine, tmp_path: Path, freqtrade_adapter: ModuleType, capsys) -> None:
    seed_thesis(engine, ticker="SBER", as_of=T - timedelta(hours=10), available_at=T - timedelta(hours=2), stance=0.9)
    config = write_config(tmp_path, db_url)
    argv = ["-c", str(config), "--as-of", T.isoformat(), "--ticker", "SBER", "--candles", "4"]
    assert freqtrade_adapter.main(argv) == 0
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if line.startswith("  close 2026")]
    assert len(lines) == 4
    # Candles close at 03:00, 04:00, 05:00, 06:00 UTC; the thesis was committed at 04:00.
    assert "no valid thesis" in lines[0]
    assert all("ENTER LONG" in line and "stance +0.90" in line for line in lines[1:])


def test_adapter_main_right_after_a_night(
    db_url: str, engine: Engine, tmp_path: Path, freqtrade_adapter: ModuleType, capsys
) -> None:
    """Theses committed after the last closed candle (the demo's case) show on the candle still forming."""
    thesis = seed_thesis(engine, ticker="SBER", as_of=T, available_at=T + timedelta(minutes=10), stance=0.9)
    config = write_config(tmp_path, db_url)
    as_of = T + timedelta(minutes=20)
    argv = ["-c", str(config), "--as-of", as_of.isoformat(), "--ticker", "SBER", "--candles", "3"]
    assert freqtrade_adapter.main(argv) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith(("  close", "  next"))]
    assert len(rows) == 4
    assert all("no valid thesis" in line for line in rows[:3])  # closed at 04:00, 05:00, 06:00
    assert rows[3].startswith(f"  next  {(T + timedelta(hours=1)).isoformat()}")
    assert f"thesis {thesis} stance +0.90" in rows[3] and rows[3].endswith("ENTER LONG")
