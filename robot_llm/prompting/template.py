"""What a template declares: its YAML front matter, validated, and the :class:`Template` it loads into.

A template is a file ``prompts/<name>.j2``: YAML front matter between two ``---`` lines,
then a Jinja2 body (see ``prompts/README.md``). The front matter is checked strictly
(``extra=forbid``): a misspelt key is an error at load time, not a silently ignored option.
Finding and reading the files is :mod:`robot_llm.prompting.loading`.
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator, model_validator

from robot_llm.config import AppConfig
from robot_llm.config_sections import Duration, GenerationConfig
from robot_llm.errors import RobotLLMError
from robot_llm.prompting.sanitize import ALWAYS_MARKERS

__all__ = [
    "CalibrationMode",
    "GenerationOverrides",
    "NewsOptions",
    "NewsStanceOptions",
    "SignalOptions",
    "StanceMethod",
    "StanceOptions",
    "Template",
    "TemplateError",
    "TemplateHeader",
]


class TemplateError(RobotLLMError):
    """A template file is invalid or failed to render; the message names the file and line."""


def _version_text(value: Any) -> Any:
    # ``version: 2`` is an int in YAML; the version is a label, so keep what was written.
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    return value


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class NewsOptions(_Section):
    """Which news a template shows and how much of each item."""

    max_items: int | None = Field(default=None, ge=0, le=200)
    lookback: Duration | None = None
    fields: tuple[Literal["title", "summary"], ...] = ("title", "summary")
    max_chars: int = Field(default=300, ge=20, le=4000)


class SignalOptions(_Section):
    """Whether and how many of the robot's latest forecasts a template shows."""

    include: bool = True
    max: int = Field(default=3, ge=0, le=50)


class GenerationOverrides(_Section):
    """Per-template overrides of ``config.prompts.generation``; unset fields keep the config's value."""

    max_new_tokens: int | None = Field(default=None, ge=0, le=1023)  # 0: a stance with no thesis
    greedy: bool | None = None
    temperature: float | None = Field(default=None, gt=0)
    top_k: int | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, ge=0, le=1)
    seed: int | None = None


#: How the labels' token log-probabilities are compared (see :class:`StanceOptions`).
StanceMethod = Literal["sum", "mean", "first"]
#: How the label prior is estimated and divided out (:mod:`robot_llm.night.stance`).
CalibrationMode = Literal["none", "content-free", "domain", "batch"]


class NewsStanceOptions(_Section):
    """A second stance question, read after the news (no thesis) from the same row's cache.

    The prompt is cut before the last occurrence of ``before`` (the line after the news,
    e.g. ``"\nRobot forecast:"``), then ``cue`` and the same labels are scored: the stance of
    the news the prompt shows, in the step after the thesis's own stance (no pass of its own).
    """

    cue: str = Field(min_length=1)
    before: str = Field(min_length=1)


