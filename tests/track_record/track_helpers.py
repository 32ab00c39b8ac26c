"""Track-record fixtures: generated closes as CSV files, theses stored the way a night stores them.

Stances come from the product's own scoring (:func:`robot_llm.night.stance.stance_from_logprobs`)
of generated label log-probabilities, so each thesis's true up-probability is known here,
independently of how the ledger recovers it from the stored row.
"""

from __future__ import annotations

import hashlib
import math
import random
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import date, datetime, time, timedelta, timezone
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo

import yaml
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session

from robot_llm.night.stance import stance_from_logprobs
from robot_llm.store.db import GenerationRequest, Thesis, session_scope, utcnow

MSK = ZoneInfo("Europe/Moscow")
DEMO_TICKERS = ("SBER", "GAZP", "LKOH", "YDEX", "AAPL", "NVDA")
# Per template: the stance labels as a night's params store them (the continuation keeps its space).
LABELS = {
    "brief_en": {" up": 1.0, " down": -1.0, " flat": 0.0},
    "brief_ru": {" рост": 1.0, " падение": -1.0, " нейтрально": 0.0},
    "two_way": {" bull": 1.0, " bear": -1.0},
    "five_way": {" a": 1.0, " b": 0.5, " c": 0.0, " d": -0.5, " e": -1.0},
}
UP = {"brief_en": " up", "brief_ru": " рост", "two_way": " bull"}


@dataclass(frozen=True)
class Seeded:
    """A stored thesis and what the test knows about it."""

    id: int
    ticker: str
    template: str
    model: str
    as_of: datetime
    available_at: datetime
    stance: float | None
    p_up: float | None


def write_prices(folder: Path, rng: random.Random, tickers: tuple[str, ...], first: date, days: int) -> None:
    """One ``TICKER.csv`` per ticker: weekday closes, some dated, some ISO with an offset, some unchanged."""
    folder.mkdir(parents=True, exist_ok=True)
    for k, ticker in enumerate(tickers):
        price = 100.0 + 10 * k
        lines = ["time,open,close,volume"]
        for d in range(days):
            day = first + timedelta(days=d)
            if day.weekday() >= 5:
                continue
            if rng.random() > 0.15:  # some days the close does not move: zero returns happen
                price = round(price * math.exp(rng.gauss(0, 0.02)), 2)
            if ticker in ("AAPL", "NVDA"):
                # New York's 16:00 close, written with its own offset.
                stamp = datetime.combine(day, time(16, 0), tzinfo=ZoneInfo("America/New_York")).isoformat()
            elif k % 2:
                stamp = day.isoformat()  # that day's close at prices.market_close, Moscow time
            else:
                stamp = datetime.combine(day, time(15, 50), tzinfo=timezone.utc).isoformat().replace("+00:00", "Z")
            lines.append(f"{stamp},{price},{price},{rng.randint(1, 9) * 1000}")
        (folder / f"{ticker}.csv").write_text("\n".join(lines) + "\n", encoding="utf-8")


def config_file(
    folder: Path,
    db_url: str,
    prices: dict[str, Any],
    tickers: tuple[str, ...] = DEMO_TICKERS,
    name: str = "robot-llm.yaml",
) -> Path:
    """A config on ``db_url`` with the demo's instruments and the given ``prices:`` section."""
    data = {
        "database": {"url": db_url},
        "timezone": "Europe/Moscow",
        "instruments": [{"ticker": t, "name": f"{t} name"} for t in tickers],
        "model": {"store": "store", "vocab": "voc.sp"},
        "prices": prices,
    }
    path = folder / name
    path.write_text(yaml.safe_dump(data, allow_unicode=True), encoding="utf-8")
    return path


@contextmanager
def _session(target: Engine | Session) -> Iterator[Session]:
    if isinstance(target, Session):
        yield target
    else:
        with session_scope(target) as session:
            yield session


