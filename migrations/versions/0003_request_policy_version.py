"""Rollout requests: policy_version (the job's version when the request was accepted).

Existing requests get the version of their complete samples if they have any, else their
job's current version.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-24 09:00:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # As in 0002: the server default fills existing rows, then goes (the model has none).
    with op.batch_alter_table("rollout_requests") as batch_op:
        batch_op.add_column(
            sa.Column("policy_version", sa.Integer(), nullable=False, server_default="0")
        )
    op.execute(
        """
        UPDATE rollout_requests SET policy_version = COALESCE(
            (SELECT MIN(s.policy_version) FROM samples s
             WHERE s.request_id = rollout_requests.request_id AND NOT s.partial),
            (SELECT j.policy_version FROM jobs j WHERE j.job_id = rollout_requests.job_id),
            0)
        """
    )
    with op.batch_alter_table("rollout_requests") as batch_op:
        batch_op.alter_column("policy_version", server_default=None)


def downgrade() -> None:
    with op.batch_alter_table("rollout_requests") as batch_op:
        batch_op.drop_column("policy_version")
