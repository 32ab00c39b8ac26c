"""initial schema

Revision ID: 0001
Revises: (none)
Create Date: 2026-11-29 23:22:47.940227
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | Sequence[str] | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "daemon_leases",
        sa.Column("name", sa.String(length=64), nullable=False),
        sa.Column("holder", sa.String(length=255), nullable=False),
        sa.Column("host", sa.String(length=255), nullable=False),
        sa.Column("pid", sa.Integer(), nullable=False),
        sa.Column("acquired_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("heartbeat_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("state", sa.String(length=64), nullable=False),
        sa.Column("released", sa.Boolean(), nullable=False),
        sa.PrimaryKeyConstraint("name", name=op.f("pk_daemon_leases")),
    )
    op.create_table(
        "feed_fetches",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("feed", sa.String(length=200), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("status", sa.String(length=32), nullable=False),
        sa.Column("http_status", sa.Integer(), nullable=True),
        sa.Column("new_count", sa.Integer(), nullable=False),
        sa.Column("duplicate_count", sa.Integer(), nullable=False),
        sa.Column("warning", sa.Text(), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_feed_fetches")),
    )
    with op.batch_alter_table("feed_fetches", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_feed_fetches_feed"), ["feed"], unique=False)

    op.create_table(
        "feed_states",
        sa.Column("feed", sa.String(length=200), nullable=False),
        sa.Column("etag", sa.String(length=500), nullable=True),
        sa.Column("last_modified", sa.String(length=200), nullable=True),
        sa.Column("last_fetch_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("last_status", sa.String(length=32), nullable=True),
        sa.PrimaryKeyConstraint("feed", name=op.f("pk_feed_states")),
    )
    op.create_table(
        "generation_requests",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("as_of", sa.DateTime(timezone=True), nullable=False),
        sa.Column("ticker", sa.String(length=32), nullable=False),
        sa.Column("template_name", sa.String(length=200), nullable=False),
        sa.Column("template_version", sa.String(length=64), nullable=False),
        sa.Column("prompt", sa.Text(), nullable=False),
        sa.Column("prompt_sha256", sa.String(length=64), nullable=False),
        sa.Column("prompt_tokens", sa.Integer(), nullable=False),
        sa.Column("news_ids", sa.JSON(), nullable=False),
        sa.Column("signal_ids", sa.JSON(), nullable=False),
        sa.Column("params", sa.JSON(), nullable=False),
        sa.Column("valid_until", sa.DateTime(timezone=True), nullable=False),
        sa.Column("status", sa.String(length=32), nullable=False),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("lease_owner", sa.String(length=255), nullable=True),
        sa.Column("lease_expires_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("last_error", sa.Text(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_generation_requests")),
        sa.UniqueConstraint(
            "as_of", "ticker", "template_name", name=op.f("uq_generation_requests_as_of_ticker_template_name")
        ),
    )
    with op.batch_alter_table("generation_requests", schema=None) as batch_op:
        batch_op.create_index("ix_generation_requests_status_as_of", ["status", "as_of"], unique=False)

    op.create_table(
        "news_items",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("feed", sa.String(length=200), nullable=False),
        sa.Column("item_key", sa.String(length=500), nullable=False),
        sa.Column("guid", sa.String(length=1000), nullable=True),
        sa.Column("link", sa.String(length=2000), nullable=True),
        sa.Column("title", sa.Text(), nullable=False),
        sa.Column("summary", sa.Text(), nullable=False),
        sa.Column("language", sa.String(length=16), nullable=True),
        sa.Column("published_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("fetched_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("content_hash", sa.String(length=64), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_news_items")),
        sa.UniqueConstraint("content_hash", name=op.f("uq_news_items_content_hash")),
        sa.UniqueConstraint("feed", "item_key", name=op.f("uq_news_items_feed_item_key")),
    )
    with op.batch_alter_table("news_items", schema=None) as batch_op:
        batch_op.create_index("ix_news_items_fetched_at", ["fetched_at"], unique=False)

    op.create_table(
        "runs",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("kind", sa.String(length=64), nullable=False),
        sa.Column("status", sa.String(length=32), nullable=False),
        sa.Column("as_of", sa.DateTime(timezone=True), nullable=True),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("heartbeat_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("done", sa.Integer(), nullable=False),
        sa.Column("total", sa.Integer(), nullable=False),
        sa.Column("tokens_per_s", sa.Float(), nullable=True),
        sa.Column("counts", sa.JSON(), nullable=False),
        sa.Column("host", sa.String(length=255), nullable=True),
        sa.Column("pid", sa.Integer(), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_runs")),
    )
    with op.batch_alter_table("runs", schema=None) as batch_op:
        batch_op.create_index("ix_runs_kind_started_at", ["kind", "started_at"], unique=False)

    op.create_table(
        "signals",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("ticker", sa.String(length=32), nullable=False),
        sa.Column("generated_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("received_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("horizon", sa.String(length=32), nullable=False),
        sa.Column("direction", sa.Integer(), nullable=True),
        sa.Column("target", sa.Float(), nullable=True),
        sa.Column("confidence", sa.Float(), nullable=True),
        sa.Column("model", sa.String(length=200), nullable=False),
        sa.Column("extras", sa.JSON(), nullable=False),
        sa.Column("source", sa.String(length=500), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_signals")),
        sa.UniqueConstraint(
            "ticker", "generated_at", "model", "horizon", name=op.f("uq_signals_ticker_generated_at_model_horizon")
        ),
    )
    with op.batch_alter_table("signals", schema=None) as batch_op:
        batch_op.create_index("ix_signals_ticker_generated_at", ["ticker", "generated_at"], unique=False)

    op.create_table(
        "news_tickers",
        sa.Column("news_id", sa.Integer(), nullable=False),
        sa.Column("ticker", sa.String(length=32), nullable=False),
        sa.ForeignKeyConstraint(
            ["news_id"], ["news_items.id"], name=op.f("fk_news_tickers_news_id_news_items"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("news_id", "ticker", name=op.f("pk_news_tickers")),
    )
    with op.batch_alter_table("news_tickers", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_news_tickers_ticker"), ["ticker"], unique=False)

    op.create_table(
        "theses",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("request_id", sa.Integer(), nullable=False),
        sa.Column("ticker", sa.String(length=32), nullable=False),
        sa.Column("template_name", sa.String(length=200), nullable=False),
        sa.Column("template_version", sa.String(length=64), nullable=False),
        sa.Column("text", sa.Text(), nullable=False),
        sa.Column("stance", sa.Float(), nullable=True),
        sa.Column("stance_label", sa.String(length=64), nullable=True),
        sa.Column("score", sa.Float(), nullable=True),
        sa.Column("label_logprobs", sa.JSON(), nullable=False),
        sa.Column("model_id", sa.String(length=200), nullable=False),
        sa.Column("params", sa.JSON(), nullable=False),
        sa.Column("seed", sa.BigInteger(), nullable=True),
        sa.Column("prompt_sha256", sa.String(length=64), nullable=False),
        sa.Column("prompt_tokens", sa.Integer(), nullable=False),
        sa.Column("completion_tokens", sa.Integer(), nullable=False),
        sa.Column("finish_reason", sa.String(length=16), nullable=False),
        sa.Column("generation_seconds", sa.Float(), nullable=False),
        sa.Column("news_ids", sa.JSON(), nullable=False),
        sa.Column("signal_ids", sa.JSON(), nullable=False),
        sa.Column("as_of", sa.DateTime(timezone=True), nullable=False),
        sa.Column("available_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("valid_until", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["request_id"], ["generation_requests.id"], name=op.f("fk_theses_request_id_generation_requests")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_theses")),
        sa.UniqueConstraint("request_id", name=op.f("uq_theses_request_id")),
    )
    with op.batch_alter_table("theses", schema=None) as batch_op:
        batch_op.create_index("ix_theses_ticker_available_at", ["ticker", "available_at"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("theses", schema=None) as batch_op:
        batch_op.drop_index("ix_theses_ticker_available_at")

    op.drop_table("theses")
    with op.batch_alter_table("news_tickers", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_news_tickers_ticker"))

    op.drop_table("news_tickers")
    with op.batch_alter_table("signals", schema=None) as batch_op:
        batch_op.drop_index("ix_signals_ticker_generated_at")

    op.drop_table("signals")
    with op.batch_alter_table("runs", schema=None) as batch_op:
        batch_op.drop_index("ix_runs_kind_started_at")

    op.drop_table("runs")
    with op.batch_alter_table("news_items", schema=None) as batch_op:
        batch_op.drop_index("ix_news_items_fetched_at")

    op.drop_table("news_items")
    with op.batch_alter_table("generation_requests", schema=None) as batch_op:
        batch_op.drop_index("ix_generation_requests_status_as_of")

    op.drop_table("generation_requests")
    op.drop_table("feed_states")
    with op.batch_alter_table("feed_fetches", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_feed_fetches_feed"))

    op.drop_table("feed_fetches")
    op.drop_table("daemon_leases")
