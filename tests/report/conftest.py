"""A month of nights for the HTML report tests: theses, robot forecasts, news and runs."""

from __future__ import annotations

from datetime import date, datetime, timedelta, timezone
from pathlib import Path

import pytest
from sqlalchemy.engine import Engine

from robot_llm.store.db import NewsItem, Run, session_scope
from tests.forecasts.conftest import seed_signal, seed_thesis, write_config

UTC = timezone.utc
DAY = date(2026, 11, 27)  # a Friday; the nights run back from it
NIGHTS = 30


def _night_as_of(day: date) -> datetime:
    return datetime(day.year, day.month, day.day, 20, 0, tzinfo=UTC)  # 23:00 in Moscow


def seed_month(engine: Engine) -> dict[str, list[tuple[date, float, int]]]:
    """30 nights for SBER and GAZP: a stance and a robot forecast direction each night, a run each night.

    Returns what was stored, per ticker: (night, stance, direction).
    """
    stored: dict[str, list[tuple[date, float, int]]] = {"SBER": [], "GAZP": []}
    for i in range(NIGHTS):
        day = DAY - timedelta(days=NIGHTS - 1 - i)
        as_of = _night_as_of(day)
        for ticker, sign in (("SBER", 1), ("GAZP", -1)):
            stance = sign * round(((i % 7) - 3) / 3.5, 3)
            direction = 1 if i % 3 else -1
            signal = seed_signal(engine, ticker=ticker, generated_at=as_of - timedelta(hours=2), direction=direction)
            news_ids: tuple[int, ...] = ()
            if day == DAY:
                with session_scope(engine) as s:
                    items = [
                        NewsItem(
                            feed="ru-news",
                            item_key=f"{ticker}-{k}",
                            link=link,
                            title=f"{ticker} headline {k} <b>",
                            published_at=as_of - timedelta(hours=k + 1),
                            fetched_at=as_of - timedelta(hours=k),
                            content_hash=f"{ticker}{k}",
                        )
                        for k, link in enumerate((f"https://news.example/{ticker}", "javascript:alert(1)"))
                    ]
                    s.add_all(items)
                    s.flush()
                    news_ids = tuple(n.id for n in items)
            seed_thesis(
                engine,
                ticker=ticker,
                as_of=as_of,
                available_at=as_of + timedelta(hours=3),
                stance=stance,
                score=0.7,
                stance_label=" рост" if stance > 0 else "падение",
                text=f"{ticker} night {day}: first line\nsecond line",
                news_ids=news_ids,
                signal_ids=(signal,),
            )
            stored[ticker].append((day, stance, direction))
        with session_scope(engine) as s:
            s.add(
                Run(
                    kind="generate",
                    status="ok",
                    as_of=as_of,
                    started_at=as_of + timedelta(minutes=1),
                    finished_at=as_of + timedelta(minutes=1, seconds=60 + i),
                    done=2,
                    total=2,
                    tokens_per_s=10.0 + i,
                    counts={"new_tokens": 100 + i, "batch_seconds": 10.0},
                )
            )
    return stored


@pytest.fixture
def month(engine: Engine, db_url: str, tmp_path: Path) -> tuple[Path, dict[str, list[tuple[date, float, int]]]]:
    """A config (Moscow time, reports in tmp_path/reports) over a database holding 30 nights."""
    config = write_config(tmp_path, db_url, tickers=("SBER", "GAZP", "LKOH"))
    config.write_text(config.read_text(encoding="utf-8") + "report:\n  html_dir: reports\n", encoding="utf-8")
    return config, seed_month(engine)
