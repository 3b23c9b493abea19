"""Samples drawn by the simulated engine: samples.simulated.

Revision ID: 0015_simulated_samples
Revises: 0014_step_bounds
Create Date: 2026-12-09 01:00:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0015_simulated_samples"
down_revision: str | None = "0014_step_bounds"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("samples") as batch_op:
        batch_op.add_column(
            sa.Column("simulated", sa.Boolean(), nullable=False, server_default=sa.false())
        )
    with op.batch_alter_table("samples") as batch_op:
        batch_op.alter_column("simulated", server_default=None)


def downgrade() -> None:
    with op.batch_alter_table("samples") as batch_op:
        batch_op.drop_column("simulated")
