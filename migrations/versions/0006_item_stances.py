"""item stances: each news item's stance and their mean, beside a thesis's stored stance

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-01 15:00:00

Existing rows get no item stances (an empty list) and no aggregate.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | Sequence[str] | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("theses", schema=None) as batch_op:
        batch_op.add_column(sa.Column("item_stance", sa.Float(), nullable=True))
        batch_op.add_column(sa.Column("item_stances", sa.JSON(), server_default="[]", nullable=False))


def downgrade() -> None:
    with op.batch_alter_table("theses", schema=None) as batch_op:
        batch_op.drop_column("item_stances")
        batch_op.drop_column("item_stance")
