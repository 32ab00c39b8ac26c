"""The token budget: rendering one instrument's prompt so that it fits the model's window.

The rendered prompt must fit the model's window with room for the completion (and for the
stance cue and label scored after it). :func:`render_within_budget` counts with the real
tokenizer and drops news one item at a time, least relevant first, re-rendering each time;
the template itself is never cut.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import Literal, Protocol

from robot_llm.clock import aware_utc
from robot_llm.config import AppConfig
from robot_llm.config_sections import GenerationConfig, InstrumentConfig
from robot_llm.errors import RobotLLMError
from robot_llm.prompting.context import (
    InstrumentView,
    NewsEntry,
    RenderContext,
    SignalEntry,
    example_variant,
    news_view,
    signal_view,
)
from robot_llm.prompting.render import render_prompt
from robot_llm.prompting.stance_prompt import content_free_context
from robot_llm.prompting.template import Template

__all__ = [
    "DroppedNews",
    "PromptTooLong",
    "RenderResult",
    "TokenCounter",
    "render_within_budget",
    "token_budget",
]


class PromptTooLong(RobotLLMError):
    """Even with no news at all, the rendered prompt does not fit the model's window."""


class TokenCounter(Protocol):
    """What rendering needs from a tokenizer: the ids the model would get, BOS included."""

    def encode(self, text: str) -> list[int]: ...


@dataclass(frozen=True)
class DroppedNews:
    """A gathered news item left out of the prompt, and why ('max_items' or 'budget')."""

    entry: NewsEntry
    reason: Literal["max_items", "budget"]


@dataclass(frozen=True)
class RenderResult:
    """A prompt ready to store: text, its real token count and what went into it."""

    template: Template
    ticker: str
    as_of: datetime
    prompt: str
    prompt_tokens: int
    budget: int
    generation: GenerationConfig
    news_ids: tuple[int, ...]
    signal_ids: tuple[int, ...]
    dropped: tuple[DroppedNews, ...]
    calibration: str | None = None  # the content-free stance context, when the template calibrates

    @property
    def prompt_sha256(self) -> str:
        """Hex SHA-256 of the prompt's UTF-8 bytes."""
        return hashlib.sha256(self.prompt.encode("utf-8")).hexdigest()


def token_budget(template: Template, config: AppConfig, tokenizer: TokenCounter) -> int:
    """Positions the prompt (BOS included) may take.

    ``max_positions − max_new_tokens``, less the stance cue and the longest label, which
    are scored after the thesis and must fit the same window.
    """
    budget = config.model.max_positions - template.generation_for(config).max_new_tokens
    if template.stance is not None:
        cue = len(tokenizer.encode(template.stance.cue)) - 1
        label = max(len(tokenizer.encode(text)) - 1 for text in template.stance.labels)
        budget -= cue + label
    return budget


def render_within_budget(
    template: Template,
    config: AppConfig,
    instrument: InstrumentConfig,
    as_of: datetime,
    news: Iterable[NewsEntry],
    signals: Iterable[SignalEntry],
    tokenizer: TokenCounter,
) -> RenderResult:
    """Render the prompt for one instrument so that it fits :func:`token_budget`.

    Keeps the ``news.max_items`` most relevant items, then, while the prompt is too long,
    drops the least relevant remaining one (weak match, fewer mentions, then oldest) and
    renders again. News appear oldest first; signals newest first, at most ``signals.max``.
    Raises PromptTooLong when even no news does not fit.
    """
    as_of = aware_utc(as_of, "as_of")
    tz = config.tz
    markers = template.section_markers()
    ranked = sorted(news, key=NewsEntry.relevance, reverse=True)  # most relevant first
    limit = template.news_limit(config)
    dropped = [DroppedNews(e, "max_items") for e in ranked[limit:]]
    kept = ranked[:limit]
    chosen_signals = (
        sorted(signals, key=lambda s: (s.generated_at, s.id), reverse=True)[: template.signals.max]
        if template.signals.include
        else []
    )
    signal_views = tuple(signal_view(s, template.language, tz, markers) for s in chosen_signals)
    view = InstrumentView(instrument.ticker, instrument.name, tuple(instrument.aliases), instrument.exchange)
    budget = token_budget(template, config, tokenizer)

    while True:
        shown = sorted(kept, key=lambda e: (e.at, e.id))
        context = RenderContext(
            instrument=view,
            as_of=as_of.astimezone(tz),
            language=template.language,
            news=tuple(news_view(e, template, tz, markers) for e in shown),
            signals=signal_views,
            variant=example_variant(instrument.ticker, as_of),
        )
        prompt = render_prompt(template, context)
        tokens = len(tokenizer.encode(prompt))
        if tokens <= budget:
            return RenderResult(
                template=template,
                ticker=instrument.ticker,
                as_of=as_of,
                prompt=prompt,
                prompt_tokens=tokens,
                budget=budget,
                generation=template.generation_for(config),
                news_ids=tuple(e.id for e in shown),
                signal_ids=tuple(s.id for s in chosen_signals),
                dropped=tuple(dropped),
                calibration=(
                    content_free_context(template, as_of, tz)
                    if template.stance is not None and template.stance.mode == "content-free"
                    else None
                ),
            )
        if not kept:
            raise PromptTooLong(
                f"template {template.name!r} for {instrument.ticker}: the prompt takes {tokens} tokens without "
                f"any news, over the budget of {budget} (model.max_positions {config.model.max_positions} minus "
                f"max_new_tokens and the stance cue); shorten the template or lower max_new_tokens"
            )
        dropped.append(DroppedNews(kept.pop(), "budget"))
