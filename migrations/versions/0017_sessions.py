"""Multi-turn sessions: sessions and session_turns.

Revision ID: 0017_sessions
Revises: 0016_parked_units
Create Date: 2026-12-16 01:00:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from tltd.store.tables import UTCDateTime

revision: str = "0017_sessions"
down_revision: str | None = "0016_parked_units"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "sessions",
        sa.Column("session_id", sa.String(length=128), nullable=False),
        sa.Column("job_id", sa.String(length=128), nullable=False),
        sa.Column("prompt_bin", sa.LargeBinary(), nullable=False),
        sa.Column("status", sa.String(length=32), nullable=False),
        sa.Column("num_turns", sa.Integer(), nullable=False),
        sa.Column("num_tokens", sa.Integer(), nullable=False),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("created_at", UTCDateTime(), nullable=False),
        sa.Column("updated_at", UTCDateTime(), nullable=False),
        sa.ForeignKeyConstraint(
            ["job_id"], ["jobs.job_id"], name=op.f("fk_sessions_job_id_jobs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("session_id", name=op.f("pk_sessions")),
    )
    op.create_index(op.f("ix_sessions_job_id"), "sessions", ["job_id"], unique=False)
    op.create_table(
        "session_turns",
        sa.Column("session_id", sa.String(length=128), nullable=False),
        sa.Column("turn_index", sa.Integer(), autoincrement=False, nullable=False),
        sa.Column("request_id", sa.String(length=128), nullable=False),
        sa.Column("status", sa.String(length=32), nullable=False),
        sa.Column("input_bin", sa.LargeBinary(), nullable=False),
        sa.Column("sampling", sa.JSON(), nullable=False),
        sa.Column("token_ids_bin", sa.LargeBinary(), nullable=True),
        sa.Column("logprobs_bin", sa.LargeBinary(), nullable=True),
        sa.Column("finish_reason", sa.String(length=32), nullable=True),
        sa.Column("policy_version", sa.Integer(), nullable=False),
        sa.Column("policy_spans", sa.JSON(), nullable=True),
        sa.Column("created_at", UTCDateTime(), nullable=False),
        sa.Column("updated_at", UTCDateTime(), nullable=False),
        sa.ForeignKeyConstraint(
            ["session_id"],
            ["sessions.session_id"],
            name=op.f("fk_session_turns_session_id_sessions"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("session_id", "turn_index", name=op.f("pk_session_turns")),
    )


def downgrade() -> None:
    op.drop_table("session_turns")
    op.drop_index(op.f("ix_sessions_job_id"), table_name="sessions")
    op.drop_table("sessions")
