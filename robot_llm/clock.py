"""Time logic of the night, as pure functions of ``(config, now)``: cron fire times, which
night it is, its cut-off, trading days and catch-up.

Everything here steps in UTC. A cron line is matched against local dates in the config's
zone (:class:`CronSchedule`), and its fires are compared and stepped as UTC instants: on a
DST fall-back a local wall time such as 02:30 happens twice, and a local-zone datetime loses
which of the two it was (``fold``) as soon as one adds a timedelta to it. (The old loop did
exactly that, stepping ``fire + timedelta(seconds=1)`` in local time: the second 02:30 became
the first again, and ``night_as_of`` never returned.) A wall time that happens twice fires
once, at its first occurrence; one that a spring-forward skips fires shifted by the gap
(02:30 in Berlin on that Sunday is 03:30 CEST).

The nightly plan (:func:`robot_llm.night.plan.plan_night`), ``batch plan`` and the daemon (its
triggers are :class:`ClockTrigger`) all use these fire times, so they always agree on which
night it is. Imports stay light (no SQLAlchemy, no torch): the read API and ``status`` use it.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from datetime import date, datetime, time, timedelta, timezone, tzinfo
from typing import TYPE_CHECKING
from zoneinfo import ZoneInfo

from apscheduler.triggers.base import BaseTrigger

from robot_llm.errors import RobotLLMError

if TYPE_CHECKING:
    from robot_llm.config import AppConfig

__all__ = [
    "ClockTrigger",
    "CronSchedule",
    "ScheduledFire",
    "aware_utc",
    "cron_trigger",
    "next_nightly_fire",
    "night_as_of",
    "night_cutoff",
    "non_trading_reason",
    "parse_as_of",
    "served_trading_day",
    "should_catch_up",
    "upcoming_fires",
]

UTC = timezone.utc
_CRON_DAYS = ("sun", "mon", "tue", "wed", "thu", "fri", "sat")
_WEEKDAY_NAMES = ("mon", "tue", "wed", "thu", "fri", "sat", "sun")
_TICK = timedelta(microseconds=1)


def aware_utc(value: datetime, name: str) -> datetime:
    """``value`` as an aware UTC datetime; ValueError naming ``name`` when it is naive."""
    if value.tzinfo is None or value.utcoffset() is None:
        raise ValueError(f"{name} must be an aware datetime, got naive {value!r}")
    return value.astimezone(UTC)


# --------------------------------------------------------------------------- cron

_MONTHS = ("jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct", "nov", "dec")
# A cron that matches no day for this long never fires (e.g. "0 0 30 2 *").
_MAX_IDLE_DAYS = 366 * 8


def _cron_field(text: str, lo: int, hi: int, names: tuple[str, ...] = (), base: int = 0) -> frozenset[int]:
    """The values of one crontab field: ``*``, ``a``, ``a-b``, any of them ``/step``, comma lists."""

    def value(token: str) -> int:
        token = token.strip().lower()
        if token[:3] in names:
            return names.index(token[:3]) + base
        if not token.isdigit():
            raise ValueError(f"invalid value {token!r} in {text!r}")
        return int(token)

    out: set[int] = set()
    for part in text.split(","):
        rng, _, step_text = part.partition("/")
        step = int(step_text) if step_text.isdigit() else 0
        if step_text and step < 1:
            raise ValueError(f"invalid step in {text!r}")
        if rng == "*":
            first, last = lo, hi
        elif "-" in rng:
            first, last = (value(x) for x in rng.split("-", 1))
        else:
            first = value(rng)
            last = hi if step_text else first
        if not lo <= first <= hi or not lo <= last <= hi:
            raise ValueError(f"{rng!r} is outside {lo}-{hi} in {text!r}")
        if last < first:
            raise ValueError(f"range {rng!r} runs backwards in {text!r}")
        out.update(range(first, last + 1, step or 1))
    return frozenset(out)


class CronSchedule:
    """A standard crontab line evaluated in a zone; its fires are aware UTC instants.

    Weekdays use crontab numbering (0 or 7 = Sunday; APScheduler 3's own ``from_crontab``
    counts 0 as Monday, its issue #286). A day must match the day-of-month, month *and*
    weekday fields (APScheduler's reading, which the daemon always had). The wall times of a
    matching day are read with ``fold=0``: a time a DST fall-back repeats fires once, at its
    first occurrence, and a time a spring-forward skips fires shifted by the gap (02:30 in
    Berlin on that Sunday is 03:30 CEST). APScheduler's own CronTrigger gets both wrong in
    places (it fires a repeated time twice and, stepping from just after a fall-back
    midnight, skips the next day), so the daemon schedules with :class:`ClockTrigger`.
    """

    def __init__(self, expr: str, tz: tzinfo | str) -> None:
        fields = expr.split()
        if len(fields) != 5:
            raise RobotLLMError(f"invalid cron expression {expr!r}: expected 5 fields")
        try:
            self.minutes = _cron_field(fields[0], 0, 59)
            self.hours = _cron_field(fields[1], 0, 23)
            self.days = _cron_field(fields[2], 1, 31)
            self.months = _cron_field(fields[3], 1, 12, _MONTHS, base=1)
            self.weekdays = frozenset(d % 7 for d in _cron_field(fields[4], 0, 7, _CRON_DAYS))
        except ValueError as exc:
            raise RobotLLMError(f"invalid cron expression {expr!r}: {exc}") from None
        self.expr = expr
        self.tz = ZoneInfo(tz) if isinstance(tz, str) else tz
        self._times = sorted(time(h, m) for h in self.hours for m in self.minutes)

    def _matches(self, day: date) -> bool:
        return day.month in self.months and day.day in self.days and (day.isoweekday() % 7) in self.weekdays

    def fires(self, after: datetime) -> Iterator[datetime]:
        """Every fire strictly after ``after``, as aware UTC instants in increasing order."""
        after = aware_utc(after, "after")
        day = after.astimezone(self.tz).date() - timedelta(days=1)  # a gap can shift a fire past midnight
        idle = 0
        while idle < _MAX_IDLE_DAYS:
            if self._matches(day):
                idle = 0
                for fire in sorted({datetime.combine(day, t, tzinfo=self.tz).astimezone(UTC) for t in self._times}):
                    if fire > after:
                        yield fire
                        after = fire
            else:
                idle += 1
            day += timedelta(days=1)

    def next_after(self, after: datetime) -> datetime | None:
        """The first fire strictly after ``after`` (aware UTC), or None when it never fires again."""
        return next(self.fires(after), None)

    def __repr__(self) -> str:
        return f"CronSchedule({self.expr!r}, {self.tz})"


def cron_trigger(expr: str, tz: tzinfo | str) -> ClockTrigger:
    """An APScheduler trigger firing at the :class:`CronSchedule` times of ``expr`` in ``tz``.

    Use this (not ``CronTrigger.from_crontab``) wherever a config cron is scheduled, so the
    daemon's fire times and :func:`night_as_of` agree, weekdays and DST changes included.
    """
    return ClockTrigger(CronSchedule(expr, tz))


class ClockTrigger(BaseTrigger):
    """APScheduler's trigger interface over a :class:`CronSchedule`."""

    def __init__(self, schedule: CronSchedule) -> None:
        self.schedule = schedule
        self.timezone = schedule.tz
        self.jitter = None

    def get_next_fire_time(self, previous_fire_time: datetime | None, now: datetime) -> datetime | None:
        """The next fire after ``previous_fire_time``, or the first at or after ``now``, in the trigger's zone."""
        after = previous_fire_time if previous_fire_time is not None else aware_utc(now, "now") - _TICK
        fire = self.schedule.next_after(after)
        return fire.astimezone(self.timezone) if fire is not None else None

    def __str__(self) -> str:
        return f"cron[{self.schedule.expr}, {self.timezone}]"

    def __repr__(self) -> str:
        return f"<ClockTrigger {self.schedule.expr!r} {self.timezone}>"


def night_as_of(config: AppConfig, now: datetime) -> datetime:
    """The most recent fire time of ``schedule.nightly`` (in ``config.timezone``) at or before ``now``, in UTC."""
    now = aware_utc(now, "now")
    schedule = CronSchedule(config.schedule.nightly, config.tz)
    for window in (timedelta(days=2), timedelta(days=8), timedelta(days=32), timedelta(days=367 * 5)):
        last = None
        for fire in schedule.fires(now - window):
            if fire > now:
                break
            last = fire
        if last is not None:
            return last
    raise RobotLLMError(f"schedule.nightly {config.schedule.nightly!r} has not fired in the last five years")


def next_nightly_fire(config: AppConfig, now: datetime) -> datetime | None:
    """The first ``schedule.nightly`` fire at or after ``now`` (aware UTC), in the config's zone."""
    return CronSchedule(config.schedule.nightly, config.tz).next_after(aware_utc(now, "now") - _TICK)


def parse_as_of(text: str, tz: tzinfo) -> datetime:
    """Parse a ``--as-of`` value: ISO 8601; without an offset it is read in ``tz``. Returns aware UTC."""
    try:
        value = datetime.fromisoformat(text.strip().replace("Z", "+00:00"))
    except ValueError:
        raise RobotLLMError(
            f"--as-of: expected an ISO date-time like 2026-11-26T23:00 or 2026-11-26T20:00Z, got {text!r}"
        ) from None
    if value.tzinfo is None:
        value = value.replace(tzinfo=tz)
    return value.astimezone(UTC)


# --------------------------------------------------------------------------- the night's day


def served_trading_day(config: AppConfig, as_of: datetime) -> date:
    """The local date whose morning the night of ``as_of`` serves: the first cut-off after it."""
    local = aware_utc(as_of, "as_of").astimezone(config.tz)
    day = local.date()
    if datetime.combine(day, config.schedule.cutoff, tzinfo=config.tz) <= local:
        day += timedelta(days=1)
    return day


def night_cutoff(config: AppConfig, as_of: datetime) -> datetime:
    """The moment (aware UTC) after which the night of ``as_of`` is useless and must not start."""
    day = served_trading_day(config, as_of)
    return datetime.combine(day, config.schedule.cutoff, tzinfo=config.tz).astimezone(UTC)


def non_trading_reason(config: AppConfig, as_of: datetime) -> str | None:
    """Why the night of ``as_of`` is skipped (it serves a non-trading day), or None to run it."""
    schedule = config.schedule
    if not schedule.skip_non_trading_days:
        return None
    day = served_trading_day(config, as_of)
    if day in schedule.holidays:
        return f"it serves {day.isoformat()}, a holiday (schedule.holidays)"
    weekday = _WEEKDAY_NAMES[day.weekday()]
    if weekday not in schedule.trading_days:
        return f"it serves {day.isoformat()}, a {day.strftime('%A')} (not in schedule.trading_days)"
    return None


def should_catch_up(config: AppConfig, as_of: datetime, now: datetime, *, complete: bool) -> bool:
    """Whether a night missed while the daemon was down must run now: not complete, before its cut-off."""
    now = aware_utc(now, "now")
    as_of = aware_utc(as_of, "as_of")
    if complete:
        return False
    return as_of <= now < night_cutoff(config, as_of)


@dataclass(frozen=True)
class ScheduledFire:
    """One job's next fire time, as ``robot-llm status`` shows it."""

    job: str
    next_fire: datetime | None
    note: str


def upcoming_fires(config: AppConfig, now: datetime) -> tuple[ScheduledFire, ...]:
    """The next fire time of every job the config defines, computed from the config alone."""
    now = aware_utc(now, "now")
    tz = config.tz
    out: list[ScheduledFire] = []
    nightly = next_nightly_fire(config, now)
    note = f"cron {config.schedule.nightly!r}"
    if nightly is not None:
        reason = non_trading_reason(config, nightly)
        cutoff = night_cutoff(config, nightly).astimezone(tz)
        note += f", serves {served_trading_day(config, nightly).isoformat()} (cut-off {cutoff:%Y-%m-%d %H:%M %Z})"
        if reason:
            note += f"; will be skipped: {reason}"
    out.append(ScheduledFire("nightly", nightly, note))
    for job, expr in (("signals", config.schedule.signals), ("morning_report", config.schedule.morning_report)):
        fire = CronSchedule(expr, tz).next_after(now - _TICK)
        out.append(ScheduledFire(job, fire, f"cron {expr!r}"))
    for feed in config.feeds:
        if feed.enabled:
            out.append(ScheduledFire(f"feed:{feed.name}", None, f"every {feed.interval}"))
    return tuple(out)
