"""Alembic migrations on real SQLite and PostgreSQL: up, down, up again, and no drift."""

from __future__ import annotations

import pytest
from sqlalchemy import inspect, text
from sqlalchemy.exc import IntegrityError

from robot_llm.store import migrate
from robot_llm.store.db import Base, make_engine


def _tables(url: str) -> set[str]:
    engine = make_engine(url)
    try:
        return set(inspect(engine).get_table_names())
    finally:
        engine.dispose()


def test_upgrade_downgrade_upgrade(empty_db_url: str) -> None:
    ours = set(Base.metadata.tables)
    assert migrate.current(empty_db_url) is None

    migrate.upgrade(empty_db_url)
    assert migrate.current(empty_db_url) == migrate.head()
    assert _tables(empty_db_url) == ours | {"alembic_version"}

    migrate.downgrade(empty_db_url, "base")
    assert migrate.current(empty_db_url) is None
    assert _tables(empty_db_url) <= {"alembic_version"}

    migrate.upgrade(empty_db_url)
    assert migrate.current(empty_db_url) == migrate.head()
    assert _tables(empty_db_url) == ours | {"alembic_version"}


def test_models_and_migrations_agree(db_url: str) -> None:
    assert migrate.schema_diff(db_url) == []


def test_diff_detects_drift(db_url: str) -> None:
    # The agreement test above is only meaningful if a real difference shows up.
    engine = make_engine(db_url)
    try:
        with engine.begin() as conn:
            conn.execute(text("CREATE TABLE extra_probe (id INTEGER PRIMARY KEY)"))
            conn.execute(text("DROP INDEX ix_news_items_fetched_at"))
        diff = migrate.schema_diff(engine)
    finally:
        engine.dispose()
    kinds = [d[0] for d in diff if isinstance(d, tuple)]
    assert kinds == ["add_index"], diff  # the foreign table is ignored, the missing index is not


def test_ensure_current_refuses_old_schema(empty_db_url: str) -> None:
    engine = make_engine(empty_db_url)
    try:
        with pytest.raises(migrate.SchemaOutOfDateError) as err:
            migrate.ensure_current(engine, "config/robot-llm.yaml")
        msg = str(err.value)
        assert "never migrated" in msg
        assert f"head is {migrate.head()}" in msg
        assert "robot-llm db upgrade -c config/robot-llm.yaml" in msg
        migrate.upgrade(engine)
        migrate.ensure_current(engine)
    finally:
        engine.dispose()


@pytest.mark.postgres
@pytest.mark.parametrize("empty_db_url", ["postgresql"], indirect=True)
def test_postgres_schema_isolation(empty_db_url: str) -> None:
    """With ``search_path`` in the URL, the version table and every table land in that schema."""
    schema = empty_db_url.rsplit("%3D", 1)[1]
    migrate.upgrade(empty_db_url)
    engine = make_engine(empty_db_url)
    try:
        with engine.connect() as conn:
            rows = conn.execute(
                text("SELECT table_schema, table_name FROM information_schema.tables WHERE table_name = ANY(:names)"),
                {"names": [*Base.metadata.tables, "alembic_version"]},
            ).all()
    finally:
        engine.dispose()
    placed = {name: s for s, name in rows if s == schema}
    assert set(placed) == {*Base.metadata.tables, "alembic_version"}
    assert all(s == schema or s.startswith("t_") for s, _ in rows), rows


def test_migration_errors_are_one_line(empty_db_url: str) -> None:
    with pytest.raises(migrate.MigrationError, match="cannot downgrade to 'nope'"):
        migrate.downgrade(empty_db_url, "nope")
    # A table of ours created behind Alembic's back: the upgrade refuses, and says why in one line.
    engine = make_engine(empty_db_url)
    try:
        with engine.begin() as conn:
            conn.execute(text("CREATE TABLE runs (id INTEGER PRIMARY KEY)"))
        with pytest.raises(migrate.MigrationError) as err:
            migrate.upgrade(engine)
    finally:
        engine.dispose()
    msg = str(err.value)
    assert msg.startswith("upgrade to 'head' failed: ")
    assert "runs" in msg and "\n" not in msg
    # The failed step rolled back whole (on SQLite too): no half-created schema is left behind.
    assert _tables(empty_db_url) == {"runs"}
    assert migrate.current(empty_db_url) is None


