"""Whether a session continues its latest turn when a request names none: sessions.streaming.

Revision ID: 0019_streaming_sessions
Revises: 0018_step_token_budget
Create Date: 2026-12-18 01:00:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0019_streaming_sessions"
down_revision: str | None = "0018_step_token_budget"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("sessions") as batch_op:
        batch_op.add_column(
            sa.Column("streaming", sa.Boolean(), nullable=False, server_default=sa.false())
        )
    with op.batch_alter_table("sessions") as batch_op:
        batch_op.alter_column("streaming", server_default=None)


def downgrade() -> None:
    with op.batch_alter_table("sessions") as batch_op:
        batch_op.drop_column("streaming")
