"""Parked prompts of bounded requests: rollout_requests.bound_park and bound_deadline_ms (a
work unit's state may now be "parked").

Revision ID: 0016_parked_units
Revises: 0015_simulated_samples
Create Date: 2026-12-10 01:00:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0016_parked_units"
down_revision: str | None = "0015_simulated_samples"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("rollout_requests") as batch_op:
        batch_op.add_column(
            sa.Column("bound_park", sa.Boolean(), nullable=False, server_default=sa.false())
        )
        batch_op.add_column(
            sa.Column("bound_deadline_ms", sa.Integer(), nullable=False, server_default="0")
        )
    with op.batch_alter_table("rollout_requests") as batch_op:
        batch_op.alter_column("bound_park", server_default=None)
        batch_op.alter_column("bound_deadline_ms", server_default=None)


def downgrade() -> None:
    with op.batch_alter_table("rollout_requests") as batch_op:
        batch_op.drop_column("bound_deadline_ms")
        batch_op.drop_column("bound_park")
