"""The configuration's sections, one typed model each (database, instruments, feeds, signals,
prompts, model, schedule, batch, daemon, logging, report, prices), and the value types they
share. :mod:`robot_llm.config` assembles them into :class:`~robot_llm.config.AppConfig`.
"""

from __future__ import annotations

import os
import re
import tempfile
from datetime import date, time, timedelta
from pathlib import Path
from typing import Annotated, Any, Literal
from zoneinfo import ZoneInfo

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainSerializer,
    ValidationInfo,
    field_validator,
    model_validator,
)

from robot_llm.config_parsing import (
    format_duration,
    parse_clock,
    parse_duration,
    parse_size,
    validate_cron,
    validate_zone,
)

# Written back (config check, JSON) the way a user writes it: '15m', not ISO 8601's 'PT15M'.
Duration = Annotated[timedelta, BeforeValidator(parse_duration), PlainSerializer(format_duration, when_used="json")]
Size = Annotated[int, BeforeValidator(parse_size)]
Clock = Annotated[time, BeforeValidator(parse_clock), PlainSerializer(lambda t: t.strftime("%H:%M"), when_used="json")]
Cron = Annotated[str, BeforeValidator(validate_cron)]
TimeZone = Annotated[str, BeforeValidator(validate_zone)]


def _resolve(value: Path | None, info: ValidationInfo) -> Path | None:
    """Relative paths are relative to the config file's folder, not the working directory."""
    if value is None:
        return None
    base = (info.context or {}).get("base_dir")
    path = Path(os.path.expanduser(str(value)))
    if not path.is_absolute() and base is not None:
        path = Path(base) / path
    return path


def _check_writable_folder(folder: Path, what: str) -> None:
    """Raise ValueError unless ``folder`` is an existing folder we can create files in.

    ``os.access`` alone is not enough: it says yes to root everywhere, even on a read-only
    file system, so the last word is a real (immediately removed) file.
    """
    if not folder.exists():
        raise ValueError(f"the {what} folder {folder} does not exist")
    if not folder.is_dir():
        raise ValueError(f"the {what} folder {folder} is not a folder")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ValueError(f"the {what} folder {folder} is not writable")
    try:
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".robot-llm-write-test-"):
            pass
    except OSError as exc:
        raise ValueError(f"the {what} folder {folder} is not writable ({exc.strerror})") from None


class Section(BaseModel):
    # validate_default: defaults go through the validators too, so a default path is
    # resolved against the config folder like a written one.
    model_config = ConfigDict(extra="forbid", frozen=True, strict=False, validate_default=True)


# --------------------------------------------------------------------------- sections


class DatabaseConfig(Section):
    """Where the theses live; SQLite file paths are resolved against the config folder."""

    url: str = "sqlite:///robot-llm.sqlite"
    echo: bool = False

    @field_validator("url")
    @classmethod
    def _resolve_sqlite(cls, v: str, info: ValidationInfo) -> str:
        if not isinstance(v, str) or "://" not in v:
            raise ValueError(f"expected a database URL like 'sqlite:///robot-llm.sqlite', got {v!r}")
        prefix = "sqlite:///"
        if v.startswith(prefix) and v != "sqlite:///:memory:":
            raw = v[len(prefix) :]
            path = _resolve(Path(raw), info)
            assert path is not None
            _check_writable_folder(path.parent, "database")
            return prefix + str(path)
        return v


class InstrumentConfig(Section):
    """An instrument the robot trades, and the words that find it in news."""

    ticker: str = Field(min_length=1, max_length=32)
    name: str
    aliases: tuple[str, ...] = ()
    exchange: str | None = None

    @field_validator("ticker", "name", mode="before")
    @classmethod
    def _must_be_text(cls, v: Any) -> Any:
        if not isinstance(v, str):
            raise ValueError(f"expected text (quote it in YAML), got {v!r}")
        return v


class FeedConfig(Section):
    """One RSS/Atom feed: an http(s) URL, a ``file://`` URL or a local path."""

    name: str = Field(min_length=1)
    url: str
    interval: Duration = timedelta(minutes=15)
    language: str | None = None
    # The instruments this feed is about (e.g. a company's own press-release feed): each of its
    # entries is tagged with them, in addition to the instruments its text names.
    tickers: tuple[str, ...] | None = None
    enabled: bool = True

    @field_validator("url")
    @classmethod
    def _resolve_local(cls, v: str, info: ValidationInfo) -> str:
        if re.match(r"^https?://", v) or v.startswith("file://"):
            return v
        path = _resolve(Path(v), info)
        return str(path)

    @field_validator("interval")
    @classmethod
    def _positive(cls, v: timedelta) -> timedelta:
        if v < timedelta(seconds=10):
            raise ValueError(f"a poll interval under 10s hammers the publisher, got {v}")
        return v


