"""The YAML configuration: loaded once at the edge, validated, handed on as frozen objects.

Every error names the file, the line and the key path, e.g.
``config/robot-llm.yaml:14: feeds[2].interval: expected a duration like '15m', got 'often'``.
Reading the text (YAML 1.2 typing, ``${VAR}``, line numbers, value parsers) is
:mod:`robot_llm.config_parsing`.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo

import yaml
from pydantic import (
    Field,
    ValidationError,
    model_validator,
)

from robot_llm.config_parsing import (
    ConfigError,
    PathError,
    Yaml12SafeLoader,
    format_duration,
    format_path,
    interpolate,
    line_index,
    located,
    parse_duration,
    parse_size,
    validation_message,
)
from robot_llm.config_sections import (
    BatchConfig,
    DaemonConfig,
    DatabaseConfig,
    FeedConfig,
    HttpConfig,
    InstrumentConfig,
    LoggingConfig,
    ModelConfig,
    PricesConfig,
    PromptsConfig,
    ReportConfig,
    ScheduleConfig,
    Section,
    SignalsConfig,
    TimeZone,
)

__all__ = [
    "AppConfig",
    "ConfigError",
    "format_duration",
    "load_config",
    "parse_duration",
    "parse_size",
]


class AppConfig(Section):
    """The whole validated configuration."""

    # An omitted section is validated as an empty mapping, in the same context as a written
    # one, so its default paths resolve against the config folder (hence dict factories).
    database: DatabaseConfig = Field(default_factory=dict)  # type: ignore[arg-type]
    timezone: TimeZone = "UTC"
    instruments: tuple[InstrumentConfig, ...] = Field(min_length=1)
    feeds: tuple[FeedConfig, ...] = ()
    http: HttpConfig = Field(default_factory=dict)  # type: ignore[arg-type]
    signals: SignalsConfig = Field(default_factory=dict)  # type: ignore[arg-type]
    prompts: PromptsConfig = Field(default_factory=dict)  # type: ignore[arg-type]
    model: ModelConfig
    schedule: ScheduleConfig = Field(default_factory=dict)  # type: ignore[arg-type]
    batch: BatchConfig = Field(default_factory=dict)  # type: ignore[arg-type]
    daemon: DaemonConfig = Field(default_factory=dict)  # type: ignore[arg-type]
    logging: LoggingConfig = Field(default_factory=dict)  # type: ignore[arg-type]
    report: ReportConfig = Field(default_factory=dict)  # type: ignore[arg-type]
    prices: PricesConfig = Field(default_factory=dict)  # type: ignore[arg-type]

    source: Path | None = Field(default=None, exclude=True)

    @model_validator(mode="after")
    def _unique_and_known(self) -> AppConfig:
        seen: set[str] = set()
        for i, inst in enumerate(self.instruments):
            if inst.ticker in seen:
                raise PathError(("instruments", i, "ticker"), f"duplicate ticker {inst.ticker!r}")
            seen.add(inst.ticker)
        names: set[str] = set()
        for i, feed in enumerate(self.feeds):
            if feed.name in names:
                raise PathError(("feeds", i, "name"), f"duplicate feed name {feed.name!r}")
            names.add(feed.name)
            for ticker in feed.tickers or ():
                if ticker not in seen:
                    raise PathError(("feeds", i, "tickers"), f"unknown ticker {ticker!r} (not in instruments)")
        self._known_price_tickers(seen)
        return self

    def _known_price_tickers(self, known: set[str]) -> None:
        # The benchmark may be an index the robot does not trade; the per-ticker maps may not.
        allowed = known | ({self.prices.benchmark} if self.prices.benchmark else set())
        maps: list[tuple[tuple[str, ...], list[str]]] = [(("prices", "close_times"), list(self.prices.close_times))]
        if self.prices.freqtrade is not None:
            maps.append((("prices", "freqtrade", "pairs"), list(self.prices.freqtrade.pairs)))
        for path, tickers in maps:
            for ticker in tickers:
                if ticker not in allowed:
                    message = f"unknown ticker {ticker!r} (not in instruments or prices.benchmark)"
                    raise PathError((*path, ticker), message)

    @property
    def tz(self) -> ZoneInfo:
        """The configured zone as a ZoneInfo."""
        return ZoneInfo(self.timezone)

    def instrument(self, ticker: str) -> InstrumentConfig:
        """The instrument with this ticker; KeyError if unknown."""
        for inst in self.instruments:
            if inst.ticker == ticker:
                return inst
        raise KeyError(ticker)

    def feed(self, name: str) -> FeedConfig:
        """The feed with this name; KeyError if unknown."""
        for feed in self.feeds:
            if feed.name == name:
                return feed
        raise KeyError(name)


# --------------------------------------------------------------------------- entry point


def load_config(path: str | os.PathLike[str]) -> AppConfig:
    """Read, interpolate and validate a YAML config file.

    Raises ConfigError with ``file:line: key.path: message`` for every problem found.
    """
    path = Path(path)
    source = str(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{source}: config file not found") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{source}: cannot read config file: {exc}") from None
    try:
        node = yaml.compose(text, Loader=Yaml12SafeLoader)
        data = yaml.load(text, Loader=Yaml12SafeLoader)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = mark.line + 1 if mark else 1
        problem = exc.problem or exc.context or "invalid YAML"
        raise ConfigError(f"{source}:{line}: YAML syntax error: {problem}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{source}: YAML error: {exc}") from None
    if data is None:
        raise ConfigError(f"{source}:1: the config file is empty")
    if not isinstance(data, dict):
        raise ConfigError(f"{source}:1: expected a mapping of sections at the top level")
    lines = dict(line_index(node)) if node is not None else {}

    missing: list[tuple[tuple[Any, ...], str]] = []
    data = interpolate(data, (), missing)
    if missing:
        raise ConfigError(
            "\n".join(located(source, lines, p, f"environment variable ${{{name}}} is not set") for p, name in missing)
        )
    try:
        config = AppConfig.model_validate(data, context={"base_dir": path.resolve().parent})
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            ctx_err = (err.get("ctx") or {}).get("error")
            if isinstance(ctx_err, PathError):
                problems.append(located(source, lines, ctx_err.path, ctx_err.message))
                continue
            loc = tuple(err["loc"])
            problems.append(located(source, lines, loc, validation_message(err)))
        raise ConfigError("\n".join(problems)) from None
    return config.model_copy(update={"source": path.resolve()})


_SECRET_RE = re.compile(r"(password|secret|token|api_key|apikey)", re.I)


def effective_config(config: AppConfig) -> dict[str, Any]:
    """The effective configuration as plain data, with secrets masked (for `config check`)."""
    data = config.model_dump(mode="json", exclude={"source"})

    def mask(value: Any, key: str = "") -> Any:
        if isinstance(value, dict):
            return {k: mask(v, k) for k, v in value.items()}
        if isinstance(value, list):
            return [mask(v, key) for v in value]
        if isinstance(value, str):
            value = re.sub(r"(://[^:/@]+:)[^@]+@", r"\1***@", value)
            if _SECRET_RE.search(key):
                return "***"
        return value

    return mask(data)


def config_snapshot(config: AppConfig) -> str:
    """The configuration in force as JSON, every value resolved: what the daemon hands its generation child.

    Secrets are in it (interpolated from the environment), so it travels over a pipe, never
    through a file.
    """
    return json.dumps(
        {
            "source": str(config.source) if config.source is not None else None,
            "config": config.model_dump(mode="json", exclude={"source"}),
        },
        ensure_ascii=False,
    )


def config_from_snapshot(text: str, origin: str = "the config snapshot") -> AppConfig:
    """The :class:`AppConfig` a :func:`config_snapshot` describes, validated again; ConfigError names ``origin``."""
    try:
        data = json.loads(text)
        source = Path(data["source"]) if data.get("source") else None
        config = AppConfig.model_validate(
            data["config"], context={"base_dir": source.parent if source is not None else Path.cwd()}
        )
    except ValidationError as exc:
        problems = "; ".join(f"{format_path(tuple(e['loc']))}: {validation_message(e)}" for e in exc.errors())
        raise ConfigError(f"{origin}: {problems}") from None
    except (ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"{origin}: not a config snapshot ({type(exc).__name__}: {exc})") from None
    return config.model_copy(update={"source": source})
