"""Helpers for the prompting and plan tests: config data, seeded news and signal rows."""

from __future__ import annotations

import hashlib
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from sqlalchemy.orm import Session

from robot_llm.store.db import NewsItem, NewsTicker, Signal

REPO = Path(__file__).resolve().parent.parent.parent
TINY = REPO / "tests" / "fixtures" / "yalm-tiny"
VOCAB = TINY / "vocab" / "voc_tiny.sp"

# Wednesday 25 Nov 2026, 23:00 in Moscow (UTC+3, no DST): a night of the default cron.
AS_OF = datetime(2026, 11, 25, 20, 0, tzinfo=timezone.utc)


def base_settings(tmp_path: Path) -> dict[str, Any]:
    """A complete config as plain data; tests change what they need and write it with make_config."""
    prompts_dir = tmp_path / "prompts"
    prompts_dir.mkdir(exist_ok=True)
    return {
        "database": {"url": f"sqlite:///{tmp_path / 'robot-llm.sqlite'}"},
        "timezone": "Europe/Moscow",
        "instruments": [
            {"ticker": "SBER", "name": "Сбербанк", "aliases": ["Сбер"], "exchange": "MOEX"},
            {"ticker": "GAZP", "name": "Газпром", "exchange": "MOEX"},
        ],
        "prompts": {"dir": str(prompts_dir), "templates": ["thesis_ru", "thesis_en"], "max_news": 20},
        "model": {"backend": "memory", "checkpoint": str(TINY), "vocab": str(VOCAB), "max_positions": 1024},
        "schedule": {"nightly": "0 23 * * 0-4"},
    }


def add_news(
    session: Session,
    *,
    title: str,
    tickers: tuple[str, ...],
    fetched_at: datetime,
    published_at: datetime | None = None,
    summary: str = "",
    feed: str = "wire",
) -> int:
    """Insert one news item tagged with ``tickers``; returns its id."""

    digest = hashlib.sha256(f"{feed}|{title}|{summary}|{fetched_at.isoformat()}".encode()).hexdigest()
    item = NewsItem(
        feed=feed,
        item_key=digest,
        title=title,
        summary=summary,
        published_at=published_at,
        fetched_at=fetched_at,
        content_hash=digest,
        tickers=[NewsTicker(ticker=t) for t in tickers],
    )
    session.add(item)
    session.flush()
    return item.id


def add_signal(
    session: Session,
    *,
    ticker: str,
    generated_at: datetime,
    received_at: datetime,
    direction: int | None = 1,
    model: str = "lgbm",
    horizon: str = "1d",
    target: float | None = 270.5,
    confidence: float | None = 0.7,
) -> int:
    """Insert one robot forecast; returns its id."""
    row = Signal(
        ticker=ticker,
        generated_at=generated_at,
        received_at=received_at,
        horizon=horizon,
        direction=direction,
        target=target,
        confidence=confidence,
        model=model,
        extras={},
        source="test",
    )
    session.add(row)
    session.flush()
    return row.id