class HttpConfig(Section):
    """How feeds are fetched."""

    connect_timeout: Duration = timedelta(seconds=10)
    read_timeout: Duration = timedelta(seconds=30)
    retries: int = Field(default=3, ge=0, le=10)
    backoff: Duration = timedelta(seconds=1)
    max_bytes: Size = 10 * 2**20
    # A hard ceiling on one attempt (connect + every read): a server that trickles bytes
    # slowly never trips the read timeout, and must not hold the night hostage.
    total_timeout: Duration = timedelta(seconds=120)
    user_agent: str = "robot-llm/0.1 (+https://github.com/robot-llm/robot-llm)"


class SignalSourceConfig(Section):
    """A drop folder the robot writes its forecasts into (JSONL or CSV files)."""

    name: str = Field(min_length=1)
    drop_dir: Path

    _abs = field_validator("drop_dir")(_resolve)


class SignalsConfig(Section):
    """The robot's own forecasts."""

    sources: tuple[SignalSourceConfig, ...] = ()
    lookback: Duration = timedelta(days=3)


class GenerationConfig(Section):
    """Sampling parameters; a template's front matter may override them."""

    max_new_tokens: int = Field(default=96, ge=1, le=1023)
    greedy: bool = False
    temperature: float = Field(default=0.7, gt=0)
    top_k: int = Field(default=0, ge=0)
    top_p: float = Field(default=0.9, ge=0, le=1)
    seed: int = 1234


class PromptsConfig(Section):
    """Which templates run every night, and what they may see."""

    dir: Path = Path("prompts")
    templates: tuple[str, ...] = ("thesis_ru",)
    generation: GenerationConfig = Field(default_factory=dict)  # type: ignore[arg-type]
    news_lookback: Duration = timedelta(days=2)
    max_news: int = Field(default=20, ge=0)
    valid_for: Duration = timedelta(days=1)
    # A prompt with no news and no signals is stored as an explicit "no inputs" abstention
    # (no thesis, no stance, no generation); false generates it anyway.
    abstain_without_inputs: bool = True

    _abs = field_validator("dir")(_resolve)


class ModelConfig(Section):
    """The model: where its weights are and how they are run."""

    id: str = "yalm-100b"
    backend: Literal["stream", "memory", "deepspeed"] = "stream"
    checkpoint: Path | None = None
    store: Path | None = None
    vocab: Path | None = None
    home: Literal["auto", "disk", "ram", "split"] = "auto"
    offload: Literal["cpu", "nvme"] = "cpu"
    offload_dir: Path | None = None
    dtype: Literal["auto", "fp32", "bf16", "fp16", "int8", "int4"] = "auto"
    threads: int | None = Field(default=None, ge=1, le=1024)
    micro_batch: int | None = Field(default=None, ge=1, le=4096)
    kv_dtype: Literal["auto", "fp32", "bf16", "fp16", "int8", "int4"] = "auto"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    max_batch_size: int = Field(default=32, ge=1, le=4096)
    # KV slots per row kept free so a row whose thesis is done takes the next waiting prompt.
    refill_slots: int = Field(default=0, ge=0, le=65536)
    memory_budget: Size | None = None
    gpu_memory_budget: Size | None = None
    max_positions: int = Field(default=1024, ge=16, le=1024)

    _abs = field_validator("checkpoint", "store", "vocab", "offload_dir")(_resolve)

    @model_validator(mode="after")
    def _weights_somewhere(self) -> ModelConfig:
        if self.checkpoint is None and self.store is None:
            raise ValueError("set model.store (a converted weight store) or model.checkpoint (the release folder)")
        if self.vocab is None:
            raise ValueError("set model.vocab (the SentencePiece file, e.g. voc_100b.sp)")
        if self.backend == "stream" and self.store is None:
            raise ValueError("backend 'stream' reads a weight store: set model.store (see `robot-llm model convert`)")
        return self


_WEEKDAYS = ("mon", "tue", "wed", "thu", "fri", "sat", "sun")


