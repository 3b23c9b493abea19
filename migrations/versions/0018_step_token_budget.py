"""A bounded request's token budget per sample: rollout_requests.bound_tokens.

Revision ID: 0018_step_token_budget
Revises: 0017_sessions
Create Date: 2026-12-11 01:00:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0018_step_token_budget"
down_revision: str | None = "0017_sessions"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("rollout_requests") as batch_op:
        batch_op.add_column(
            sa.Column("bound_tokens", sa.Integer(), nullable=False, server_default="0")
        )
    with op.batch_alter_table("rollout_requests") as batch_op:
        batch_op.alter_column("bound_tokens", server_default=None)


def downgrade() -> None:
    with op.batch_alter_table("rollout_requests") as batch_op:
        batch_op.drop_column("bound_tokens")
