"""The morning report as one self-contained HTML page, with charts a trader reads at a glance.

Per instrument: the night's stance and score, the thesis, its inputs (the news it was given,
with links, and the robot's own forecast) and whether the stance agrees with that forecast;
a chart of the stance over the last nights with the robot's forecast direction beside it.
Then the night's health (requests, failures, tokens/s, duration) and its trend.

The charts are plotly figures (freqtrade plots with plotly too) with plotly.js inlined from
the installed wheel, so the page opens from disk with no network. plotly is the optional
``report`` extra; without it every entry point here raises :class:`ReportExtraMissing`,
which names the pip command. Reads only; imports neither torch nor the scheduler.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from datetime import date, datetime, timedelta
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sqlalchemy import select

from robot_llm.errors import RobotLLMError
from robot_llm.report.summary import Report, build_report, format_duration, window
from robot_llm.report.track_record import TRACK_FILTERS, TrackRecordView, build_view, track_record_chart
from robot_llm.store.db import NewsItem, Run, Signal, Thesis, session_scope, utcnow

if TYPE_CHECKING:
    from sqlalchemy.engine import Engine

    from robot_llm.config import AppConfig

__all__ = [
    "InstrumentSection",
    "Morning",
    "ReportExtraMissing",
    "build_morning",
    "render_html",
    "require_plotly",
    "write_index",
    "write_morning",
]

INSTALL_HINT = "pip install 'robot-llm[report]'"
_META = re.compile(r'<meta name="robot-llm-morning" content="([^"]*)"')


class ReportExtraMissing(RobotLLMError):
    """plotly (the ``report`` extra) is not installed."""


def require_plotly() -> None:
    """Raise :class:`ReportExtraMissing` unless plotly can be imported."""
    try:
        import plotly  # noqa: F401
    except ModuleNotFoundError:
        raise ReportExtraMissing(f"the HTML report needs plotly, which is not installed: {INSTALL_HINT}") from None


@dataclass(frozen=True)
class NewsLine:
    """A news item a thesis was given."""

    title: str
    link: str | None  # only http(s) links; a feed's javascript: link is not a link
    feed: str
    published_at: datetime | None


@dataclass(frozen=True)
class ForecastLine:
    """The robot's forecast a thesis was given (its latest one)."""

    direction: int | None
    target: float | None
    confidence: float | None
    horizon: str
    model: str
    generated_at: datetime


@dataclass(frozen=True)
class NightPoint:
    """One night of an instrument's history: its stance and the robot's forecast direction."""

    night: date
    stance: float | None
    direction: int | None


@dataclass(frozen=True)
class InstrumentSection:
    """One instrument's part of the morning."""

    ticker: str
    name: str
    thesis: Thesis | None
    news: tuple[NewsLine, ...]
    forecast: ForecastLine | None
    agreement: str
    history: tuple[NightPoint, ...]


@dataclass(frozen=True)
class HealthPoint:
    """How one night went."""

    day: date
    requests: int
    failures: int
    tokens_per_s: float | None
    seconds: float


@dataclass(frozen=True)
class Morning:
    """Everything the page shows."""

    day: date
    timezone: str
    generated_at: datetime
    report: Report
    instruments: tuple[InstrumentSection, ...]
    health: tuple[HealthPoint, ...]
    track_record: TrackRecordView | None = None


def agreement(stance: float | None, forecast: ForecastLine | None) -> str:
    """Whether a thesis stance agrees with the robot's forecast direction, in words."""
    if forecast is None:
        return "no robot forecast to compare with"
    if forecast.direction is None:
        return "the robot's forecast has no direction"
    if stance is None:
        return "no stance"
    product = stance * forecast.direction
    if product == 0:
        return "neutral against the robot's forecast"
    return f"{'agrees' if product > 0 else 'disagrees'} with the robot's forecast"


def _link(url: str | None) -> str | None:
    return url if url and re.match(r"^https?://", url, re.I) else None


def _latest_forecast(signals: list[Signal]) -> ForecastLine | None:
    if not signals:
        return None
    s = max(signals, key=lambda x: (x.generated_at, x.id))
    return ForecastLine(s.direction, s.target, s.confidence, s.horizon, s.model, s.generated_at)


