"""Ingest: news feeds (:mod:`.feeds`) and the robot's signals (:mod:`.signals`) into the database.

Both are idempotent: every row is written with ``INSERT ... ON CONFLICT DO NOTHING`` against
the schema's unique constraints, so a rerun, a crash in the middle or two processes racing
store nothing twice. This package is light to import (no torch, no network at import time).
"""

from __future__ import annotations

from typing import Any

from sqlalchemy.orm import Session

__all__ = ["insert_ignoring_duplicates"]


def insert_ignoring_duplicates(session: Session, model: type[Any]) -> Any:
    """An ``INSERT`` for ``model`` in the session's dialect, with ``ON CONFLICT DO NOTHING`` applied."""
    dialect = session.get_bind().dialect.name
    if dialect == "postgresql":
        from sqlalchemy.dialects.postgresql import insert
    elif dialect == "sqlite":
        from sqlalchemy.dialects.sqlite import insert
    else:
        from robot_llm.errors import RobotLLMError

        raise RobotLLMError(f"unsupported database {dialect!r}: robot-llm supports SQLite and PostgreSQL")
    return insert(model).on_conflict_do_nothing()
