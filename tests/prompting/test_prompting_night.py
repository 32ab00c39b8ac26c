"""The night's identity (cron in the config's zone), --as-of parsing and per-request seeds."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from zoneinfo import ZoneInfo

import pytest
from apscheduler.triggers.cron import CronTrigger

from robot_llm.clock import cron_trigger, night_as_of, parse_as_of
from robot_llm.errors import RobotLLMError
from robot_llm.night.plan import derive_seed

MSK = ZoneInfo("Europe/Moscow")


def msk(day: int, hour: int, minute: int = 0) -> datetime:
    return datetime(2026, 11, day, hour, minute, tzinfo=MSK)  # 23 Nov 2026 is a Monday


@pytest.mark.parametrize(
    ("now", "night"),
    [
        (msk(25, 10), msk(24, 23)),  # Wednesday morning: Tuesday night
        (msk(25, 23), msk(25, 23)),  # exactly at the fire time: that night
        (msk(25, 22, 59), msk(24, 23)),
        (msk(27, 23, 30), msk(26, 23)),  # Friday night is not a night (no trading on Saturday)
        (msk(28, 12), msk(26, 23)),  # across the weekend: Thursday night
        (msk(29, 22, 59), msk(26, 23)),
        (msk(29, 23), msk(29, 23)),  # Sunday night (for Monday) is a night
        (msk(30, 8), msk(29, 23)),
    ],
)
def test_night_as_of_follows_the_cron_in_moscow(make_config, now, night):
    config = make_config()  # nightly "0 23 * * 0-4": Sunday to Thursday, crontab numbering
    got = night_as_of(config, now)
    assert got == night and got.tzinfo == timezone.utc
    assert night_as_of(config, now.astimezone(timezone.utc)) == got  # the same instant in another zone


def test_night_as_of_refuses_naive_now(make_config):
    with pytest.raises(ValueError, match="naive"):
        night_as_of(make_config(), datetime(2026, 11, 25, 12, 0))


def test_cron_weekdays_use_crontab_numbering():
    def days(field: str) -> list[int]:
        trigger = cron_trigger(f"0 23 * * {field}", "UTC")
        start = datetime(2026, 11, 22, tzinfo=timezone.utc)  # a Sunday
        fires, fire = [], trigger.get_next_fire_time(None, start)
        while fire < start + timedelta(days=7):
            fires.append(fire.isoweekday() % 7)  # 0 = Sunday, like crontab
            fire = trigger.get_next_fire_time(fire, fire + timedelta(seconds=1))
        return fires

    assert days("0-4") == [0, 1, 2, 3, 4]
    assert days("1-5") == [1, 2, 3, 4, 5]
    assert days("7") == [0] and days("0") == [0]
    assert days("*/2") == [0, 2, 4, 6]
    assert days("mon-fri") == [1, 2, 3, 4, 5]
    assert days("sun,sat") == [0, 6]
    assert days("1-7") == [0, 1, 2, 3, 4, 5, 6]
    # APScheduler's own from_crontab would have read 0-4 as Monday to Friday
    raw = CronTrigger.from_crontab("0 23 * * 0-4", timezone="UTC")
    assert raw.get_next_fire_time(None, datetime(2026, 11, 22, tzinfo=timezone.utc)).isoweekday() == 1
    with pytest.raises(RobotLLMError, match="invalid cron"):
        cron_trigger("0 23 * * 5-2", "UTC")


def test_parse_as_of_reads_naive_times_in_the_config_zone():
    assert parse_as_of("2026-11-25T23:00", MSK) == datetime(2026, 11, 25, 20, 0, tzinfo=timezone.utc)
    assert parse_as_of("2026-11-25T20:00Z", MSK) == datetime(2026, 11, 25, 20, 0, tzinfo=timezone.utc)
    assert parse_as_of("2026-11-25T23:00+01:00", MSK) == datetime(2026, 11, 25, 22, 0, tzinfo=timezone.utc)
    with pytest.raises(RobotLLMError, match="--as-of"):
        parse_as_of("tonight", MSK)


def test_seeds_are_deterministic_and_distinct():
    night = datetime(2026, 11, 25, 20, 0, tzinfo=timezone.utc)
    seeds = {
        (ticker, template): derive_seed(1234, night, ticker, template)
        for ticker in ("SBER", "GAZP", "LKOH")
        for template in ("thesis_ru", "thesis_en")
    }
    assert len(set(seeds.values())) == len(seeds)
    assert all(0 <= s < 2**31 for s in seeds.values())
    assert derive_seed(1234, night.astimezone(MSK), "SBER", "thesis_ru") == seeds["SBER", "thesis_ru"]
    assert derive_seed(1235, night, "SBER", "thesis_ru") != seeds["SBER", "thesis_ru"]
    assert derive_seed(1234, night + timedelta(days=1), "SBER", "thesis_ru") != seeds["SBER", "thesis_ru"]
    with pytest.raises(ValueError, match="naive"):
        derive_seed(1234, datetime(2026, 11, 25, 20, 0), "SBER", "thesis_ru")
