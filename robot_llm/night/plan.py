"""The nightly plan: which night it is, and the generation requests for it.

A night is identified by its cut-off ``as_of``: the fire time of ``schedule.nightly`` (see
:func:`night_as_of`). For each instrument and each configured template, :func:`plan_night`
gathers what we knew at ``as_of`` — news *fetched* (our clock, never the feed's claimed
date) at or before it, signals *received* at or before it — renders the prompt within the
token budget and stores one pending GenerationRequest. The request is unique on
(as_of, ticker, template_name), so planning the same night again adds nothing.

The ``robot-llm prompts render`` command, which shows exactly the prompt a request would
get, is :mod:`robot_llm.commands.prompts`.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from sqlalchemy import func, select
from sqlalchemy.exc import IntegrityError

from robot_llm.clock import aware_utc
from robot_llm.errors import RobotLLMError
from robot_llm.prompting.budget import PromptTooLong, RenderResult, TokenCounter, render_within_budget
from robot_llm.prompting.context import NewsEntry, SignalEntry, example_variant
from robot_llm.prompting.loading import find_template, load_template, load_templates
from robot_llm.prompting.template import Template
from robot_llm.store.db import GenerationRequest, NewsItem, NewsTicker, Signal, session_scope, utcnow
from robot_llm.store.runs import beat_run, finish_run, start_run

if TYPE_CHECKING:
    from sqlalchemy.engine import Engine
    from sqlalchemy.orm import Session

    from robot_llm.config import AppConfig
    from robot_llm.config_sections import InstrumentConfig

__all__ = [
    "NO_INPUTS",
    "NightNotPlannable",
    "PlanResult",
    "check_templates",
    "derive_seed",
    "gather_news",
    "gather_signals",
    "night_news_texts",
    "no_news_reason",
    "plan_night",
    "plannable",
    "render_for",
    "request_params",
    "tokenizer_for",
]


def derive_seed(base_seed: int, as_of: datetime, ticker: str, template_name: str) -> int:
    """A per-request seed from the config seed and the request's identity (0 ≤ seed < 2**31).

    It depends on nothing else, so a sampled thesis is the same whichever prompts share its batch.
    """
    as_of = aware_utc(as_of, "as_of")
    key = f"{base_seed}|{as_of.isoformat()}|{ticker}|{template_name}".encode()
    return int.from_bytes(hashlib.sha256(key).digest()[:8], "big") % 2**31


def request_params(
    result: RenderResult, seed: int, contexts: Sequence[str] = (), *, abstain: bool = True
) -> dict[str, Any]:
    """The ``params`` JSON of a GenerationRequest (the batch contract's exact shape).

    ``contexts`` are the night's domain-calibration contexts of the template (mode ``domain``).
    With ``abstain`` (``prompts.abstain_without_inputs``), a prompt with no news and no signals
    gets ``abstain: "no_inputs"``: the worker stores an explicit abstention for it (no thesis,
    no stance) and runs no model for it.
    """
    gen = result.generation
    stance = result.template.stance
    params: dict[str, Any] = {
        "max_new_tokens": int(gen.max_new_tokens),
        "greedy": bool(gen.greedy),
        "temperature": float(gen.temperature),
        "top_k": int(gen.top_k),
        "top_p": float(gen.top_p),
        "seed": int(seed),
        "stop": list(result.template.stop),
        "stance": _stance_params(result, contexts) if stance is not None else None,
    }
    if abstain and not result.news_ids and not result.signal_ids:
        params["abstain"] = NO_INPUTS
    return params


#: ``params.abstain`` (and ``Thesis.kind``) of a prompt with no news and no signals.
NO_INPUTS = "no_inputs"


def _stance_params(result: RenderResult, contexts: Sequence[str]) -> dict[str, Any]:
    stance = result.template.stance
    assert stance is not None
    out: dict[str, Any] = {
        "cue": stance.cue,
        "labels": {k: float(v) for k, v in stance.labels.items()},
        "method": stance.method,
        "calibration_mode": stance.mode,
        # A template that writes no thesis reads its stance after the prompt: the news stance.
        "after": "prompt" if result.generation.max_new_tokens == 0 else stance.after,
    }
    if result.calibration is not None:
        out["calibration"] = result.calibration
    if stance.news is not None:
        out["news"] = {"cue": stance.news.cue, "before": stance.news.before}
        out["store"] = stance.store
    if stance.verdicts is not None:
        out["verdicts"] = dict(stance.verdicts)
    if stance.mode == "domain":
        out["calibration_contexts"] = list(contexts)
        if not contexts:  # a night without news has no domain words: fall back to no calibration
            out["calibration_mode"] = "none"
    return out


def night_news_texts(session: Session, config: AppConfig, template: Template, as_of: datetime) -> list[str]:
    """The text of every news item fetched in the template's lookback before ``as_of``, any instrument."""
    since = as_of - template.news_lookback(config)
    rows = session.execute(
        select(NewsItem.title, NewsItem.summary)
        .where(NewsItem.fetched_at <= as_of, NewsItem.fetched_at > since)
        .order_by(NewsItem.id)
    ).all()
    return [" ".join(part for part in (title, summary) if part) for title, summary in rows]


def _domain_contexts(engine: Engine, config: AppConfig, template: Template, as_of: datetime) -> list[str]:
    """The night's domain-calibration contexts for ``template`` (none unless its mode is ``domain``)."""
    from robot_llm.prompting.stance_prompt import domain_contexts

    if template.stance is None or template.stance.mode != "domain":
        return []
    with session_scope(engine) as session:
        texts = night_news_texts(session, config, template, as_of)
    seed = derive_seed(template.generation_for(config).seed, as_of, "", template.name)
    return domain_contexts(template, as_of, config.tz, texts, template.stance.domain_samples, seed)


def no_news_reason(session: Session, config: AppConfig, template: Template, as_of: datetime) -> str:
    """Why a night's prompts have no news: what was fetched relative to the cut-off and the lookback."""
    since = as_of - template.news_lookback(config)
    after = session.scalar(select(func.min(NewsItem.fetched_at)).where(NewsItem.fetched_at > as_of))
    before = session.scalar(select(func.max(NewsItem.fetched_at)).where(NewsItem.fetched_at <= as_of))
    local = config.tz
    if before is None and after is not None:
        return (
            f"no news was fetched by the cut-off {as_of.astimezone(local):%Y-%m-%d %H:%M %Z}; the first fetch came "
            f"after it ({after.astimezone(local):%Y-%m-%d %H:%M %Z}): plan with --as-of now (or a later cut-off)"
        )
    if before is None:
        return "no news has been fetched at all (run `robot-llm news fetch`)"
    if before <= since:
        return (
            f"the newest news fetched by the cut-off ({before.astimezone(local):%Y-%m-%d %H:%M %Z}) is older than "
            f"the lookback ({template.news_lookback(config)})"
        )
    return "no news in the lookback is tagged with these instruments (their names, tickers or aliases)"


# --------------------------------------------------------------------------- gathering


def _mention_patterns(instrument: InstrumentConfig) -> list[re.Pattern[str]]:
    words = {w.strip() for w in (instrument.ticker, instrument.name, *instrument.aliases) if w.strip()}
    return [re.compile(rf"(?<!\w){re.escape(w)}(?!\w)", re.IGNORECASE) for w in sorted(words)]


def gather_news(
    session: Session, config: AppConfig, template: Template, instrument: InstrumentConfig, as_of: datetime
) -> list[NewsEntry]:
    """News tagged with the instrument and fetched in (as_of − lookback, as_of].

    Point-in-time: the cut-off is our ``fetched_at``. The feed's ``published_at`` only
    excludes items that say they are older than the lookback (a feed added today replays
    its archive).
    """
    as_of = aware_utc(as_of, "as_of")
    since = as_of - template.news_lookback(config)
    rows = session.scalars(
        select(NewsItem)
        .join(NewsTicker, NewsTicker.news_id == NewsItem.id)
        .where(NewsTicker.ticker == instrument.ticker, NewsItem.fetched_at <= as_of, NewsItem.fetched_at > since)
        .order_by(NewsItem.id)
    ).all()
    patterns = _mention_patterns(instrument)
    entries = []
    for row in rows:
        if row.published_at is not None and row.published_at <= since:
            continue
        title, summary = row.title or "", row.summary or ""
        in_title = sum(len(p.findall(title)) for p in patterns)
        mentions = in_title + sum(len(p.findall(summary)) for p in patterns)
        entries.append(
            NewsEntry(
                id=row.id,
                title=title,
                summary=summary,
                feed=row.feed,
                published_at=row.published_at,
                fetched_at=row.fetched_at,
                mentions=mentions,
                in_title=in_title > 0,
            )
        )
    return entries


def gather_signals(
    session: Session, config: AppConfig, template: Template, ticker: str, as_of: datetime
) -> list[SignalEntry]:
    """The latest forecast per (model, horizon) received in (as_of − signals.lookback, as_of], newest first."""
    if not template.signals.include or template.signals.max == 0:
        return []
    as_of = aware_utc(as_of, "as_of")
    rows = session.scalars(
        select(Signal)
        .where(
            Signal.ticker == ticker,
            Signal.received_at <= as_of,
            Signal.received_at > as_of - config.signals.lookback,
        )
        .order_by(Signal.generated_at.desc(), Signal.id.desc())
    ).all()
    seen: set[tuple[str, str]] = set()
    out = []
    for row in rows:
        if (row.model, row.horizon) in seen:
            continue
        seen.add((row.model, row.horizon))
        out.append(
            SignalEntry(
                id=row.id,
                horizon=row.horizon,
                direction=row.direction,
                target=row.target,
                confidence=row.confidence,
                model=row.model,
                generated_at=row.generated_at,
            )
        )
        if len(out) == template.signals.max:
            break
    return out


def tokenizer_for(config: AppConfig) -> TokenCounter:
    """The configured model's tokenizer (no torch), or RobotLLMError saying why it does not load."""
    from robot_llm.llm.tokenizer import load_tokenizer  # sentencepiece/tokenizers only, no torch

    assert config.model.vocab is not None  # ModelConfig requires it
    try:
        return load_tokenizer(config.model.vocab)
    except (OSError, ValueError) as exc:
        raise RobotLLMError(f"model.vocab: cannot load the tokenizer: {exc}") from None


def render_for(
    session: Session,
    config: AppConfig,
    template: Template,
    instrument: InstrumentConfig,
    as_of: datetime,
    tokenizer: TokenCounter,
) -> RenderResult:
    """Gather the instrument's news and signals as of ``as_of`` and render ``template`` within the budget."""
    news = gather_news(session, config, template, instrument, as_of)
    signals = gather_signals(session, config, template, instrument.ticker, as_of)
    return render_within_budget(template, config, instrument, as_of, news, signals, tokenizer)


def check_templates(config: AppConfig, tokenizer: TokenCounter | None = None) -> list[str]:
    """Preflight: every configured template loads and renders for every instrument within the budget.

    Renders with one sample news item of the template's maximum length and one sample
    forecast, so a template that only breaks when data is present is caught too. Returns
    one message per problem, each naming the template file (and line, for render errors);
    an empty list when all is well. Needs no database.
    """
    problems: list[str] = []
    try:
        counter = tokenizer if tokenizer is not None else tokenizer_for(config)
    except RobotLLMError as exc:
        return [str(exc)]
    now = utcnow()
    for name in config.prompts.templates:
        try:
            template = load_template(find_template(config, name))
        except RobotLLMError as exc:
            problems.append(str(exc))
            continue
        sample_news = NewsEntry(
            id=0,
            title="Sample " * template.news.max_chars,
            summary="Sample " * template.news.max_chars,
            feed="preflight",
            published_at=now - timedelta(hours=1),
            fetched_at=now - timedelta(minutes=50),
            mentions=1,
            in_title=True,
        )
        sample_signal = SignalEntry(
            id=0, horizon="1d", direction=1, target=100.0, confidence=0.5, model="preflight", generated_at=now
        )
        for instrument in config.instruments:
            try:
                render_within_budget(template, config, instrument, now, [sample_news], [sample_signal], counter)
            except PromptTooLong as exc:
                problems.append(f"{template.path}: {exc}")
            except RobotLLMError as exc:
                problems.append(f"{exc} (instrument {instrument.ticker})")
    return problems


# --------------------------------------------------------------------------- the plan


@dataclass(frozen=True)
class PlanResult:
    """What planning a night did: requests created, already there, and skipped (ticker, template, reason)."""

    as_of: datetime
    created: int
    existing: int
    skipped: tuple[tuple[str, str, str], ...]
    run_id: int | None = None
    no_news: int = 0  # prompts planned without news (those also without signals abstain)
    no_inputs: int = 0  # prompts with neither news nor signals: explicit abstentions, no generation
    no_news_reasons: tuple[tuple[str, str], ...] = ()  # (template, why) once per template with such prompts


class NightNotPlannable(RobotLLMError):
    """The night is in the future (its inputs are not known yet) or over (its theses would already be stale)."""


def plannable(config: AppConfig, as_of: datetime, now: datetime) -> None:
    """Raise NightNotPlannable unless the night of ``as_of`` can be planned at ``now``.

    A future night would freeze the inputs known now (news fetched until ``as_of`` is not
    in yet) and yield theses available before their own cut-off; a night whose
    ``valid_until`` (``as_of + prompts.valid_for``) has passed would plan requests that no
    worker ever takes (they are never claimed past ``valid_until``).
    """
    local = as_of.astimezone(config.tz).strftime("%Y-%m-%d %H:%M %Z")
    if as_of > now:
        raise NightNotPlannable(
            f"the night {local} has not come yet: its news and signals are not all in; plan it at or after its "
            "cut-off (without --as-of, `batch plan` takes the latest nightly time)"
        )
    valid_until = as_of + config.prompts.valid_for
    if valid_until <= now:
        raise NightNotPlannable(
            f"the night {local} is over: its theses would be valid until "
            f"{valid_until.astimezone(config.tz):%Y-%m-%d %H:%M %Z} (prompts.valid_for), which has passed, so no "
            "worker would ever take its requests"
        )


def plan_night(
    config: AppConfig,
    engine: Engine,
    as_of: datetime,
    *,
    tokenizer: TokenCounter | None = None,
    now: datetime | None = None,
) -> PlanResult:
    """Store one pending GenerationRequest per instrument × template for the night ``as_of``.

    Idempotent: an existing request for (as_of, ticker, template) is counted, not touched.
    An instrument whose prompt cannot fit the window even without news is skipped with a
    reason. Records a Run of kind 'plan'. Refuses (:class:`NightNotPlannable`) a night that
    is in the future or already past its ``valid_until`` at ``now`` (default: the clock).
    """
    as_of = aware_utc(as_of, "as_of")
    plannable(config, as_of, aware_utc(now, "now") if now is not None else utcnow())
    # Requests are claimed in id order: prompts of one template and one example order stored
    # next to each other share a batch, and with it the KV of their common head (the shipped
    # templates rotate three examples, so variant % 3 is their order).
    pairs = sorted(
        ((inst, name) for inst in config.instruments for name in config.prompts.templates),
        key=lambda pair: (config.prompts.templates.index(pair[1]), example_variant(pair[0].ticker, as_of) % 3),
    )
    run_id = start_run(engine, "plan", as_of=as_of, total=len(pairs))

    created = existing = no_news = no_inputs = 0
    skipped: list[tuple[str, str, str]] = []
    reasons: dict[str, str] = {}
    try:
        templates = load_templates(config)
        counter = tokenizer if tokenizer is not None else tokenizer_for(config)
        contexts = {name: _domain_contexts(engine, config, templates[name], as_of) for name in config.prompts.templates}
        for done, (instrument, name) in enumerate(pairs, start=1):
            template = templates[name]
            key = (GenerationRequest.as_of == as_of, GenerationRequest.ticker == instrument.ticker)
            with session_scope(engine) as session:
                present = session.scalar(
                    select(func.count())
                    .select_from(GenerationRequest)
                    .where(*key, GenerationRequest.template_name == name)
                )
                if present:
                    existing += 1
                    result = None
                else:
                    try:
                        result = render_for(session, config, template, instrument, as_of, counter)
                    except PromptTooLong as exc:
                        skipped.append((instrument.ticker, name, str(exc)))
                        result = None
            if result is not None:
                if not result.news_ids:
                    no_news += 1
                    no_inputs += not result.signal_ids and config.prompts.abstain_without_inputs
                    if name not in reasons:
                        with session_scope(engine) as session:
                            reasons[name] = no_news_reason(session, config, template, as_of)
                if _store_request(engine, config, result, contexts[name]):
                    created += 1
                else:
                    existing += 1
            beat_run(engine, run_id, done=done)
    except BaseException as exc:
        finish_run(
            engine,
            run_id,
            "failed" if isinstance(exc, Exception) else "aborted",
            error=f"{type(exc).__name__}: {exc}",
            counts={"created": created, "existing": existing, "skipped": len(skipped)},
        )
        raise
    finish_run(
        engine,
        run_id,
        "ok",
        counts={
            "created": created,
            "existing": existing,
            "skipped": len(skipped),
            "skipped_reasons": [{"ticker": t, "template": n, "reason": r} for t, n, r in skipped],
            "no_news": no_news,
            "no_inputs": no_inputs,
            "no_news_reasons": [{"template": n, "reason": r} for n, r in reasons.items()],
        },
    )
    return PlanResult(
        as_of=as_of,
        created=created,
        existing=existing,
        skipped=tuple(skipped),
        run_id=run_id,
        no_news=no_news,
        no_inputs=no_inputs,
        no_news_reasons=tuple(reasons.items()),
    )


def _store_request(engine: Engine, config: AppConfig, result: RenderResult, contexts: Sequence[str] = ()) -> bool:
    """Insert the request; False when another planner stored the same (as_of, ticker, template) first."""
    template = result.template
    seed = derive_seed(result.generation.seed, result.as_of, result.ticker, template.name)
    now = utcnow()
    try:
        with session_scope(engine) as session:
            session.add(
                GenerationRequest(
                    as_of=result.as_of,
                    ticker=result.ticker,
                    template_name=template.name,
                    template_version=template.version,
                    prompt=result.prompt,
                    prompt_sha256=result.prompt_sha256,
                    prompt_tokens=result.prompt_tokens,
                    news_ids=list(result.news_ids),
                    signal_ids=list(result.signal_ids),
                    params=request_params(result, seed, contexts, abstain=config.prompts.abstain_without_inputs),
                    valid_until=result.as_of + config.prompts.valid_for,
                    status="pending",
                    attempts=0,
                    created_at=now,
                    updated_at=now,
                )
            )
    except IntegrityError:
        return False
    return True
