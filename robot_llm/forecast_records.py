"""What the read API (:mod:`robot_llm.forecasts`) hands a strategy: the thesis and signal
records, the columns they are read from and how a row becomes a record, their DataFrame form,
and the errors and the aware-moment check they share.

Strategies import these from :mod:`robot_llm.forecasts`. Like it, this module imports
SQLAlchemy and the ORM schema, never torch; pandas only inside :func:`to_dataframe`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

from robot_llm.errors import RobotLLMError
from robot_llm.store.db import Signal, Thesis
from robot_llm.track.outcomes import STANCE_LABELS, stance_labels, up_probability

if TYPE_CHECKING:
    import pandas as pd

__all__ = [
    "SIGNAL_COLUMNS",
    "THESIS_COLUMNS",
    "THESIS_FIELDS",
    "ForecastsError",
    "NaiveDatetimeError",
    "SignalRecord",
    "ThesisRecord",
    "require_aware",
    "thesis_record",
    "to_dataframe",
]


class ForecastsError(RobotLLMError):
    """A problem with a read-API call or its database; the message is for the user."""


class NaiveDatetimeError(ForecastsError):
    """A naive datetime was passed where a moment in time is needed."""


def require_aware(value: Any, name: str = "moment") -> datetime:
    """Return ``value`` as an aware UTC datetime; refuse naive datetimes and non-datetimes."""
    if not isinstance(value, datetime):
        raise ForecastsError(f"{name}: expected an aware datetime, got {type(value).__name__} {value!r}")
    if value.tzinfo is None or value.utcoffset() is None:
        raise NaiveDatetimeError(
            f"{name}: naive datetime {value.isoformat()} is ambiguous; pass an aware one, "
            f"e.g. datetime(..., tzinfo=ZoneInfo('Europe/Moscow')) or timezone.utc"
        )
    if hasattr(value, "to_pydatetime"):  # a pandas Timestamp: hand the database a plain datetime
        value = value.to_pydatetime()
    return value.astimezone(timezone.utc)


# --------------------------------------------------------------------------- records


@dataclass(frozen=True, slots=True)
class ThesisRecord:
    """One thesis as a strategy sees it, with its time contract.

    ``as_of`` is the data cut-off it was written from, ``available_at`` the moment it was
    committed (a backtest may use it only from then on), ``valid_until`` when it goes stale.
    ``stance`` runs from -1 (bearish) to +1 (bullish), ``score`` (0..1) is the confidence of
    that stance; both are ``None`` when the model's answer could not be scored.

    ``kind`` is ``thesis``, ``stance_only`` (a template that asks a stance without a thesis)
    or ``no_inputs`` (an explicit abstention: the night had no news and no signals for the
    instrument, so there is no text and no stance). ``flags`` name what the night's checks
    found (``disagrees``: the text states the other direction than the stance; ``example_copy``,
    ``headline_echo``, ``repeated``: degenerate text). ``stance_probs`` are the labels'
    probabilities behind ``stance``; ``text_stance`` is the stance read after the thesis
    and ``news_stance`` the one read from the news items, whichever ``stance`` is not;
    ``stance_source`` says which reading ``stance`` is (``thesis``, ``news`` or ``head``: a
    stance head on the model's hidden state, when one ships beside the weights).
    """

    id: int
    ticker: str
    text: str
    stance: float | None
    stance_label: str | None
    score: float | None
    as_of: datetime
    available_at: datetime
    valid_until: datetime
    model_id: str
    template_name: str
    template_version: str
    news_ids: tuple[int, ...]
    signal_ids: tuple[int, ...]
    # The probability the stance gave its "up" label, where the template's labels define one
    # (see robot_llm.track.outcomes.up_probability); the track record's Brier score uses it.
    up_probability: float | None = None
    kind: str = "thesis"
    flags: tuple[str, ...] = ()
    stance_probs: dict[str, float] = field(default_factory=dict)
    text_stance: float | None = None
    news_stance: float | None = None
    stance_source: str | None = None

    @property
    def abstained(self) -> bool:
        """Whether the night explicitly gave no opinion (``kind`` ``no_inputs``): no text, no stance."""
        return self.kind == "no_inputs"

    def is_valid_at(self, moment: datetime) -> bool:
        """Whether the thesis exists at ``moment`` and is not yet stale."""
        moment = require_aware(moment)
        return self.available_at <= moment < self.valid_until


@dataclass(frozen=True, slots=True)
class SignalRecord:
    """One of the robot's own forecasts, as received (``received_at`` is what point-in-time uses).

    ``direction`` is -1 (down), 0 (flat), +1 (up) or ``None``; ``confidence`` is 0..1 or ``None``.
    """

    id: int
    ticker: str
    generated_at: datetime
    received_at: datetime
    horizon: str
    direction: int | None
    target: float | None
    confidence: float | None
    model: str
    source: str


# What a ThesisRecord is read from: its fields, with the stance labels standing for up_probability.
THESIS_COLUMNS = (
    Thesis.id,
    Thesis.ticker,
    Thesis.text,
    Thesis.stance,
    Thesis.stance_label,
    Thesis.score,
    Thesis.as_of,
    Thesis.available_at,
    Thesis.valid_until,
    Thesis.model_id,
    Thesis.template_name,
    Thesis.template_version,
    Thesis.news_ids,
    Thesis.signal_ids,
    STANCE_LABELS,
    Thesis.kind,
    Thesis.flags,
    Thesis.stance_probs,
    Thesis.text_stance,
    Thesis.news_stance,
    Thesis.stance_source,
)

SIGNAL_COLUMNS = (
    Signal.id,
    Signal.ticker,
    Signal.generated_at,
    Signal.received_at,
    Signal.horizon,
    Signal.direction,
    Signal.target,
    Signal.confidence,
    Signal.model,
    Signal.source,
)


def thesis_record(row: Any) -> ThesisRecord:
    """The record of a row selected with :data:`THESIS_COLUMNS`."""
    values = row._asdict()
    values["news_ids"] = tuple(int(i) for i in values["news_ids"] or ())
    values["signal_ids"] = tuple(int(i) for i in values["signal_ids"] or ())
    labels = stance_labels(values.pop("stance_labels"))
    values["up_probability"] = up_probability(values["stance"], values["stance_label"], values["score"], labels)
    values["flags"] = tuple(str(f) for f in values["flags"] or ())
    values["stance_probs"] = {str(k): float(v) for k, v in (values["stance_probs"] or {}).items()}
    return ThesisRecord(**values)


# --------------------------------------------------------------------------- pandas


def _pandas() -> Any:
    try:
        import pandas
    except ImportError:
        raise ForecastsError(
            "pandas is not installed; install it (pip install 'robot-llm[pandas]') or use the record lists"
        ) from None
    return pandas


THESIS_FIELDS: tuple[str, ...] = tuple(f.name for f in fields(ThesisRecord))


def to_dataframe(records: Sequence[ThesisRecord]) -> pd.DataFrame:
    """Thesis records as a DataFrame: one row per record, one column per field, times as UTC timestamps.

    Needs pandas (an optional dependency); raises ForecastsError when it is missing.
    """
    pd = _pandas()
    frame = pd.DataFrame([asdict(r) for r in records], columns=list(THESIS_FIELDS))
    for column in ("as_of", "available_at", "valid_until"):
        frame[column] = pd.to_datetime(frame[column], utc=True).astype("datetime64[ns, UTC]")
    for column in ("stance", "score"):
        frame[column] = frame[column].astype("float64")
    frame["id"] = frame["id"].astype("int64")
    return frame
