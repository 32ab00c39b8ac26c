"""Alembic environment for robot-llm.

There is no ``alembic.ini``: ``robot_llm.store.migrate`` builds the Alembic ``Config`` in code and
hands over an open connection in ``config.attributes["connection"]``, so the same engine
defaults (SQLite pragmas, psycopg 3, a PostgreSQL ``search_path`` in the URL) apply to
migrations as to the application. Online mode only: an offline SQL script would bypass the
per-backend handling below.
"""

from __future__ import annotations

from typing import Any

from alembic import context

from robot_llm.store.db import Base, UTCDateTime
from robot_llm.store.migrate import include_object

config = context.config
target_metadata = Base.metadata


def _render_item(type_: str, obj: Any, autogen_context: Any) -> str | bool:
    # Revisions must not depend on application code that may change later: UTCDateTime is
    # stored as a plain timezone-aware DATETIME, so render it as that.
    if type_ == "type" and isinstance(obj, UTCDateTime):
        return "sa.DateTime(timezone=True)"
    return False


def run_migrations_online() -> None:
    connection = config.attributes.get("connection")
    if connection is None:
        raise RuntimeError("run migrations through robot_llm.store.migrate (robot-llm db upgrade), not the alembic CLI")
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        # SQLite can barely ALTER: batch mode recreates the table ("move and copy").
        render_as_batch=True,
        compare_type=True,
        include_object=include_object,
        render_item=_render_item,
    )
    with context.begin_transaction():
        context.run_migrations()


if context.is_offline_mode():
    raise RuntimeError("offline (SQL script) migrations are not supported; run `robot-llm db upgrade`")
run_migrations_online()
