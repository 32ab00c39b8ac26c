"""The daemon's time logic, with explicit clocks: cut-offs, trading nights, catch-up, DST."""

from __future__ import annotations

import subprocess
import sys
from datetime import date, datetime, time, timedelta, timezone
from pathlib import Path
from zoneinfo import ZoneInfo

import pytest
from daemon_helpers import REPO, config_data, write_config

from robot_llm.clock import (
    next_nightly_fire,
    night_as_of,
    night_cutoff,
    non_trading_reason,
    served_trading_day,
    should_catch_up,
    upcoming_fires,
)
from robot_llm.config import AppConfig, load_config
from robot_llm.daemon.scheduler import Daemon
from robot_llm.store.db import make_engine

UTC = timezone.utc


def _config(tmp_path: Path, **schedule: object) -> AppConfig:
    data = config_data(tmp_path, f"sqlite:///{tmp_path / 'db.sqlite'}")
    data["timezone"] = schedule.pop("timezone", "Europe/Moscow")
    data["schedule"] = {"nightly": "0 23 * * 0-4", "cutoff": "09:30", **schedule}
    return load_config(write_config(tmp_path, data))


def test_cutoff_is_the_next_morning_of_the_served_day(tmp_path: Path) -> None:
    config = _config(tmp_path)
    wednesday_night = datetime(2026, 11, 25, 20, 0, tzinfo=UTC)  # 23:00 Moscow (UTC+3)
    assert served_trading_day(config, wednesday_night) == date(2026, 11, 26)
    assert night_cutoff(config, wednesday_night) == datetime(2026, 11, 26, 6, 30, tzinfo=UTC)
    # A night that fires after midnight serves the same calendar day.
    after_midnight = datetime(2026, 11, 25, 22, 30, tzinfo=UTC)  # 01:30 Moscow on the 26th
    assert served_trading_day(config, after_midnight) == date(2026, 11, 26)


def test_nights_before_weekends_and_holidays_are_skipped(tmp_path: Path) -> None:
    config = _config(tmp_path, nightly="0 23 * * *", holidays=["2026-12-31"])
    thursday = datetime(2026, 11, 26, 20, 0, tzinfo=UTC)
    friday = datetime(2026, 11, 27, 20, 0, tzinfo=UTC)
    saturday = datetime(2026, 11, 28, 20, 0, tzinfo=UTC)
    sunday = datetime(2026, 11, 29, 20, 0, tzinfo=UTC)
    assert non_trading_reason(config, thursday) is None
    friday_reason = non_trading_reason(config, friday)
    assert friday_reason is not None and "Saturday" in friday_reason and "2026-11-28" in friday_reason
    assert non_trading_reason(config, saturday) is not None
    assert non_trading_reason(config, sunday) is None  # serves Monday
    holiday_eve = datetime(2026, 12, 30, 20, 0, tzinfo=UTC)
    reason = non_trading_reason(config, holiday_eve)
    assert reason is not None and "holiday" in reason

    run_anyway = _config(tmp_path, nightly="0 23 * * *", skip_non_trading_days=False)
    assert non_trading_reason(run_anyway, friday) is None


def test_catch_up_inside_the_window_and_not_after_the_cutoff(tmp_path: Path) -> None:
    config = _config(tmp_path)
    as_of = datetime(2026, 11, 25, 20, 0, tzinfo=UTC)  # cut-off 2026-11-26 06:30 UTC
    assert should_catch_up(config, as_of, datetime(2026, 11, 26, 3, 0, tzinfo=UTC), complete=False)
    assert should_catch_up(config, as_of, datetime(2026, 11, 26, 6, 29, tzinfo=UTC), complete=False)
    assert not should_catch_up(config, as_of, datetime(2026, 11, 26, 6, 30, tzinfo=UTC), complete=False)
    assert not should_catch_up(config, as_of, datetime(2026, 11, 26, 3, 0, tzinfo=UTC), complete=True)
    with pytest.raises(ValueError, match="naive"):
        should_catch_up(config, as_of, datetime(2026, 11, 26, 3, 0), complete=False)


