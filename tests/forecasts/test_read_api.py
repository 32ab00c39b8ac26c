"""The read API on real SQLite and PostgreSQL: point-in-time, staleness, days, history, signals."""

from __future__ import annotations

import subprocess
import sys
import threading
from dataclasses import FrozenInstanceError, dataclass
from datetime import date, datetime, time, timedelta, timezone
from zoneinfo import ZoneInfo

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy.engine import Engine

from robot_llm.errors import RobotLLMError
from robot_llm.forecasts import (
    Forecasts,
    ForecastsError,
    NaiveDatetimeError,
    ThesisRecord,
    parse_moment,
    to_dataframe,
)
from robot_llm.store.db import DatabaseError, make_engine
from tests.conftest import REPO
from tests.forecasts.conftest import clear, seed_signal, seed_thesis, unique_template, write_config

UTC = timezone.utc
BASE = datetime(2026, 3, 1, tzinfo=UTC)  # the window spans New York's DST change (8 March)
ZONES = [
    UTC,
    ZoneInfo("Europe/Moscow"),
    ZoneInfo("America/New_York"),
    ZoneInfo("Asia/Kathmandu"),
    ZoneInfo("Pacific/Chatham"),
    timezone(timedelta(hours=-3, minutes=-30)),
]


@pytest.fixture
def forecasts(db_url: str) -> Forecasts:
    fc = Forecasts.open(db_url)
    yield fc
    fc.close()


