"""Jobs: policy_switch (what running requests do on a new policy version); samples:
policy_spans (which versions produced their tokens, when more than one did); pushes: the
unfinished policy pushes staged on each node (resumed after a restart).

Existing jobs finish every request on its start version, as before.

Revision ID: 0009_policy_switch
Revises: 0008_drafter_leases
Create Date: 2026-11-25 14:00:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from tltd.store.tables import UTCDateTime

revision: str = "0009_policy_switch"
down_revision: str | None = "0008_drafter_leases"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # The server default fills existing rows, then goes (the model has none).
    with op.batch_alter_table("jobs") as batch_op:
        batch_op.add_column(
            sa.Column(
                "policy_switch",
                sa.String(32),
                nullable=False,
                server_default="finish_on_start_version",
            )
        )
    with op.batch_alter_table("jobs") as batch_op:
        batch_op.alter_column("policy_switch", server_default=None)
    with op.batch_alter_table("samples") as batch_op:
        batch_op.add_column(sa.Column("policy_spans", sa.JSON(), nullable=True))
    op.create_table(
        "pushes",
        sa.Column("node_id", sa.String(128), primary_key=True),
        sa.Column(
            "job_id",
            sa.String(128),
            sa.ForeignKey("jobs.job_id", ondelete="CASCADE"),
            primary_key=True,
        ),
        sa.Column("update_id", sa.String(128), primary_key=True),
        sa.Column("header", sa.JSON(), nullable=False),
        sa.Column("received", sa.JSON(), nullable=False),
        sa.Column("updated_at", UTCDateTime(), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("pushes")
    with op.batch_alter_table("samples") as batch_op:
        batch_op.drop_column("policy_spans")
    with op.batch_alter_table("jobs") as batch_op:
        batch_op.drop_column("policy_switch")
