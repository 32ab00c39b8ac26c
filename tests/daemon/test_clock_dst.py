"""The night's identity across DST changes: every minute of the day, four zones, both transitions.

The oracle is independent of APScheduler: on each local date the cron's wall time fires once,
at its first occurrence when a fall-back repeats it, shifted by the gap when a spring-forward
skips it (zoneinfo's ``fold=0`` reading). ``night_as_of`` must return the latest such fire at or
before ``now`` and always terminate (it used to loop for ever on a fall-back night).
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import date, datetime, time, timedelta, timezone
from functools import cache
from zoneinfo import ZoneInfo

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from robot_llm.clock import next_nightly_fire, night_as_of
from robot_llm.config import AppConfig

UTC = timezone.utc
# Moscow has kept one offset since 2014: its last DST year is the one tested.
ZONES = {"Europe/Berlin": 2026, "America/New_York": 2026, "Australia/Sydney": 2026, "Europe/Moscow": 2010}


@cache
def transitions(zone: str) -> tuple[datetime, ...]:
    """The UTC instants in the zone's test year where its offset changes (spring forward, fall back)."""
    tz, year = ZoneInfo(zone), ZONES[zone]
    found, t = [], datetime(year, 1, 1, tzinfo=UTC)
    offset = t.astimezone(tz).utcoffset()
    while t.year == year:
        nxt = t + timedelta(minutes=30)
        if nxt.astimezone(tz).utcoffset() != offset:
            found.append(nxt)
            offset = nxt.astimezone(tz).utcoffset()
        t = nxt
    assert len(found) == 2, (zone, found)
    return tuple(found)


def expected_night(zone: str, hour: int, minute: int, now: datetime) -> datetime:
    tz = ZoneInfo(zone)
    today = now.astimezone(tz).date()
    fires = [
        datetime.combine(today + timedelta(days=d), time(hour, minute), tzinfo=tz).astimezone(UTC) for d in range(-3, 2)
    ]
    return max(f for f in fires if f <= now)


@contextmanager
def deadline(seconds: float) -> Iterator[None]:
    """Fail instead of hanging: the bug this guards is an endless loop."""

    def expired(_signum: int, _frame: object) -> None:
        raise TimeoutError(f"night_as_of did not return within {seconds}s")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _with(base: AppConfig, zone: str, hour: int, minute: int) -> AppConfig:
    schedule = base.schedule.model_copy(update={"nightly": f"{minute} {hour} * * *"})
    return base.model_copy(update={"timezone": zone, "schedule": schedule})


def _check(base: AppConfig, zone: str, hour: int, minute: int, now: datetime) -> None:
    config = _with(base, zone, hour, minute)
    with deadline(5):
        got = night_as_of(config, now)
        following = next_nightly_fire(config, got)
    want = expected_night(zone, hour, minute, now)
    assert got == want, f"{zone} {hour:02d}:{minute:02d} now {now.isoformat()}: {got} != {want}"
    assert following == got  # the daemon's next fire and the night identity agree


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> AppConfig:
    from daemon_helpers import config_data, write_config

    from robot_llm.config import load_config

    tmp = tmp_path_factory.mktemp("clock")
    return load_config(write_config(tmp, config_data(tmp, f"sqlite:///{tmp / 'db.sqlite'}")))


def test_berlin_fall_back_at_half_past_two_terminates(base: AppConfig) -> None:
    # The reported case: 02:30 happens twice in Berlin on 2026-10-25.
    for minutes in range(0, 240, 5):
        now = datetime(2026, 10, 24, 23, 0, tzinfo=UTC) + timedelta(minutes=minutes)
        _check(base, "Europe/Berlin", 2, 30, now)


@pytest.mark.parametrize("zone", sorted(ZONES))
@pytest.mark.parametrize("which", [0, 1], ids=["first-change", "second-change"])  # one spring, one fall
def test_every_minute_of_the_day_around_both_transitions(base: AppConfig, zone: str, which: int) -> None:
    change = transitions(zone)[which]
    local_day = change.astimezone(ZoneInfo(zone)).date()
    for minute_of_day in range(24 * 60):
        hour, minute = divmod(minute_of_day, 60)
        # One hour after the change: inside or just past the repeated (or skipped) hour.
        _check(base, zone, hour, minute, change + timedelta(minutes=59))
        # The moment that wall time happens on the transition day, in both readings of a repeated hour.
        wall = datetime.combine(local_day, time(hour, minute), tzinfo=ZoneInfo(zone))
        for fold in (0, 1):
            _check(base, zone, hour, minute, wall.replace(fold=fold).astimezone(UTC))


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    zone=st.sampled_from(sorted(ZONES)),
    which=st.integers(0, 1),
    minute_of_day=st.integers(0, 24 * 60 - 1),
    offset=st.integers(-2 * 24 * 60, 2 * 24 * 60),
    seconds=st.integers(0, 59),
)
def test_night_as_of_is_the_latest_fire_at_or_before_now(
    base: AppConfig, zone: str, which: int, minute_of_day: int, offset: int, seconds: int
) -> None:
    now = transitions(zone)[which] + timedelta(minutes=offset, seconds=seconds)
    _check(base, zone, *divmod(minute_of_day, 60), now)


def test_transitions_found() -> None:
    assert [t.date() for t in transitions("Europe/Berlin")] == [date(2026, 3, 29), date(2026, 10, 25)]
    assert [t.date() for t in transitions("Australia/Sydney")] == [date(2026, 4, 4), date(2026, 10, 3)]


@pytest.mark.parametrize(
    ("zone", "cron", "first_local_day"),
    [
        ("Europe/Berlin", "30 2 * * *", date(2026, 10, 24)),  # 02:30 happens twice on the 25th
        ("America/New_York", "0 0 * * *", date(2026, 3, 7)),  # the 8th has 23 hours
        ("Australia/Sydney", "30 2 * * *", date(2026, 10, 3)),  # 02:30 does not exist on the 4th
    ],
)
def test_the_daemons_trigger_fires_once_per_local_day_across_the_change(
    base: AppConfig, zone: str, cron: str, first_local_day: date
) -> None:
    from robot_llm.daemon.scheduler import Daemon
    from robot_llm.store.db import make_engine

    config = base.model_copy(update={"timezone": zone, "schedule": base.schedule.model_copy(update={"nightly": cron})})
    trigger = Daemon(config, make_engine(config.database.url), install_signals=False).build_scheduler(config)
    trigger = trigger.get_job("nightly").trigger
    start = datetime.combine(first_local_day, time(12), tzinfo=ZoneInfo(zone))
    fire, days = trigger.get_next_fire_time(None, start), []
    with deadline(5):
        for _ in range(4):
            days.append(fire.astimezone(ZoneInfo(zone)).date())
            assert fire.astimezone(UTC) == night_as_of(config, fire)  # each fire is its own night
            fire = trigger.get_next_fire_time(fire, fire)
    assert days == [first_local_day + timedelta(days=d) for d in range(1, 5)]