def test_import_is_light() -> None:
    code = (
        "import sys, robot_llm.forecasts\n"
        "heavy = [m for m in ('torch', 'apscheduler', 'jinja2', 'deepspeed', 'pandas') if m in sys.modules]\n"
        "print(','.join(heavy))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"robot_llm.forecasts imported {out.stdout.strip()}"


def test_reading_through_the_config_stays_light(tmp_path) -> None:
    from robot_llm.store.migrate import upgrade

    db_url = f"sqlite:///{tmp_path / 'light.sqlite'}"  # one backend is enough: this is about imports
    upgrade(db_url)
    engine = make_engine(db_url)
    seed_thesis(engine, ticker="SBER", as_of=BASE, available_at=BASE, valid_until=BASE + timedelta(days=9))
    engine.dispose()
    config = write_config(tmp_path, db_url)
    code = (
        "import sys\n"
        "from datetime import datetime, timezone\n"
        "from robot_llm.forecasts import Forecasts\n"
        f"with Forecasts.from_config({str(config)!r}) as fc:\n"
        "    rec = fc.latest('SBER', datetime(2026, 3, 2, tzinfo=timezone.utc))\n"
        "    print(rec.ticker, fc.timezone, fc.tickers)\n"
        "print([m for m in ('torch', 'jinja2', 'deepspeed', 'pandas') if m in sys.modules])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.splitlines() == ["SBER Europe/Moscow ('SBER', 'GAZP')", "[]"]


# --------------------------------------------------------------------------- the property


@dataclass(frozen=True)
class Stored:
    id: int
    ticker: str
    as_of: datetime
    available_at: datetime
    valid_until: datetime


def _expected(stored: list[Stored], ticker: str, moment: datetime) -> Stored | None:
    """The specification, independently: latest by (as_of, available_at, id) among rows available at moment."""
    candidates = [s for s in stored if s.ticker == ticker and s.available_at <= moment]
    # The newest data cut-off first, then the newest commit: a backfill does not hide tonight's.
    return max(candidates, key=lambda s: (s.as_of, s.available_at, s.id), default=None)


rows_strategy = st.lists(
    st.tuples(
        st.sampled_from(["AAA", "BBB"]),
        st.integers(0, 14 * 24 * 60),  # available_at, minutes after BASE
        st.integers(0, 3 * 24 * 60),  # as_of lag before availability, minutes
        st.integers(-60, 3 * 24 * 60),  # validity after availability, minutes (negative: born stale)
        st.integers(0, 999_999),  # microseconds, so boundaries are exact instants
    ),
    max_size=8,
)
query_strategy = st.tuples(
    st.sampled_from(["free", "exact", "just_before"]),
    st.integers(-60, 16 * 24 * 60),
    st.sampled_from(ZONES),
    st.sampled_from(["AAA", "BBB"]),
)


@settings(
    max_examples=30,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(data=st.data())
def test_as_of_never_sees_the_future_and_always_sees_the_latest(
    data: st.DataObject, engine: Engine, forecasts: Forecasts
) -> None:
    clear(engine)
    rows = data.draw(rows_strategy, label="rows")
    order = data.draw(st.permutations(range(len(rows))), label="insertion order")
    stored: list[Stored] = []
    for i in order:
        ticker, avail_min, lag, validity, micros = rows[i]
        available_at = BASE + timedelta(minutes=avail_min, microseconds=micros)
        as_of = available_at - timedelta(minutes=lag)
        valid_until = available_at + timedelta(minutes=validity)
        thesis_id = seed_thesis(
            engine,
            ticker=ticker,
            as_of=as_of,
            available_at=available_at,
            valid_until=valid_until,
            template_name=unique_template(),
        )
        stored.append(Stored(thesis_id, ticker, as_of, available_at, valid_until))

    for mode, offset, zone, ticker in data.draw(st.lists(query_strategy, min_size=1, max_size=6), label="queries"):
        if mode != "free" and stored:
            anchor = stored[offset % len(stored)]
            ticker = anchor.ticker
            moment = anchor.available_at if mode == "exact" else anchor.available_at - timedelta(microseconds=1)
        else:
            moment = BASE + timedelta(minutes=offset)
        moment = moment.astimezone(zone)  # the same instant, seen from any zone

        best = _expected(stored, ticker, moment)
        got_any = forecasts.latest(ticker, moment, include_stale=True)
        got = forecasts.latest(ticker, moment)
        if got_any is not None:
            assert got_any.available_at <= moment, "a thesis stored after the query moment was returned"
        assert (got_any.id if got_any else None) == (best.id if best else None)
        fresh = best if best is not None and moment < best.valid_until else None
        assert (got.id if got else None) == (fresh.id if fresh else None), "stale must abstain, not fall back"
        if got is not None:
            assert got.available_at <= moment < got.valid_until
            assert got.ticker == ticker

    lo = BASE + timedelta(minutes=data.draw(st.integers(0, 7 * 24 * 60), label="history start"))
    hi = lo + timedelta(minutes=data.draw(st.integers(0, 8 * 24 * 60), label="history length"))
    history = forecasts.history(None, lo.astimezone(ZONES[3]), hi.astimezone(ZONES[4]))
    want = sorted((s for s in stored if lo <= s.available_at <= hi), key=lambda s: (s.available_at, s.as_of, s.id))
    assert [r.id for r in history] == [s.id for s in want]


# --------------------------------------------------------------------------- examples


def test_records_are_typed_and_frozen(engine: Engine, forecasts: Forecasts) -> None:
    t = BASE + timedelta(hours=20)
    tid = seed_thesis(
        engine,
        ticker="SBER",
        as_of=t,
        available_at=t + timedelta(hours=3),
        stance=-0.4,
        score=0.7,
        stance_label="падение",
        text="Сбербанк: давление на маржу.",
        template_name="thesis_ru",
        template_version="3",
        model_id="yalm-100b",
        news_ids=(5, 9),
        signal_ids=(2,),
    )
    rec = forecasts.latest("SBER", t + timedelta(hours=4))
    assert rec == ThesisRecord(
        id=tid,
        ticker="SBER",
        text="Сбербанк: давление на маржу.",
        stance=-0.4,
        stance_label="падение",
        score=0.7,
        as_of=t,
        available_at=t + timedelta(hours=3),
        valid_until=t + timedelta(hours=27),
        model_id="yalm-100b",
        template_name="thesis_ru",
        template_version="3",
        news_ids=(5, 9),
        signal_ids=(2,),
    )
    assert rec.as_of.tzinfo is not None and rec.as_of.utcoffset() == timedelta(0)
    with pytest.raises(FrozenInstanceError):
        rec.stance = 1.0  # type: ignore[misc]


def test_stale_abstains_unless_asked(engine: Engine, forecasts: Forecasts) -> None:
    t = BASE
    old = seed_thesis(engine, ticker="AAA", as_of=t, available_at=t, valid_until=t + timedelta(days=5))
    new = seed_thesis(
        engine,
        ticker="AAA",
        as_of=t + timedelta(days=1),
        available_at=t + timedelta(days=1),
        valid_until=t + timedelta(days=2),
    )
    at = t + timedelta(days=3)
    # The newest thesis is stale: abstain; the older, still "valid" one does not stand in for it.
    assert forecasts.latest("AAA", at) is None
    assert forecasts.latest("AAA", at, include_stale=True).id == new
    assert forecasts.latest("AAA", t + timedelta(hours=12)).id == old
    stale = forecasts.latest("AAA", at, include_stale=True)
    assert not stale.is_valid_at(at) and stale.is_valid_at(t + timedelta(days=1))
    assert not stale.is_valid_at(t + timedelta(days=1) - timedelta(microseconds=1))  # not yet available
    # valid_until itself is already stale
    assert forecasts.latest("AAA", t + timedelta(days=2)) is None
    assert forecasts.latest("AAA", t + timedelta(days=2) - timedelta(microseconds=1)).id == new


def test_naive_datetimes_are_refused(forecasts: Forecasts) -> None:
    naive = datetime(2026, 3, 1, 9, 30)
    with pytest.raises(NaiveDatetimeError, match="naive datetime"):
        forecasts.latest("AAA", naive)
    with pytest.raises(NaiveDatetimeError):
        forecasts.history("AAA", naive, naive)
    with pytest.raises(NaiveDatetimeError):
        forecasts.latest_signal("AAA", naive)
    with pytest.raises(ForecastsError, match="expected an aware datetime"):
        forecasts.latest("AAA", date(2026, 3, 1))  # type: ignore[arg-type]
    assert issubclass(NaiveDatetimeError, RobotLLMError)


def test_template_filter_and_tie_breaks(engine: Engine, forecasts: Forecasts) -> None:
    t = BASE
    ru = seed_thesis(engine, ticker="AAA", as_of=t, available_at=t + timedelta(hours=1), template_name="thesis_ru")
    en = seed_thesis(engine, ticker="AAA", as_of=t, available_at=t + timedelta(hours=2), template_name="thesis_en")
    at = t + timedelta(hours=3)
    assert forecasts.latest("AAA", at).id == en
    assert forecasts.latest("AAA", at, template="thesis_ru").id == ru
    assert forecasts.latest("AAA", t + timedelta(hours=1, minutes=30), template="thesis_en") is None
    assert forecasts.latest_many(["AAA", "ZZZ"], at) == {"AAA": forecasts.latest("AAA", at), "ZZZ": None}


def test_for_day_uses_the_morning_cutoff_in_the_zone(db_url: str, engine: Engine) -> None:
    msk = ZoneInfo("Europe/Moscow")
    fc = Forecasts.open(db_url, tz=msk, cutoff=time(9, 30))
    try:
        sunday_night = datetime(2026, 11, 29, 23, 0, tzinfo=msk)  # for Monday 30 November
        monday_0929 = datetime(2026, 11, 30, 9, 29, tzinfo=msk)  # still for Monday
        monday_0930 = datetime(2026, 11, 30, 9, 30, tzinfo=msk)  # for Tuesday
        saturday = datetime(2026, 11, 28, 12, 0, tzinfo=msk)  # for Sunday
        ids = {
            name: seed_thesis(engine, ticker=tk, as_of=when, available_at=when + timedelta(hours=1))
            for name, tk, when in [
                ("sun", "SBER", sunday_night),
                ("mon_early", "GAZP", monday_0929),
                ("mon_cut", "SBER", monday_0930),
                ("sat", "SBER", saturday),
            ]
        }
        monday = fc.for_day(date(2026, 11, 30))
        assert [r.id for r in monday] == [ids["mon_early"], ids["sun"]]  # ordered by ticker
        assert [r.id for r in fc.for_day(date(2026, 12, 1))] == [ids["mon_cut"]]
        assert [r.id for r in fc.for_day(date(2026, 11, 30), tickers=["SBER"])] == [ids["sun"]]
        # The same day seen from UTC shifts the window by three hours: 06:29 UTC Monday is before 09:30 UTC.
        assert {r.id for r in fc.for_day(date(2026, 11, 30), "UTC")} == {ids["sun"], ids["mon_early"], ids["mon_cut"]}
        with pytest.raises(ForecastsError, match="expected a date"):
            fc.for_day(datetime(2026, 11, 30, tzinfo=msk))
    finally:
        fc.close()


def test_history_bounds_are_inclusive_and_ordered(engine: Engine, forecasts: Forecasts) -> None:
    t = BASE
    a = seed_thesis(engine, ticker="AAA", as_of=t, available_at=t + timedelta(hours=5))
    b = seed_thesis(engine, ticker="BBB", as_of=t, available_at=t + timedelta(hours=1))
    c = seed_thesis(engine, ticker="AAA", as_of=t + timedelta(hours=1), available_at=t + timedelta(hours=9))
    assert [r.id for r in forecasts.history(None, t + timedelta(hours=1), t + timedelta(hours=9))] == [b, a, c]
    assert [r.id for r in forecasts.history("AAA", t, t + timedelta(hours=8))] == [a]
    with pytest.raises(ForecastsError, match="before start"):
        forecasts.history(None, t + timedelta(hours=1), t)
    frame = forecasts.history_frame("AAA", t, t + timedelta(days=1))
    assert list(frame["id"]) == [a, c]
    assert str(frame["available_at"].dtype) == "datetime64[ns, UTC]"
    assert frame["available_at"].iloc[0].to_pydatetime() == t + timedelta(hours=5)


def test_latest_signal_is_point_in_time_on_received_at(engine: Engine, forecasts: Forecasts) -> None:
    t = BASE
    early = seed_signal(engine, ticker="AAA", generated_at=t, received_at=t + timedelta(minutes=1), direction=1)
    # Generated later but delivered late: unseen until it arrives.
    late = seed_signal(
        engine, ticker="AAA", generated_at=t + timedelta(hours=1), received_at=t + timedelta(hours=5), direction=-1
    )
    assert forecasts.latest_signal("AAA", t) is None
    assert forecasts.latest_signal("AAA", t + timedelta(hours=4)).id == early
    got = forecasts.latest_signal("AAA", t + timedelta(hours=5))
    assert got.id == late and got.direction == -1 and got.received_at == t + timedelta(hours=5)
    assert forecasts.latest_signal("AAA", t + timedelta(hours=4), max_age=timedelta(hours=3)) is None
    assert forecasts.latest_signal("AAA", t + timedelta(hours=6), horizon="1w") is None


def test_open_refuses_missing_or_unmigrated_databases(empty_db_url: str, tmp_path) -> None:
    missing = tmp_path / "nope" / "x.sqlite"
    with pytest.raises(DatabaseError, match="no database file"):
        Forecasts.open(f"sqlite:///{missing}")
    assert not missing.exists()
    if empty_db_url.startswith("sqlite"):
        make_engine(empty_db_url).dispose()
        with make_engine(empty_db_url).connect() as conn:  # create the (empty) file
            conn.exec_driver_sql("SELECT 1")
    with pytest.raises(DatabaseError, match="robot-llm db upgrade"):
        Forecasts.open(empty_db_url)


def test_dataframe_needs_pandas_only_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    assert list(to_dataframe([]).columns)[:3] == ["id", "ticker", "text"]
    monkeypatch.setitem(sys.modules, "pandas", None)  # what an install without pandas looks like
    with pytest.raises(ForecastsError, match="pandas is not installed"):
        to_dataframe([])


def test_parse_moment() -> None:
    now = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)
    assert parse_moment("now", now=now) == now
    assert parse_moment("1d", now=now) == now - timedelta(days=1)
    assert parse_moment("90m ago", now=now) == now - timedelta(minutes=90)
    assert parse_moment("2026-11-30T09:30+03:00") == datetime(2026, 11, 30, 6, 30, tzinfo=UTC)
    assert parse_moment("2026-11-30T06:30Z") == datetime(2026, 11, 30, 6, 30, tzinfo=UTC)
    assert parse_moment("2026-11-30", tz="Europe/Moscow") == datetime(2026, 11, 29, 21, 0, tzinfo=UTC)
    with pytest.raises(NaiveDatetimeError, match="has no zone"):
        parse_moment("2026-11-30T09:30")
    with pytest.raises(ForecastsError, match="cannot read the time"):
        parse_moment("yesterday")
    with pytest.raises(ForecastsError, match="invalid date"):
        parse_moment("2026-02-30")


# --------------------------------------------------------------------------- concurrency


def test_strategies_read_while_the_batch_writes(db_url: str) -> None:
    """A writer commits theses one by one while a reader queries: no errors, no partial rows, no going back."""
    n = 40
    writer_engine = make_engine(db_url)
    errors: list[BaseException] = []

    def body(i: int) -> str:
        return f"thesis {i}: " + "word " * (50 + i)

    def write() -> None:
        try:
            for i in range(n):
                at = BASE + timedelta(minutes=i)
                seed_thesis(
                    writer_engine,
                    ticker="AAA",
                    as_of=at - timedelta(hours=1),
                    available_at=at,
                    valid_until=at + timedelta(days=30),
                    stance=i / 100,
                    text=body(i),
                    news_ids=(i, i + 1, i + 2),
                )
        except BaseException as exc:
            errors.append(exc)

    far = BASE + timedelta(days=1)
    reads = 0
    last_seen = -1
    with Forecasts.open(db_url) as reader:
        thread = threading.Thread(target=write)
        thread.start()
        while True:
            alive = thread.is_alive()
            rec = reader.latest("AAA", far)
            history = reader.history("AAA", BASE, far)
            reads += 1
            if rec is not None:
                i = rec.news_ids[0]
                assert rec.text == body(i) and rec.stance == pytest.approx(i / 100)
                assert rec.news_ids == (i, i + 1, i + 2)
                assert i >= last_seen, "a later read saw an older latest thesis"
                last_seen = i
            # Rows commit in order, so any snapshot is a prefix: 0..k-1, each whole.
            assert [r.news_ids[0] for r in history] == list(range(len(history)))
            assert all(r.text == body(r.news_ids[0]) for r in history)
            if not alive:
                break
        thread.join()
    writer_engine.dispose()
    assert not errors, errors
    assert last_seen == n - 1 and reads >= 1


def test_a_read_of_a_database_a_revision_behind_says_to_upgrade(db_url: str) -> None:
    # A robot-llm upgraded before its database: the read names the revision and the command that fixes it.
    from robot_llm.store.migrate import downgrade, head

    downgrade(db_url, "-1")
    with Forecasts.open(db_url) as fc, pytest.raises(ForecastsError) as caught:
        fc.latest("SBER", datetime.now(timezone.utc))
    assert f"head is {head()}: run `robot-llm db upgrade" in str(caught.value)