def _health(config: AppConfig, engine: Engine, day: date, nights: int, today: Report) -> tuple[HealthPoint, ...]:
    start, _ = window(config, day - timedelta(days=nights - 1))
    _, end = window(config, day)
    with session_scope(engine) as s:
        started = s.scalars(
            select(Run.started_at).where(
                Run.kind.in_(("plan", "generate")), Run.started_at >= start, Run.started_at < end
            )
        ).all()
    days = sorted({t.astimezone(config.tz).date() for t in started} | {day})
    points = []
    for d in days:
        r = today if d == day else build_report(config, engine, d)
        points.append(
            HealthPoint(
                day=d,
                requests=sum(r.queue.values()),
                failures=len(r.failures),
                tokens_per_s=r.tokens_per_s,
                seconds=sum(x.seconds or 0.0 for x in r.runs if x.kind == "generate"),
            )
        )
    return tuple(points)


def build_morning(config: AppConfig, engine: Engine, day: date, *, nights: int | None = None) -> Morning:
    """Collect the morning after the night of local ``day`` (theses whose ``as_of`` falls on it)."""
    nights = nights or config.report.nights
    tz = config.tz
    first, _ = window(config, day - timedelta(days=nights - 1))
    _, end = window(config, day)
    sections = []
    with session_scope(engine) as s:
        for inst in config.instruments:
            theses = s.scalars(
                select(Thesis)
                .where(Thesis.ticker == inst.ticker, Thesis.as_of >= first, Thesis.as_of < end)
                .order_by(Thesis.available_at, Thesis.id)
            ).all()
            signal_ids = {i for t in theses for i in t.signal_ids}
            signals = {x.id: x for x in s.scalars(select(Signal).where(Signal.id.in_(signal_ids)))}
            by_night: dict[date, Thesis] = {}
            for t in theses:  # ordered by availability: the last one of a night is the one in force
                by_night[t.as_of.astimezone(tz).date()] = t
            history = []
            for night, t in sorted(by_night.items()):
                forecast = _latest_forecast([signals[i] for i in t.signal_ids if i in signals])
                history.append(NightPoint(night, t.stance, forecast.direction if forecast else None))
            thesis = by_night.get(day)
            news: tuple[NewsLine, ...] = ()
            forecast = None
            if thesis is not None:
                rows = s.scalars(select(NewsItem).where(NewsItem.id.in_(thesis.news_ids))).all()
                news = tuple(
                    NewsLine(n.title, _link(n.link), n.feed, n.published_at)
                    for n in sorted(rows, key=lambda n: n.published_at or n.fetched_at, reverse=True)
                )
                forecast = _latest_forecast([signals[i] for i in thesis.signal_ids if i in signals])
                s.expunge(thesis)
            sections.append(
                InstrumentSection(
                    ticker=inst.ticker,
                    name=inst.name,
                    thesis=thesis,
                    news=news,
                    forecast=forecast,
                    agreement=agreement(thesis.stance if thesis else None, forecast),
                    history=tuple(history),
                )
            )
    report = build_report(config, engine, day)
    return Morning(
        day=day,
        timezone=config.timezone,
        generated_at=utcnow(),
        report=report,
        instruments=tuple(sections),
        health=_health(config, engine, day, nights, report),
        track_record=build_view(config, engine, day),
    )


# --------------------------------------------------------------------------- charts


def _figure_html(fig: Any, div_id: str) -> str:
    import plotly.io as pio

    return pio.to_html(
        fig,
        full_html=False,
        include_plotlyjs=False,  # inlined once in the page's head
        div_id=div_id,
        config={"displaylogo": False, "responsive": True},
    )


def stance_chart(section: InstrumentSection) -> Any:
    """The instrument's stance per night, with the robot's forecast direction beside it."""
    import plotly.graph_objects as go

    nights = [p.night.isoformat() for p in section.history]
    symbols = {1: "triangle-up", -1: "triangle-down", 0: "circle"}
    with_direction = [p for p in section.history if p.direction is not None]
    fig = go.Figure()
    fig.add_trace(
        go.Scatter(x=nights, y=[p.stance for p in section.history], mode="lines+markers", name="thesis stance")
    )
    fig.add_trace(
        go.Scatter(
            x=[p.night.isoformat() for p in with_direction],
            y=[p.direction for p in with_direction],
            mode="markers",
            name="robot forecast",
            marker={"symbol": [symbols[p.direction] for p in with_direction], "size": 12, "opacity": 0.6},
        )
    )
    fig.update_layout(
        title=f"{section.ticker}: stance and robot forecast, last {len(nights)} night(s)",
        yaxis={"range": [-1.15, 1.15], "title": "bearish ← stance → bullish", "zeroline": True},
        xaxis={"type": "category"},
        height=300,
        margin={"l": 60, "r": 20, "t": 50, "b": 40},
        template="plotly_white",
    )
    return fig