class StanceOptions(_Section):
    """The cue appended after a thesis, the label continuations scored after it, and how they compare.

    ``method``: ``sum`` adds the log-probabilities of a label's pieces (a label of more
    pieces is penalised for its length), ``mean`` takes their mean per piece (length-fair),
    ``first`` the first piece only (the labels must then be single pieces with distinct
    ids; the template check enforces it). ``calibrate``: divide out the label prior the
    model shows for a content-free prompt (the template with no instrument, news or
    forecast; Zhao et al., "Calibrate Before Use", 2021), computed once per template per night;
    the same as ``calibration: content-free``. ``calibration`` names the mode: ``none``,
    ``content-free``, ``domain`` (the mean prior of ``domain_samples`` renderings whose news and
    thesis are random words from the night's own news; Fei et al., ACL 2023) or ``batch`` (the
    mean label probability of the night's rows; Zhou et al., ICLR 2024). ``after``: the cue
    follows the generated thesis (``thesis``, the thesis's stance) or the prompt itself
    (``prompt``: the stance of the news it shows, read from the same cache; the thesis is still
    written and stored). ``news`` asks the news stance as well, beside the thesis's; ``store``
    says which of the two is the row's ``stance`` (the other is kept in ``text_stance`` /
    ``news_stance``). ``verdicts`` (one phrase per label): the thesis the model writes (the
    news's fact, up to a stop) is closed with the stored stance's verdict phrase, so that the
    sentence a person reads and the number a strategy trades say the same thing.
    """

    cue: str = Field(min_length=1)
    labels: dict[str, float] = Field(min_length=2)
    method: StanceMethod = "sum"
    calibrate: bool = False
    calibration: CalibrationMode | None = None
    domain_samples: int = Field(default=8, ge=1, le=64)
    after: Literal["thesis", "prompt"] = "thesis"
    news: NewsStanceOptions | None = None
    store: Literal["thesis", "news"] = "thesis"
    verdicts: dict[str, str] | None = None

    @model_validator(mode="after")
    def _verdict_per_label(self) -> StanceOptions:
        if self.verdicts is not None and set(self.verdicts) != set(self.labels):
            raise ValueError(f"stance.verdicts: one phrase per label ({', '.join(map(repr, self.labels))})")
        return self

    @model_validator(mode="after")
    def _stored_exists(self) -> StanceOptions:
        if self.store == "news" and self.news is None:
            raise ValueError("stance.store: 'news' needs stance.news (the cue and where the news ends)")
        return self

    @model_validator(mode="after")
    def _one_calibration(self) -> StanceOptions:
        if self.calibrate and self.calibration not in (None, "content-free"):
            raise ValueError(f"calibrate: true is calibration 'content-free'; it contradicts {self.calibration!r}")
        return self

    @property
    def mode(self) -> CalibrationMode:
        """The calibration mode: ``calibration``, else ``content-free`` for ``calibrate: true``, else ``none``."""
        if self.calibration is not None:
            return self.calibration
        return "content-free" if self.calibrate else "none"

    @field_validator("labels")
    @classmethod
    def _labels(cls, v: dict[str, float]) -> dict[str, float]:
        for label, value in v.items():
            if not label.strip():
                raise ValueError("a stance label must contain text (e.g. ' рост')")
            if not -1.0 <= value <= 1.0:
                raise ValueError(f"stance value of {label!r} must be between -1 and 1, got {value}")
        return v


class TemplateHeader(_Section):
    """The YAML front matter of a template (``extra=forbid``: a misspelt key is an error)."""

    name: str = Field(pattern=r"^[A-Za-z0-9_.-]+$")
    version: Annotated[str, BeforeValidator(_version_text)] = Field(min_length=1, max_length=64)
    language: str = Field(pattern=r"^[a-z]{2}(-[A-Za-z]{2})?$")
    description: str = ""
    news: NewsOptions = NewsOptions()
    signals: SignalOptions = SignalOptions()
    generation: GenerationOverrides = GenerationOverrides()
    stop: tuple[str, ...] = ()
    stance: StanceOptions | None = None
    markers: tuple[str, ...] = ()

    @field_validator("stop")
    @classmethod
    def _no_empty_stop(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        if any(not s for s in v):
            raise ValueError("an empty stop string would end every completion at once")
        return v

    @field_validator("markers")
    @classmethod
    def _visible_markers(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        if any(not s.strip() for s in v):
            raise ValueError("markers must contain visible text")
        return v


class Template(TemplateHeader):
    """A loaded template: its front matter, its Jinja body, and where it came from."""

    path: Path
    body: str
    body_line: int = Field(ge=1)

    def generation_for(self, config: AppConfig) -> GenerationConfig:
        """``config.prompts.generation`` with this template's overrides applied."""
        overrides = {k: v for k, v in self.generation.model_dump().items() if v is not None}
        return config.prompts.generation.model_copy(update=overrides)

    def news_limit(self, config: AppConfig) -> int:
        """How many news items at most go into one prompt."""
        return config.prompts.max_news if self.news.max_items is None else self.news.max_items

    def news_lookback(self, config: AppConfig) -> timedelta:
        """How far back (a timedelta) news is gathered for this template."""
        return self.news.lookback if self.news.lookback is not None else config.prompts.news_lookback

    def section_markers(self) -> tuple[str, ...]:
        """Header words that data must not imitate: the declared markers, the stop strings, the cue."""
        found: list[str] = list(ALWAYS_MARKERS)
        candidates = [*self.markers, *self.stop, *((self.stance.cue,) if self.stance else ())]
        for text in candidates:
            word = text.strip().rstrip(":").strip()
            if word and any(ch.isalnum() for ch in word) and word not in found:
                found.append(word)
        return tuple(found)
