"""Point in time through the worker's own storing path: ``available_at`` is the database's clock
in the storing statement (not a worker clock that runs ahead), and ``latest()`` is not fooled by
backfills or commits that arrive out of order. Both databases."""

from __future__ import annotations

import hashlib
from datetime import datetime, timedelta, timezone

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import select
from sqlalchemy.engine import Engine

from robot_llm.config import load_config
from robot_llm.forecasts import Forecasts
from robot_llm.night import queue as request_queue
from robot_llm.night.queue import RequestQueue, Tally
from robot_llm.store.db import GenerationRequest, db_clock, session_scope, utcnow
from tests.forecasts.conftest import clear, write_config

UTC = timezone.utc
NIGHT0 = datetime(2026, 3, 2, 20, 0, tzinfo=UTC)


def _db_now(engine: Engine) -> datetime:
    with engine.connect() as conn:
        value = conn.execute(select(db_clock(engine.dialect.name))).scalar_one()
    return value if value.tzinfo is not None else value.replace(tzinfo=UTC)


def _request(engine: Engine, as_of: datetime, ticker: str) -> int:
    prompt = f"{ticker} {as_of.isoformat()}"
    now = utcnow()
    with session_scope(engine) as session:
        req = GenerationRequest(
            as_of=as_of,
            ticker=ticker,
            template_name="t",
            template_version="1",
            prompt=prompt,
            prompt_sha256=hashlib.sha256(prompt.encode()).hexdigest(),
            prompt_tokens=3,
            news_ids=[],
            signal_ids=[],
            params={},
            # Backfills stay valid for days: an old night's thesis is not stale when it lands.
            valid_until=as_of + timedelta(days=3650),
            status="running",
            attempts=1,
            created_at=now,
            updated_at=now,
        )
        session.add(req)
        session.flush()
        return req.id


def _row(request_id: int, ticker: str, as_of: datetime) -> dict[str, object]:
    return {
        "request_id": request_id,
        "ticker": ticker,
        "template_name": "t",
        "template_version": "1",
        "text": f"{ticker} as of {as_of.isoformat()}",
        "stance": 0.1,
        "stance_label": "up",
        "score": 0.5,
        "label_logprobs": {},
        "model_id": "m",
        "params": {},
        "seed": 1,
        "prompt_sha256": "x" * 64,
        "prompt_tokens": 3,
        "completion_tokens": 4,
        "finish_reason": "stop",
        "generation_seconds": 0.1,
        "news_ids": [],
        "signal_ids": [],
        "as_of": as_of,
        "valid_until": as_of + timedelta(days=3650),
    }


@settings(
    max_examples=8,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    order=st.permutations(range(4)),
    skew_minutes=st.sampled_from([0, 90, -90]),
    tickers=st.lists(st.sampled_from(["AAA", "BBB"]), min_size=4, max_size=4),
)
def test_stored_theses_are_available_from_the_database_clock_and_latest_prefers_the_newest_night(
    db_url: str,
    engine: Engine,
    tmp_path_factory: pytest.TempPathFactory,
    monkeypatch: pytest.MonkeyPatch,
    order: list[int],
    skew_minutes: int,
    tickers: list[str],
) -> None:
    clear(engine)
    # The worker's clock is off by skew_minutes: what it would have stamped is not used.
    monkeypatch.setattr(request_queue, "utcnow", lambda: utcnow() + timedelta(minutes=skew_minutes))
    config = load_config(write_config(tmp_path_factory.mktemp("cfg"), db_url, ("AAA", "BBB")))
    queue = RequestQueue(config, engine, "w", None)
    queue.start_run(4)
    nights = [NIGHT0 + timedelta(days=i) for i in range(4)]
    stored: list[tuple[int, str, datetime, datetime]] = []  # id order, ticker, as_of, available_at
    for i in order:  # night i is committed in this order: later commits may be older nights (backfills)
        request_id = _request(engine, nights[i], tickers[i])
        before = _db_now(engine)
        queue.store([_row(request_id, tickers[i], nights[i])], Tally(), 4)
        after = _db_now(engine)
        with Forecasts.open(db_url) as forecasts:
            everything = forecasts.history(tickers[i], NIGHT0, datetime(2100, 1, 1, tzinfo=UTC))
        (rec,) = [r for r in everything if r.as_of == nights[i]]
        assert before <= rec.available_at <= after, "available_at is not the database's clock at the store"
        stored.append((rec.id, tickers[i], nights[i], rec.available_at))

    with Forecasts.open(db_url) as forecasts:
        for _id, ticker, _as_of, available_at in stored:
            for moment in (available_at - timedelta(microseconds=1), available_at, after):
                visible = [s for s in stored if s[1] == ticker and s[3] <= moment]
                want = max(visible, key=lambda s: (s[2], s[3], s[0]), default=None)
                got = forecasts.latest(ticker, moment)
                assert (got.id if got else None) == (want[0] if want else None)
                if got is not None:
                    assert got.as_of == max(s[2] for s in visible)  # a backfill never hides a newer night
