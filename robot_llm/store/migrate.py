"""Schema migrations: Alembic, driven from code (no ``alembic.ini`` for users to find).

``robot-llm db upgrade`` brings a database to the schema this version of robot-llm needs;
``ensure_current`` lets a job refuse to run against an out-of-date schema with a message
that says which command fixes it.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sqlalchemy import Connection
from sqlalchemy.engine import Engine

from robot_llm.store.db import DatabaseError, check_connection, error_line, make_engine

if TYPE_CHECKING:
    from alembic.config import Config

# Alembic is imported inside the functions that use it: every `robot-llm` command builds the
# parser (and so imports this module, through robot_llm.commands.migrate), and most of them never
# migrate anything.

__all__ = [
    "MigrationError",
    "SchemaOutOfDateError",
    "current",
    "downgrade",
    "ensure_current",
    "head",
    "include_object",
    "schema_diff",
    "script_location",
    "upgrade",
]


class SchemaOutOfDateError(DatabaseError):
    """The database's schema revision is not the one this robot-llm needs."""


class MigrationError(DatabaseError):
    """A migration could not be applied (unknown revision, or the database refused a step)."""


@contextmanager
def _explained(action: str, revision: str) -> Iterator[None]:
    """Turn Alembic's and the driver's exceptions into one line the user can act on."""
    from alembic.util import CommandError
    from sqlalchemy.exc import DBAPIError

    try:
        yield
    except CommandError as exc:
        raise MigrationError(f"cannot {action} to {revision!r}: {exc}") from exc
    except DBAPIError as exc:
        raise MigrationError(f"{action} to {revision!r} failed: {error_line(exc)}") from exc


def script_location() -> Path:
    """The folder holding ``env.py`` and ``versions/``.

    Installed, it is the ``robot_llm.migrations`` package; in a source checkout that is not
    installed, it is the repository's top-level ``migrations/``.
    """
    spec = importlib.util.find_spec("robot_llm.migrations")
    if spec is not None and spec.submodule_search_locations:
        return Path(next(iter(spec.submodule_search_locations)))
    return Path(__file__).resolve().parents[2] / "migrations"


def _alembic_config(connection: Connection | None = None) -> Config:
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(script_location()))
    # Alembic would otherwise reconfigure logging from an ini file it does not have.
    cfg.attributes["configure_logger"] = False
    if connection is not None:
        cfg.attributes["connection"] = connection
    return cfg


@contextmanager
def _connection(url_or_engine: str | Engine, *, transaction: bool = False) -> Iterator[Connection]:
    """A checked connection; SQLite foreign keys are off for the duration.

    Batch migrations on SQLite copy and drop tables, which enforced foreign keys would
    block or cascade; Alembic's documentation recommends turning them off meanwhile.
    """
    engine = make_engine(url_or_engine) if isinstance(url_or_engine, str) else url_or_engine
    try:
        check_connection(engine)
        with engine.connect() as conn:
            sqlite = conn.dialect.name == "sqlite"
            if sqlite:
                conn.exec_driver_sql("PRAGMA foreign_keys=OFF")
                conn.commit()
                if transaction:
                    # pysqlite runs DDL outside any transaction; with an explicit BEGIN a failed
                    # migration rolls back whole, as it does on PostgreSQL.
                    conn.exec_driver_sql("BEGIN")
            try:
                yield conn
            finally:
                if sqlite:
                    conn.rollback()
                    conn.exec_driver_sql("PRAGMA foreign_keys=ON")
                    conn.commit()
    finally:
        if isinstance(url_or_engine, str):
            engine.dispose()


def upgrade(url_or_engine: str | Engine, revision: str = "head") -> None:
    """Migrate the database up to ``revision`` (default: the newest)."""
    from alembic import command

    with _connection(url_or_engine, transaction=True) as conn, _explained("upgrade", revision):
        command.upgrade(_alembic_config(conn), revision)
        conn.commit()


def downgrade(url_or_engine: str | Engine, revision: str) -> None:
    """Migrate the database down to ``revision`` (``base`` removes every robot-llm table)."""
    from alembic import command

    with _connection(url_or_engine, transaction=True) as conn, _explained("downgrade", revision):
        command.downgrade(_alembic_config(conn), revision)
        conn.commit()


def current(url_or_engine: str | Engine) -> str | None:
    """The database's revision, or None when it has never been migrated."""
    from alembic.runtime.migration import MigrationContext

    with _connection(url_or_engine) as conn:
        return MigrationContext.configure(conn).get_current_revision()


def head() -> str:
    """The newest revision this robot-llm ships."""
    from alembic.script import ScriptDirectory

    heads = ScriptDirectory.from_config(_alembic_config()).get_heads()
    if len(heads) != 1:
        raise RuntimeError(f"the migrations must have exactly one head, found {heads}")
    return heads[0]


def ensure_current(engine: Engine, config_file: str | None = None) -> None:
    """Raise SchemaOutOfDateError unless the database is at the head revision."""
    at, want = current(engine), head()
    if at != want:
        where = engine.url.render_as_string(hide_password=True)
        raise SchemaOutOfDateError(
            f"database at {where} is at revision {at or 'none (never migrated)'}, head is {want}: "
            f"run `robot-llm db upgrade -c {config_file or 'FILE'}`"
        )


def include_object(obj: Any, name: str | None, type_: str, reflected: bool, compare_to: Any) -> bool:
    """Alembic filter: tables that are not ours (e.g. an APScheduler job store sharing the
    database) never show up as "drop this table" in a diff or an autogenerated revision."""
    from robot_llm.store.db import Base

    return not (type_ == "table" and reflected and name not in Base.metadata.tables)


def schema_diff(url_or_engine: str | Engine) -> list[Any]:
    """Differences between the ORM models and the database (empty when they agree)."""
    from alembic.autogenerate import compare_metadata
    from alembic.runtime.migration import MigrationContext

    from robot_llm.store.db import Base

    with _connection(url_or_engine) as conn:
        ctx = MigrationContext.configure(conn, opts={"compare_type": True, "include_object": include_object})
        return list(compare_metadata(ctx, Base.metadata))
