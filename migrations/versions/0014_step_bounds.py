"""Asynchronous RL: a request's step bound (rollout_requests.bound_groups, .carried), which
request's stream sent each group (work_units.delivered_to), and a job's staleness bound
(jobs.max_staleness).

Revision ID: 0014_step_bounds
Revises: 0013_packed_sample_payloads
Create Date: 2026-12-02 01:00:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0014_step_bounds"
down_revision: str | None = "0013_packed_sample_payloads"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch_op:
        batch_op.add_column(sa.Column("max_staleness", sa.BigInteger(), nullable=True))
    with op.batch_alter_table("rollout_requests") as batch_op:
        batch_op.add_column(
            sa.Column("bound_groups", sa.Integer(), nullable=False, server_default="0")
        )
        batch_op.add_column(
            sa.Column("carried", sa.Boolean(), nullable=False, server_default=sa.false())
        )
    with op.batch_alter_table("rollout_requests") as batch_op:
        batch_op.alter_column("bound_groups", server_default=None)
        batch_op.alter_column("carried", server_default=None)
    with op.batch_alter_table("work_units") as batch_op:
        batch_op.add_column(sa.Column("delivered_to", sa.String(128), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("work_units") as batch_op:
        batch_op.drop_column("delivered_to")
    with op.batch_alter_table("rollout_requests") as batch_op:
        batch_op.drop_column("carried")
        batch_op.drop_column("bound_groups")
    with op.batch_alter_table("jobs") as batch_op:
        batch_op.drop_column("max_staleness")