def test_prices_revision_up_and_down(empty_db_url: str) -> None:
    """0003 (prices) adds the prices table on top of 0002 and takes it away again, nothing else."""
    migrate.upgrade(empty_db_url, "0002")
    before = _tables(empty_db_url)
    assert "prices" not in before
    migrate.upgrade(empty_db_url, "0003")
    assert _tables(empty_db_url) == before | {"prices"}
    engine = make_engine(empty_db_url)
    try:
        with engine.begin() as conn:
            insert = "INSERT INTO prices (ticker, time, close, source, ingested_at) VALUES ('SBER', :t, 1.0, 'x', :t)"
            conn.execute(text(insert), {"t": "2026-12-01 15:50:00"})
            with pytest.raises(IntegrityError, match=r"(?i)unique"), conn.begin_nested():
                conn.execute(text(insert), {"t": "2026-12-01 15:50:00"})
    finally:
        engine.dispose()
    migrate.downgrade(empty_db_url, "0002")
    assert _tables(empty_db_url) == before


def test_0004_stance_keeps_stored_theses_and_gives_them_defaults(empty_db_url: str) -> None:
    """Theses stored before revision 0004 (stance) become kind 'thesis' with no flags; down again keeps them."""
    migrate.upgrade(empty_db_url, "0001")
    engine = make_engine(empty_db_url)
    try:
        with engine.begin() as conn:
            conn.execute(
                text(
                    "INSERT INTO generation_requests (id, as_of, ticker, template_name, template_version, prompt, "
                    "prompt_sha256, prompt_tokens, news_ids, signal_ids, params, valid_until, status, attempts, "
                    "created_at, updated_at) VALUES (1, :t, 'SBER', 'thesis_ru', '2', 'p', 'h', 3, '[]', '[]', '{}', "
                    ":t, 'done', 1, :t, :t)"
                ),
                {"t": "2026-11-26 20:00:00+00:00"},
            )
            conn.execute(
                text(
                    "INSERT INTO theses (id, request_id, ticker, template_name, template_version, text, stance, "
                    "label_logprobs, model_id, params, prompt_sha256, prompt_tokens, completion_tokens, finish_reason, "
                    "generation_seconds, news_ids, signal_ids, as_of, available_at, valid_until) VALUES (1, 1, 'SBER', "
                    "'thesis_ru', '2', 'рост', 0.5, '{}', 'm', '{}', 'h', 3, 2, 'stop', 1.0, '[]', '[]', :t, :t, :t)"
                ),
                {"t": "2026-11-26 20:00:00+00:00"},
            )
        migrate.upgrade(empty_db_url)
        with engine.connect() as conn:
            row = conn.execute(
                text("SELECT kind, flags, stance_probs, text_stance, news_stance, stance FROM theses")
            ).one()
        assert row.kind == "thesis" and row.text_stance is None and row.news_stance is None and row.stance == 0.5
        assert row.flags in ("[]", []) and row.stance_probs in ("{}", {})
        migrate.downgrade(empty_db_url, "0001")
        with engine.connect() as conn:
            assert conn.execute(text("SELECT count(*) FROM theses")).scalar_one() == 1
    finally:
        engine.dispose()


def test_0005_stance_source_leaves_stored_theses_without_a_source(empty_db_url: str) -> None:
    """Revision 0005 adds ``stance_source`` (None for rows stored before it); down again drops only the column."""
    migrate.upgrade(empty_db_url, "0004")
    engine = make_engine(empty_db_url)
    try:
        with engine.connect() as conn:
            assert "stance_source" not in {c["name"] for c in inspect(conn).get_columns("theses")}
        migrate.upgrade(empty_db_url)
        with engine.connect() as conn:
            columns = {c["name"]: c for c in inspect(conn).get_columns("theses")}
        assert columns["stance_source"]["nullable"] is True
        migrate.downgrade(empty_db_url, "0004")
        with engine.connect() as conn:
            assert "stance_source" not in {c["name"] for c in inspect(conn).get_columns("theses")}
    finally:
        engine.dispose()
