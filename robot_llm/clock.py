"""Time logic of the night, as pure functions of ``(config, now)``: cron fire times, which
night it is, its cut-off, trading days and catch-up.

Everything here steps in UTC. A cron line is evaluated in the config's zone (APScheduler's
CronTrigger), but its fire times are compared and stepped as UTC instants: on a DST fall-back
a local wall time such as 02:30 happens twice, and a local-zone datetime loses which of the
two it was (``fold``) as soon as one adds a timedelta to it, so stepping in local time can
walk back to the first 02:30 for ever. A wall time that happens twice fires once, at its
first occurrence; one that does not exist (spring forward) fires at the instant the clock
jumps over it, shifted by the gap (02:30 in Berlin on the spring-forward day is 03:30 CEST).

The nightly plan (:func:`robot_llm.plan.plan_night`), ``batch plan`` and the daemon all use
:func:`night_as_of`, so they always agree on which night it is.

This module imports only the standard library at import time (APScheduler is loaded on the
first cron evaluation), so the read API and ``robot-llm status`` stay light.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import date, datetime, timedelta, timezone, tzinfo
from typing import TYPE_CHECKING

from robot_llm.errors import RobotLLMError

if TYPE_CHECKING:
    from apscheduler.triggers.cron import CronTrigger

    from robot_llm.config import AppConfig

__all__ = [
    "ScheduledFire",
    "aware_utc",
    "cron_trigger",
    "next_fire_after",
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


def _crontab_weekdays(field: str) -> str:
    """Translate a crontab day-of-week field (0 or 7 = Sunday) to APScheduler 3 names.

    APScheduler 3's ``from_crontab`` counts 0 as *Monday* (its issue #286), so ``0-4``
    would silently mean Mon–Fri instead of the Sun–Thu a crontab user wrote.
    """
    if field == "*":
        return field
    days: set[int] = set()

    def day(token: str) -> int:
        token = token.lower()
        if token.isdigit() and 0 <= int(token) <= 7:
            return int(token) % 7
        if token[:3] in _CRON_DAYS:
            return _CRON_DAYS.index(token[:3])
        raise ValueError(f"invalid day of week {token!r} in {field!r}")

    for part in field.split(","):
        rng, _, step_text = part.partition("/")
        step = int(step_text) if step_text else 1
        if step < 1:
            raise ValueError(f"invalid step in day of week {field!r}")
        if rng == "*":
            first, last = 0, 6
        elif "-" in rng:
            a, b = rng.split("-", 1)
            first, last = day(a), day(b)
            if b.strip() == "7":
                last = 7  # "1-7" is Monday through Sunday
        else:
            first = last = day(rng)
            if step_text:
                last = 6
        if last < first:
            raise ValueError(f"day-of-week range {rng!r} runs backwards in {field!r}")
        days.update(d % 7 for d in range(first, last + 1, step))
    return ",".join(_CRON_DAYS[d] for d in sorted(days))


def cron_trigger(expr: str, tz: tzinfo | str) -> CronTrigger:
    """An APScheduler CronTrigger for a standard crontab line, evaluated in ``tz``.

    Use this (not ``CronTrigger.from_crontab``) wherever a config cron is scheduled, so
    the daemon's fire times and :func:`night_as_of` agree on weekdays.
    """
    from apscheduler.triggers.cron import CronTrigger

    fields = expr.split()
    if len(fields) != 5:
        raise RobotLLMError(f"invalid cron expression {expr!r}: expected 5 fields")
    minute, hour, day, month, weekdays = fields
    try:
        return CronTrigger(
            minute=minute, hour=hour, day=day, month=month, day_of_week=_crontab_weekdays(weekdays), timezone=tz
        )
    except ValueError as exc:
        raise RobotLLMError(f"invalid cron expression {expr!r}: {exc}") from None


def next_fire_after(trigger: CronTrigger, after: datetime) -> datetime | None:
    """The first fire of ``trigger`` strictly after ``after``, as aware UTC (None: it never fires again).

    APScheduler builds a candidate from local wall-clock fields with ``fold=0``; inside the
    hour a fall-back repeats, that candidate can be the *first* occurrence of a wall time
    we are already past. Such a candidate is a wall time that already fired: skip to its
    second occurrence and search on from there, so every step moves forward in UTC.
    """
    start = aware_utc(after, "after")
    while True:
        fire = trigger.get_next_fire_time(None, start + _TICK)
        if fire is None:
            return None
        fire_utc = fire.astimezone(UTC)
        if fire_utc > start:
            return fire_utc
        # The repeated hour: the same wall time a second time (fold=1) is later than `start`.
        start = max(start + _TICK, fire.replace(fold=1).astimezone(UTC))


def night_as_of(config: AppConfig, now: datetime) -> datetime:
    """The most recent fire time of ``schedule.nightly`` (in ``config.timezone``) at or before ``now``, in UTC."""
    now = aware_utc(now, "now")
    trigger = cron_trigger(config.schedule.nightly, config.tz)
    for window in (timedelta(days=2), timedelta(days=8), timedelta(days=32), timedelta(days=367 * 5)):
        last = None
        fire = next_fire_after(trigger, now - window)
        while fire is not None and fire <= now:
            last = fire
            fire = next_fire_after(trigger, fire)
        if last is not None:
            return last
    raise RobotLLMError(f"schedule.nightly {config.schedule.nightly!r} has not fired in the last five years")


def next_nightly_fire(config: AppConfig, now: datetime) -> datetime | None:
    """The first ``schedule.nightly`` fire at or after ``now`` (aware UTC), in the config's zone."""
    return next_fire_after(cron_trigger(config.schedule.nightly, config.tz), aware_utc(now, "now") - _TICK)


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
        fire = next_fire_after(cron_trigger(expr, tz), now - _TICK)
        out.append(ScheduledFire(job, fire, f"cron {expr!r}"))
    for feed in config.feeds:
        if feed.enabled:
            out.append(ScheduledFire(f"feed:{feed.name}", None, f"every {feed.interval}"))
    return tuple(out)
