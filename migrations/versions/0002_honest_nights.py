"""honest nights: a night's requests can be redone (generation_requests.redo)

A redo of a night (``robot-llm batch redo``) queues each chosen request again as a new row
with ``redo`` one higher; its thesis is a new row too, committed when it is made, and the
earlier rows stay in the history. Existing requests are redo 0.

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-01 10:20:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | Sequence[str] | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # Batch mode: SQLite cannot alter a constraint in place, so the table is copied (rows included).
    with op.batch_alter_table("generation_requests", schema=None) as batch_op:
        batch_op.add_column(sa.Column("redo", sa.Integer(), nullable=False, server_default="0"))
        batch_op.drop_constraint("uq_generation_requests_as_of_ticker_template_name", type_="unique")
        batch_op.create_unique_constraint(
            "uq_generation_requests_as_of_ticker_template_name_redo", ["as_of", "ticker", "template_name", "redo"]
        )


def downgrade() -> None:
    # A night redone has several rows per (as_of, ticker, template): only the original (redo 0) can stay.
    op.execute("DELETE FROM theses WHERE request_id IN (SELECT id FROM generation_requests WHERE redo > 0)")
    op.execute("DELETE FROM generation_requests WHERE redo > 0")
    with op.batch_alter_table("generation_requests", schema=None) as batch_op:
        batch_op.drop_constraint("uq_generation_requests_as_of_ticker_template_name_redo", type_="unique")
        batch_op.create_unique_constraint(
            "uq_generation_requests_as_of_ticker_template_name", ["as_of", "ticker", "template_name"]
        )
        batch_op.drop_column("redo")
