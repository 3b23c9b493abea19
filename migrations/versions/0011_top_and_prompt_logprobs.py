"""Rollout requests: top_logprobs and prompt_logprobs (what a request asked the engine to score);
samples: their top alternatives per token and their prompt's logprobs, when asked.

Existing requests asked for neither.

Revision ID: 0011_top_and_prompt_logprobs
Revises: 0010_prompt_keys
Create Date: 2026-11-28 09:40:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0011_top_and_prompt_logprobs"
down_revision: str | None = "0010_prompt_keys"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # The server default fills existing rows, then goes (the model has none).
    with op.batch_alter_table("rollout_requests") as batch_op:
        batch_op.add_column(
            sa.Column("top_logprobs", sa.Integer(), nullable=False, server_default="0")
        )
        batch_op.add_column(sa.Column("prompt_logprobs", sa.Integer(), nullable=True))
    with op.batch_alter_table("rollout_requests") as batch_op:
        batch_op.alter_column("top_logprobs", server_default=None)
    with op.batch_alter_table("samples") as batch_op:
        batch_op.add_column(sa.Column("top_logprobs", sa.JSON(), nullable=True))
        batch_op.add_column(sa.Column("prompt_logprobs", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("samples") as batch_op:
        batch_op.drop_column("prompt_logprobs")
        batch_op.drop_column("top_logprobs")
    with op.batch_alter_table("rollout_requests") as batch_op:
        batch_op.drop_column("prompt_logprobs")
        batch_op.drop_column("top_logprobs")
