"""The track record in the morning report: a text summary, and the HTML page's section with a chart per instrument.

The morning of local day D is read as of the next morning's cut-off (or now, if that is
later than now): what a strategy reading the morning's theses could have known.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import date, datetime, timedelta
from typing import TYPE_CHECKING, Any

from sqlalchemy import inspect

from robot_llm.store.db import utcnow
from robot_llm.track.figures import LedgerSettings
from robot_llm.track.ledger import LedgerRow, format_ledger, ledger
from robot_llm.track.outcomes import Outcome, compute_outcomes, load_closes, load_theses, span_text
from robot_llm.track.stats import spearman

if TYPE_CHECKING:
    from sqlalchemy.engine import Engine

    from robot_llm.config import AppConfig

__all__ = [
    "TRACK_FILTERS",
    "TrackRecordView",
    "build_view",
    "report_as_of",
    "rolling_ic",
    "summary_lines",
    "track_record_chart",
]


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def _signed(value: float | None) -> str:
    return "-" if value is None else f"{value:+.3f}"


def _ci(fmt: Any) -> Any:
    return lambda ci: "" if ci is None else f" [{fmt(ci[0])}, {fmt(ci[1])}]"


# The HTML page's formatting of ledger figures (Jinja filters).
TRACK_FILTERS: dict[str, Any] = {
    "span": span_text,
    "pct": _pct,
    "signed": _signed,
    "ci_pct": _ci(_pct),
    "ci_signed": _ci(_signed),
}


@dataclass(frozen=True)
class TrackRecordView:
    """What the report shows: the ledger as of a moment, and each instrument's scored theses (first horizon)."""

    as_of: datetime
    rows: tuple[LedgerRow, ...]
    horizon: timedelta
    outcomes: dict[str, tuple[Outcome, ...]]
    rolling: int

    def lines(self) -> list[str]:
        """The text summary: every model × template over all instruments."""
        return format_ledger(self.rows, tickers=False)


def report_as_of(config: AppConfig, day: date) -> datetime:
    """The moment the morning after the night of ``day`` is read: the next cut-off, never later than now."""
    morning = datetime.combine(day + timedelta(days=1), config.schedule.cutoff, tzinfo=config.tz)
    return min(morning, utcnow())


def build_view(config: AppConfig, engine: Engine, day: date) -> TrackRecordView | None:
    """The report's track record for the night of ``day``; None when no prices are configured or stored yet."""
    if not config.prices.enabled or not inspect(engine).has_table("prices"):
        return None
    settings = LedgerSettings.from_config(config.prices)
    as_of = report_as_of(config, day)
    theses = load_theses(engine, as_of)
    wanted = {t.ticker for t in theses} | ({settings.benchmark} if settings.benchmark else set())
    closes = load_closes(engine, wanted, as_of)
    rows = ledger(theses, closes, as_of, settings)
    horizon = settings.horizons[0]
    benchmark = closes.get(settings.benchmark) if settings.benchmark else None
    scored = compute_outcomes(theses, closes, horizon, benchmark=benchmark)[0]
    by_ticker: dict[str, list[Outcome]] = {}
    for o in scored:
        if o.thesis.stance is not None:
            by_ticker.setdefault(o.thesis.ticker, []).append(o)
    return TrackRecordView(
        as_of=as_of,
        rows=tuple(rows),
        horizon=horizon,
        outcomes={k: tuple(sorted(v, key=lambda o: o.exit_time)) for k, v in by_ticker.items()},
        rolling=settings.min_count,
    )


def summary_lines(config: AppConfig, engine: Engine, day: date) -> tuple[str, ...]:
    """The text report's track-record lines (empty without prices)."""
    view = build_view(config, engine, day)
    if view is None:
        return ()
    head = f"track record as of {view.as_of.astimezone(config.tz):%Y-%m-%d %H:%M %Z}:"
    return (head, *(view.lines() or ["  no theses yet"]))


def rolling_ic(outcomes: tuple[Outcome, ...], size: int) -> list[tuple[datetime, float | None]]:
    """Spearman IC of the last ``size`` outcomes known at each exit (outcomes in exit order)."""
    return [
        (
            outcomes[end - 1].exit_time,
            spearman(
                [o.thesis.stance or 0.0 for o in outcomes[end - size : end]],
                [o.ret for o in outcomes[end - size : end]],
            ),
        )
        for end in range(size, len(outcomes) + 1)
    ]


def track_record_chart(ticker: str, view: TrackRecordView, config: AppConfig) -> Any:
    """One instrument: stance against the realised return, and the rolling IC over time."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    outcomes = view.outcomes.get(ticker, ())
    span = span_text(view.horizon)
    fig = make_subplots(
        rows=1,
        cols=2,
        subplot_titles=(f"stance vs {span} return", f"rolling IC (last {view.rolling} outcomes)"),
    )
    for template in sorted({o.thesis.template for o in outcomes}):
        mine = [o for o in outcomes if o.thesis.template == template]
        fig.add_trace(
            go.Scatter(
                x=[o.thesis.stance for o in mine],
                y=[o.ret * 100 for o in mine],
                mode="markers",
                name=template,
                text=[f"night {o.thesis.night.astimezone(config.tz):%Y-%m-%d}, thesis {o.thesis.id}" for o in mine],
            ),
            row=1,
            col=1,
        )
    points = rolling_ic(outcomes, view.rolling)
    fig.add_trace(
        go.Scatter(
            x=[t.astimezone(config.tz).isoformat() for t, _ in points],
            y=[v for _, v in points],
            mode="lines",
            name="rolling IC",
        ),
        row=1,
        col=2,
    )
    fig.update_xaxes(title_text="stance", range=[-1.05, 1.05], row=1, col=1)
    fig.update_yaxes(title_text="return, %", row=1, col=1)
    fig.update_yaxes(range=[-1, 1], row=1, col=2)
    fig.update_layout(
        title=f"{ticker}: {len(outcomes)} scored theses, horizon {span}",
        height=320,
        margin={"l": 60, "r": 20, "t": 60, "b": 40},
        template="plotly_white",
    )
    return fig
