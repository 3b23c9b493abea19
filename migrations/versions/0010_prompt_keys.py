"""Work units: prompt_key (sha256 of the prompt's token ids), indexed, so that a prompt's
earlier answers in a job are found when it is admitted again (the history drafter).

Units stored before have no key: their samples are not found as history.

Revision ID: 0010_prompt_keys
Revises: 0009_policy_switch
Create Date: 2026-11-28 06:30:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0010_prompt_keys"
down_revision: str | None = "0009_policy_switch"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("work_units") as batch_op:
        batch_op.add_column(sa.Column("prompt_key", sa.String(64), nullable=True))
        batch_op.create_index("ix_work_units_prompt_key", ["prompt_key"])


def downgrade() -> None:
    with op.batch_alter_table("work_units") as batch_op:
        batch_op.drop_index("ix_work_units_prompt_key")
        batch_op.drop_column("prompt_key")
