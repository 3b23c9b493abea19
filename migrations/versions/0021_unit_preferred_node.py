"""The node a session's turn waits for (it holds the session's KV): work_units.preferred_node.

Revision ID: 0021_unit_preferred_node
Revises: 0020_sample_checkpoints
Create Date: 2026-12-19 02:00:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0021_unit_preferred_node"
down_revision: str | None = "0020_sample_checkpoints"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("work_units") as batch_op:
        batch_op.add_column(sa.Column("preferred_node", sa.String(length=128), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("work_units") as batch_op:
        batch_op.drop_column("preferred_node")