def seed(
    target: Engine | Session,
    *,
    ticker: str,
    as_of: datetime,
    available_at: datetime,
    template: str,
    model: str,
    logprobs: list[float] | None,
) -> Seeded:
    """Store a request and its thesis (its own transaction, or ``target``'s session); the stance from ``logprobs``."""
    labels = LABELS[template]
    if logprobs is None:
        stance = label = score = None
        p_up = None
    else:
        result = stance_from_logprobs(list(labels.items()), logprobs)
        stance, label, score = result.stance, result.label, result.score
        top = max(logprobs)
        weights = [math.exp(lp - top) for lp in logprobs]
        probs = dict(zip(labels, (w / sum(weights) for w in weights), strict=True))
        p_up = probs[UP[template]] if template in UP else None
    params = {"seed": 1, "stance": {"cue": "\nOutlook:", "labels": labels, "method": "sum"}}
    prompt = f"{ticker} {as_of.isoformat()} {template} {model}"
    sha = hashlib.sha256(prompt.encode()).hexdigest()
    now = utcnow()
    with _session(target) as s:
        req = GenerationRequest(
            as_of=as_of,
            ticker=ticker,
            template_name=template,
            template_version="1",
            prompt=prompt,
            prompt_sha256=sha,
            prompt_tokens=10,
            news_ids=[],
            signal_ids=[],
            params=params,
            valid_until=as_of + timedelta(days=1),
            status="done",
            attempts=1,
            created_at=now,
            updated_at=now,
        )
        s.add(req)
        s.flush()
        thesis = Thesis(
            request_id=req.id,
            ticker=ticker,
            template_name=template,
            template_version="1",
            text=f"{ticker} thesis",
            stance=stance,
            stance_label=label,
            score=score,
            label_logprobs={},
            model_id=model,
            params=params,
            seed=1,
            prompt_sha256=sha,
            prompt_tokens=10,
            completion_tokens=2,
            finish_reason="stop",
            generation_seconds=0.1,
            news_ids=[],
            signal_ids=[],
            as_of=as_of,
            available_at=available_at,
            valid_until=as_of + timedelta(days=1),
        )
        s.add(thesis)
        s.flush()
        return Seeded(thesis.id, ticker, template, model, as_of, available_at, stance, p_up)


def seed_nights(
    engine: Engine,
    rng: random.Random,
    *,
    first: date,
    nights: int,
    templates: tuple[str, ...] = ("brief_en",),
    model: str = "gemma-3-270m",
    tickers: tuple[str, ...] = DEMO_TICKERS,
) -> list[Seeded]:
    """Several nights of theses: cut at 23:00 Moscow, available minutes to hours later (some the next day).

    Log-probabilities come from a few patterns, so stances tie; some are exactly 0 (up and
    down equally likely); one in twelve theses abstains.
    """
    patterns = [[rng.uniform(-4, 0) for _ in range(5)] for _ in range(6)]
    out = []
    with session_scope(engine) as session:  # one transaction: a night stores hundreds at once too
        for night in range(nights):
            out.extend(_night(session, rng, patterns, first + timedelta(days=night), templates, model, tickers))
    return out


def _night(
    session: Session,
    rng: random.Random,
    patterns: list[list[float]],
    day: date,
    templates: tuple[str, ...],
    model: str,
    tickers: tuple[str, ...],
) -> list[Seeded]:
    as_of = datetime.combine(day, time(23, 0), tzinfo=MSK).astimezone(timezone.utc)
    out = []
    for ticker in tickers:
        for template in templates:
            size = len(LABELS[template])
            roll = rng.random()
            if roll < 1 / 12:
                logprobs = None
            elif roll < 0.2:
                logprobs = [-1.0, -1.0, -2.0][:size] if size <= 3 else [-1.0] * size
            elif roll < 0.5:
                logprobs = rng.choice(patterns)[:size]
            else:
                logprobs = [rng.uniform(-5, 0) for _ in range(size)]
            available = as_of + timedelta(minutes=rng.choice([5, 90, 400, 1180, 1250]))
            out.append(
                seed(
                    session,
                    ticker=ticker,
                    as_of=as_of,
                    available_at=available,
                    template=template,
                    model=model,
                    logprobs=logprobs,
                )
            )
    return out