def test_every_trigger_carries_the_config_zone_and_the_job_policy(tmp_path: Path) -> None:
    config = _config(tmp_path, timezone="America/New_York")
    scheduler = Daemon(config, make_engine(config.database.url), install_signals=False).build_scheduler(config)
    jobs = {job.id: job for job in scheduler.get_jobs()}
    assert set(jobs) == {"feed:wire", "signals", "nightly", "morning_report"}
    for job in jobs.values():
        assert job.trigger.timezone == ZoneInfo("America/New_York"), job.id
        assert job.max_instances == 1 and job.coalesce, job.id
    assert jobs["nightly"].misfire_grace_time is None  # the job checks the cut-off itself


def test_nightly_fires_at_the_same_wall_clock_time_across_dst(tmp_path: Path) -> None:
    config = _config(tmp_path, timezone="Europe/Berlin", nightly="0 23 * * *")
    berlin = ZoneInfo("Europe/Berlin")
    trigger = (
        Daemon(config, make_engine(config.database.url), install_signals=False)
        .build_scheduler(config)
        .get_job("nightly")
        .trigger
    )
    # Spring forward on Sunday 2027-03-28 (CET +1 -> CEST +2), fall back on 2026-10-25.
    for start, expected_utc_hours in (
        (datetime(2027, 3, 26, 12, 0, tzinfo=UTC), (22, 22, 21, 21)),
        (datetime(2026, 10, 23, 12, 0, tzinfo=UTC), (21, 21, 22, 22)),
    ):
        fire = trigger.get_next_fire_time(None, start)
        seen = []
        for _ in range(4):
            local = fire.astimezone(berlin)
            assert (local.hour, local.minute) == (23, 0), local
            seen.append(fire.astimezone(UTC).hour)
            fire = trigger.get_next_fire_time(fire, fire + timedelta(seconds=1))
        assert tuple(seen) == expected_utc_hours
    # The cut-off and the night identity follow the wall clock too.
    saturday_night = datetime(2027, 3, 27, 22, 0, tzinfo=UTC)  # 23:00 CET
    assert night_cutoff(config, saturday_night) == datetime(2027, 3, 28, 7, 30, tzinfo=UTC)  # 09:30 CEST
    assert night_as_of(config, datetime(2027, 3, 28, 21, 0, 1, tzinfo=UTC)) == datetime(2027, 3, 28, 21, 0, tzinfo=UTC)
    after_spring = next_nightly_fire(config, datetime(2027, 3, 27, 22, 30, tzinfo=UTC))
    assert after_spring == datetime(2027, 3, 28, 21, tzinfo=UTC)  # 23:00 CEST
    after_fall = next_nightly_fire(config, datetime(2026, 10, 25, 21, 30, tzinfo=UTC))  # 22:30 CET
    assert after_fall == datetime(2026, 10, 25, 22, tzinfo=UTC)  # 23:00 CET


def test_upcoming_fires_say_when_a_night_will_be_skipped(tmp_path: Path) -> None:
    config = _config(tmp_path, nightly="0 23 * * *", cutoff=time(9, 30).strftime("%H:%M"))
    friday_noon = datetime(2026, 11, 27, 9, 0, tzinfo=UTC)
    fires = {f.job: f for f in upcoming_fires(config, friday_noon)}
    assert fires["nightly"].next_fire == datetime(2026, 11, 27, 20, 0, tzinfo=UTC)
    assert "will be skipped" in fires["nightly"].note and "Saturday" in fires["nightly"].note
    assert fires["feed:wire"].note == "every 0:00:10"
    assert fires["morning_report"].next_fire is not None and fires["morning_report"].next_fire > friday_noon


def test_the_daemon_modules_do_not_import_torch() -> None:
    code = (
        "import sys, robot_llm.daemon.scheduler, robot_llm.commands.daemon; "
        "bad = [m for m in ('torch', 'deepspeed') if m in sys.modules]; "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