def health_chart(health: tuple[HealthPoint, ...]) -> Any:
    """Requests and failures, tokens/s and generation time per night."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    days = [p.day.isoformat() for p in health]
    fig = make_subplots(rows=1, cols=3, subplot_titles=("requests and failures", "tokens/s", "generation minutes"))
    fig.add_trace(go.Bar(x=days, y=[p.requests for p in health], name="requests"), row=1, col=1)
    fig.add_trace(go.Bar(x=days, y=[p.failures for p in health], name="failures"), row=1, col=1)
    fig.add_trace(go.Scatter(x=days, y=[p.tokens_per_s for p in health], name="tokens/s"), row=1, col=2)
    fig.add_trace(go.Scatter(x=days, y=[p.seconds / 60 for p in health], name="minutes"), row=1, col=3)
    fig.update_xaxes(type="category")
    fig.update_layout(height=320, margin={"l": 40, "r": 20, "t": 60, "b": 40}, template="plotly_white")
    return fig


# --------------------------------------------------------------------------- page


def render_html(morning: Morning, config: AppConfig) -> str:
    """The morning as one HTML page with plotly.js inlined (opens from disk, no network)."""
    require_plotly()
    from jinja2 import Environment
    from markupsafe import Markup
    from plotly.offline import get_plotlyjs

    tz = config.tz
    env = Environment(autoescape=True, keep_trailing_newline=True)
    env.filters["local"] = lambda t, fmt="%Y-%m-%d %H:%M": t.astimezone(tz).strftime(fmt) if t else "-"
    env.filters["duration"] = format_duration
    env.filters.update(TRACK_FILTERS)
    template = env.from_string((resources.files("robot_llm.report") / "html.j2").read_text(encoding="utf-8"))
    summary = {"day": morning.day.isoformat(), "theses": morning.report.theses, "failed": len(morning.report.failures)}
    return template.render(
        m=morning,
        tz=tz,
        meta=json.dumps(summary),
        plotlyjs=Markup(f"<script>{get_plotlyjs()}</script>"),
        stance_charts={
            s.ticker: Markup(_figure_html(stance_chart(s), f"chart-{s.ticker}")) for s in morning.instruments
        },
        health_chart=Markup(_figure_html(health_chart(morning.health), "chart-health")),
        track_charts={
            s.ticker: Markup(_figure_html(track_record_chart(s.ticker, track, config), f"track-{s.ticker}"))
            for s in morning.instruments
            if (track := morning.track_record) is not None
        },
    )


def write_report(config: AppConfig, engine: Engine, day: date, path: Path) -> Path:
    """Write the morning of ``day`` to ``path`` (``robot-llm report --html FILE``)."""
    require_plotly()
    html = render_html(build_morning(config, engine, day), config)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(html, encoding="utf-8")
    tmp.replace(path)  # a reader never opens half a page
    return path


def write_morning(config: AppConfig, engine: Engine, day: date) -> Path:
    """The daemon's morning: ``report.html_dir/morning-DAY.html``, then the folder's ``index.html``."""
    folder = config.report.html_dir
    if folder is None:
        raise RobotLLMError("report.html_dir is not set in the config")
    path = write_report(config, engine, day, folder / f"morning-{day.isoformat()}.html")
    write_index(folder)
    return path


def write_index(folder: Path) -> Path:
    """``index.html``: every ``morning-*.html`` in ``folder``, newest first, with its counts."""
    from jinja2 import Environment

    rows = []
    for page in sorted(folder.glob("morning-*.html"), reverse=True):
        with page.open(encoding="utf-8") as f:
            match = _META.search(f.read(4096))
        info = json.loads(match.group(1).replace("&#34;", '"')) if match else {}
        rows.append({"file": page.name, "day": info.get("day", page.stem.removeprefix("morning-")), **info})
    env = Environment(autoescape=True)
    html = env.from_string(_INDEX).render(rows=rows)
    path = folder / "index.html"
    path.write_text(html, encoding="utf-8")
    return path


_INDEX = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>robot-llm mornings</title>
<style>body{font-family:system-ui,sans-serif;margin:2em}td,th{padding:.2em 1em;text-align:left}</style></head>
<body><h1>robot-llm mornings</h1>
<table><tr><th>night</th><th>theses</th><th>failed requests</th></tr>
{% for r in rows %}<tr><td><a href="{{ r.file }}">{{ r.day }}</a></td>
<td>{{ r.theses }}</td><td>{{ r.failed }}</td></tr>
{% else %}<tr><td colspan="3">no mornings yet</td></tr>{% endfor %}
</table></body></html>
"""
