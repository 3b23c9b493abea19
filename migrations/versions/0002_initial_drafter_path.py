"""Jobs: speculative.initial_drafter_path (an offline-fitted drafter the job starts from).

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-21 10:30:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # server_default fills existing rows ("" = no initial drafter), then goes: the model has
    # no server default, and `alembic check` compares against it.
    with op.batch_alter_table("jobs") as batch_op:
        batch_op.add_column(
            sa.Column("spec_initial_drafter_path", sa.Text(), nullable=False, server_default="")
        )
    with op.batch_alter_table("jobs") as batch_op:
        batch_op.alter_column("spec_initial_drafter_path", server_default=None)


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch_op:
        batch_op.drop_column("spec_initial_drafter_path")
