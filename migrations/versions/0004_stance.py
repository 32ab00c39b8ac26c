"""stance quality: a thesis's kind, its flags, per-label probabilities, the thesis and news stances

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-01 10:20:00

Existing rows become kind 'thesis' with no flags, no probabilities and no second stance.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | Sequence[str] | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("theses", schema=None) as batch_op:
        batch_op.add_column(sa.Column("kind", sa.String(length=16), server_default="thesis", nullable=False))
        batch_op.add_column(sa.Column("flags", sa.JSON(), server_default="[]", nullable=False))
        batch_op.add_column(sa.Column("stance_probs", sa.JSON(), server_default="{}", nullable=False))
        batch_op.add_column(sa.Column("text_stance", sa.Float(), nullable=True))
        batch_op.add_column(sa.Column("news_stance", sa.Float(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("theses", schema=None) as batch_op:
        for column in ("news_stance", "text_stance", "stance_probs", "flags", "kind"):
            batch_op.drop_column(column)
