"""Running samples' tokens so far, stored while they run: sample_checkpoints.

Revision ID: 0020_sample_checkpoints
Revises: 0019_streaming_sessions
Create Date: 2026-12-19 01:00:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from tltd.store.tables import UTCDateTime

revision: str = "0020_sample_checkpoints"
down_revision: str | None = "0019_streaming_sessions"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "sample_checkpoints",
        sa.Column("request_id", sa.String(length=128), nullable=False),
        sa.Column("prompt_index", sa.Integer(), autoincrement=False, nullable=False),
        sa.Column("sample_index", sa.Integer(), autoincrement=False, nullable=False),
        sa.Column("num_tokens", sa.Integer(), nullable=False),
        sa.Column("token_ids_bin", sa.LargeBinary(), nullable=True),
        sa.Column("logprobs_bin", sa.LargeBinary(), nullable=True),
        sa.Column("state", sa.JSON(), nullable=False),
        sa.Column("updated_at", UTCDateTime(), nullable=False),
        sa.ForeignKeyConstraint(
            ["request_id"],
            ["rollout_requests.request_id"],
            name=op.f("fk_sample_checkpoints_request_id_rollout_requests"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint(
            "request_id", "prompt_index", "sample_index", name=op.f("pk_sample_checkpoints")
        ),
    )


def downgrade() -> None:
    op.drop_table("sample_checkpoints")
