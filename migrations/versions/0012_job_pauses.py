"""job_pauses: the jobs paused for every node (new requests of them wait at admission until
resumed), where each daemon kept its own pause state before.

Revision ID: 0012_job_pauses
Revises: 0011_top_and_prompt_logprobs
Create Date: 2026-11-28 10:00:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from tltd.store.tables import UTCDateTime

revision: str = "0012_job_pauses"
down_revision: str | None = "0011_top_and_prompt_logprobs"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "job_pauses",
        sa.Column(
            "job_id",
            sa.String(128),
            sa.ForeignKey("jobs.job_id", ondelete="CASCADE"),
            primary_key=True,
        ),
        sa.Column("mode", sa.String(32), nullable=False),
        sa.Column("paused_at", UTCDateTime(), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("job_pauses")
