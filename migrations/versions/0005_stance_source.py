"""stance source: which reading a thesis's stored stance is (thesis, news, or a stance head)

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-01 13:45:00

Existing rows get no source (they were stored before the night said which it stored).
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | Sequence[str] | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("theses", schema=None) as batch_op:
        batch_op.add_column(sa.Column("stance_source", sa.String(length=16), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("theses", schema=None) as batch_op:
        batch_op.drop_column("stance_source")
