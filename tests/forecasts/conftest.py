"""Helpers for the read-API tests: seed theses and signals the way the nightly batch stores them.

The batch writes a ``GenerationRequest`` and, once generated, its ``Thesis`` (which has a
foreign key to the request). These helpers do the same through the ORM, one committed
transaction per thesis, so the tests read exactly what a real night leaves behind.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.machinery
import importlib.util
import itertools
import sys
from datetime import datetime, timedelta
from pathlib import Path
from types import ModuleType

import pytest
from sqlalchemy import delete
from sqlalchemy.engine import Engine

from robot_llm.store.db import GenerationRequest, Signal, Thesis, session_scope, utcnow

REPO = Path(__file__).resolve().parents[2]

_template_counter = itertools.count()


def seed_thesis(
    engine: Engine,
    *,
    ticker: str,
    as_of: datetime,
    available_at: datetime,
    valid_until: datetime | None = None,
    stance: float | None = 0.5,
    score: float | None = 0.8,
    stance_label: str | None = None,
    text: str | None = None,
    template_name: str = "thesis_ru",
    template_version: str = "1",
    model_id: str = "yalm-test",
    news_ids: tuple[int, ...] = (),
    signal_ids: tuple[int, ...] = (),
) -> int:
    """Store a request and its thesis in one transaction; return the thesis id."""
    valid_until = valid_until if valid_until is not None else available_at + timedelta(days=1)
    label = stance_label if stance_label is not None else ("up" if (stance or 0) > 0 else "down")
    body = text if text is not None else f"{ticker} thesis as of {as_of.isoformat()}"
    prompt = f"prompt for {ticker} {as_of.isoformat()} {template_name}"
    sha = hashlib.sha256(prompt.encode()).hexdigest()
    now = utcnow()
    with session_scope(engine) as session:
        request = GenerationRequest(
            as_of=as_of,
            ticker=ticker,
            template_name=template_name,
            template_version=template_version,
            prompt=prompt,
            prompt_sha256=sha,
            prompt_tokens=10,
            news_ids=list(news_ids),
            signal_ids=list(signal_ids),
            params={},
            valid_until=valid_until,
            status="done",
            attempts=1,
            created_at=now,
            updated_at=now,
        )
        session.add(request)
        session.flush()
        thesis = Thesis(
            request_id=request.id,
            ticker=ticker,
            template_name=template_name,
            template_version=template_version,
            text=body,
            stance=stance,
            stance_label=label,
            score=score,
            label_logprobs={},
            model_id=model_id,
            params={},
            seed=1,
            prompt_sha256=sha,
            prompt_tokens=10,
            completion_tokens=len(body.split()),
            finish_reason="stop",
            generation_seconds=0.1,
            news_ids=list(news_ids),
            signal_ids=list(signal_ids),
            as_of=as_of,
            available_at=available_at,
            valid_until=valid_until,
        )
        session.add(thesis)
        session.flush()
        return thesis.id


def unique_template() -> str:
    """A template name not used before in this process (requests are unique per as_of/ticker/template)."""
    return f"t{next(_template_counter)}"


def seed_signal(
    engine: Engine,
    *,
    ticker: str,
    generated_at: datetime,
    received_at: datetime | None = None,
    direction: int | None = 1,
    confidence: float | None = 0.8,
    horizon: str = "1d",
    model: str = "robot-test",
) -> int:
    """Store one robot forecast; return its id."""
    with session_scope(engine) as session:
        signal = Signal(
            ticker=ticker,
            generated_at=generated_at,
            received_at=received_at if received_at is not None else generated_at,
            horizon=horizon,
            direction=direction,
            target=None,
            confidence=confidence,
            model=model,
            extras={},
            source="test",
        )
        session.add(signal)
        session.flush()
        return signal.id


def clear(engine: Engine) -> None:
    """Delete every thesis, request and signal (between hypothesis examples)."""
    with session_scope(engine) as session:
        session.execute(delete(Thesis))
        session.execute(delete(GenerationRequest))
        session.execute(delete(Signal))


def write_config(folder: Path, db_url: str, tickers: tuple[str, ...] = ("SBER", "GAZP")) -> Path:
    """A minimal robot-llm config pointing at ``db_url``, in Moscow time (the model paths need not exist to read)."""
    instruments = "\n".join(f"  - {{ticker: '{t}', name: '{t} name'}}" for t in tickers)
    path = folder / "robot-llm.yaml"
    path.write_text(
        f"database:\n  url: '{db_url}'\n"
        f"timezone: 'Europe/Moscow'\n"
        f"instruments:\n{instruments}\n"
        f"model:\n  store: store\n  vocab: voc.sp\n"
        f"schedule:\n  cutoff: '09:30'\n",
        encoding="utf-8",
    )
    return path


def _is_ours(spec: importlib.machinery.ModuleSpec | None) -> bool:
    return spec is not None and spec.origin is not None and Path(spec.origin).is_relative_to(REPO)


def load_strategy(name: str) -> ModuleType:
    """Import ``robot_llm.strategies.<name>``.

    Installed, ``robot_llm.strategies`` is the repository's ``strategies/`` folder (a
    package-dir mapping); in this uninstalled checkout we register that folder under the
    same name, so the tests exercise the files a user gets, under the name a user imports.
    """
    package = "robot_llm.strategies"
    # An editable install of another checkout (a worktree next to this one) would map the
    # name to that checkout's folder: only this checkout's own files count.
    if package not in sys.modules and not _is_ours(importlib.util.find_spec(package)):
        spec = importlib.util.spec_from_file_location(
            package, REPO / "strategies" / "__init__.py", submodule_search_locations=[str(REPO / "strategies")]
        )
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[package] = module
        spec.loader.exec_module(module)
    return importlib.import_module(f"{package}.{name}")


@pytest.fixture(scope="session")
def stance_gate() -> ModuleType:
    """The plain-Python example strategy."""
    return load_strategy("stance_gate")


@pytest.fixture(scope="session")
def freqtrade_adapter() -> ModuleType:
    """The freqtrade-style adapter."""
    return load_strategy("freqtrade_adapter")