class ScheduleConfig(Section):
    """When each job runs, in the config's ``timezone``."""

    nightly: Cron = "0 23 * * 0-4"
    signals: Cron = "*/10 * * * *"
    morning_report: Cron = "45 8 * * 1-5"
    cutoff: Clock = time(9, 30)
    trading_days: tuple[str, ...] = ("mon", "tue", "wed", "thu", "fri")
    holidays: tuple[date, ...] = ()
    skip_non_trading_days: bool = True

    @field_validator("trading_days")
    @classmethod
    def _days(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        bad = [d for d in v if d.lower() not in _WEEKDAYS]
        if bad:
            raise ValueError(f"unknown weekday(s) {bad}; use {', '.join(_WEEKDAYS)}")
        return tuple(d.lower() for d in v)


class BatchConfig(Section):
    """How the nightly queue is worked."""

    max_attempts: int = Field(default=3, ge=1)
    lease: Duration = timedelta(minutes=30)
    stall_timeout: Duration = timedelta(minutes=20)
    child_timeout: Duration = timedelta(hours=8)


class DaemonConfig(Section):
    """The long-running scheduler process."""

    heartbeat: Duration = timedelta(seconds=60)
    lease_ttl: Duration = timedelta(minutes=3)
    shutdown_timeout: Duration = timedelta(seconds=60)


class LoggingConfig(Section):
    """Log level, format and optional file."""

    level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    format: Literal["text", "json"] = "text"
    file: Path | None = None

    _abs = field_validator("file")(_resolve)

    @field_validator("level", mode="before")
    @classmethod
    def _upper(cls, v: Any) -> Any:
        return v.upper() if isinstance(v, str) else v


class ReportConfig(Section):
    """The morning report as HTML pages (needs the ``report`` extra: plotly)."""

    # One morning-YYYY-MM-DD.html per morning and an index.html of them; None: text report only.
    html_dir: Path | None = None
    nights: int = Field(default=30, ge=1, le=366)

    _abs = field_validator("html_dir")(_resolve)


# --------------------------------------------------------------------------- prices (the track record)


def _parse_zoned_clock(value: Any) -> tuple[time, str | None]:
    if isinstance(value, tuple):
        return value
    parts = value.split() if isinstance(value, str) else []
    if len(parts) not in (1, 2):
        raise ValueError(f"expected a local time like '18:50' or '16:00 America/New_York', got {value!r}")
    return parse_clock(parts[0]), validate_zone(parts[1]) if len(parts) == 2 else None


def _format_zoned_clock(value: tuple[time, str | None]) -> str:
    return value[0].strftime("%H:%M") + (f" {value[1]}" if value[1] else "")


# A close time, optionally in its exchange's own zone: '16:00 America/New_York'.
ZonedClock = Annotated[
    tuple[time, str | None],
    BeforeValidator(_parse_zoned_clock),
    PlainSerializer(_format_zoned_clock, when_used="json"),
]


class FreqtradePricesConfig(Section):
    """Closes from freqtrade's data folder (what ``freqtrade download-data`` writes)."""

    # user_data/data/<exchange>: holds <PAIR>-<timeframe>.feather or .json per pair.
    data_dir: Path
    timeframe: str = "1d"
    # ticker -> freqtrade pair, e.g. {"BTC": "BTC/USDT"}.
    pairs: dict[str, str] = Field(min_length=1)

    _abs = field_validator("data_dir")(_resolve)

    @field_validator("timeframe")
    @classmethod
    def _timeframe(cls, v: str) -> str:
        if not re.fullmatch(r"\d+[mhdw]", v):
            raise ValueError(f"expected a freqtrade timeframe like '5m', '1h', '1d', '1w', got {v!r}")
        return v


class PricesConfig(Section):
    """Closing prices, and the track record that scores every thesis against them.

    A CSV row dated without a time is that day's close at ``market_close`` (local time in the
    config's ``timezone``), or at the ticker's ``close_times`` entry ('16:00 America/New_York':
    in that zone; without a zone, in the config's).
    """

    csv: Path | None = None
    freqtrade: FreqtradePricesConfig | None = None
    # The key of a signal's extras that carries a close (e.g. "close"); None: signals give none.
    signal_price: str | None = None
    horizons: tuple[Duration, ...] = (timedelta(days=1),)
    market_close: Clock = time(18, 50)
    close_times: dict[str, ZonedClock] = Field(default_factory=dict)
    benchmark: str | None = None
    schedule: Cron = "20 * * * *"
    min_count: int = Field(default=20, ge=3)
    window: Duration = timedelta(days=90)
    bootstrap: int = Field(default=1000, ge=0, le=100_000)
    seed: int = 0

    _abs = field_validator("csv")(_resolve)

    @field_validator("horizons")
    @classmethod
    def _horizons(cls, v: tuple[timedelta, ...]) -> tuple[timedelta, ...]:
        if not v:
            raise ValueError("give at least one horizon, e.g. [1d, 5d]")
        if any(h <= timedelta(0) for h in v):
            raise ValueError("every horizon must be longer than zero")
        if len(set(v)) != len(v):
            raise ValueError("a horizon is given twice")
        return v

    @property
    def enabled(self) -> bool:
        """Whether any price source is configured."""
        return self.csv is not None or self.freqtrade is not None or self.signal_price is not None

    def close_time(self, ticker: str, default_zone: str) -> tuple[time, ZoneInfo]:
        """The time and zone of ``ticker``'s daily close (what a date-only CSV row means)."""
        clock, zone = self.close_times.get(ticker, (self.market_close, None))
        return clock, ZoneInfo(zone or default_zone)
