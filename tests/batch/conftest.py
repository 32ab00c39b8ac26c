"""Fixtures of the batch tests (helpers live in ``batch_helpers``)."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import datetime, timedelta
from pathlib import Path

import pytest
from batch_helpers import TINY_TEMPLATE, BatchEnv
from sqlalchemy.engine import Engine

from robot_llm.store.db import utcnow


@pytest.fixture
def night() -> datetime:
    """A night's cut-off an hour ago, so its requests are valid for the next day."""
    return (utcnow() - timedelta(hours=1)).replace(microsecond=0)


@pytest.fixture
def benv(tmp_path: Path, db_url: str, engine: Engine) -> Iterator[BatchEnv]:
    """A BatchEnv on a migrated database (SQLite and PostgreSQL) with the tiny template written."""
    (tmp_path / "prompts").mkdir()
    (tmp_path / "prompts" / "tiny.j2").write_text(TINY_TEMPLATE, encoding="utf-8")
    kind = "sqlite" if db_url.startswith("sqlite") else "postgresql"
    yield BatchEnv(tmp=tmp_path, db_url=db_url, engine=engine, kind=kind)


@pytest.fixture(autouse=True)
def _one_torch_thread() -> Iterator[None]:
    """The tiny model in one thread: on a loaded 2-core machine OpenMP threads thrash (10-50x slower)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
