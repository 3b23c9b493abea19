"""Drafter training across nodes: a lease per job's drafter (one node trains it at a time,
fenced by a lease epoch, with the cursor of samples consumed), the node and storage of each
drafter version, and operator requests addressed to a node (cordon, drain).

Existing drafter versions get node id "" (the single node that wrote them) and are not on
shared storage.

Revision ID: 0008_drafter_leases
Revises: 0007_nodes_and_work_units
Create Date: 2026-11-25 13:40:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from tltd.store.tables import UTCDateTime

revision: str = "0008_drafter_leases"
down_revision: str | None = "0007_nodes_and_work_units"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "drafter_leases",
        sa.Column("job_id", sa.String(length=128), nullable=False),
        sa.Column("owner_node", sa.String(length=128), nullable=False),
        sa.Column("owner_epoch", sa.BigInteger(), nullable=False),
        sa.Column("lease_epoch", sa.BigInteger(), nullable=False),
        sa.Column("expires_at", UTCDateTime(), nullable=False),
        sa.Column("cursor", sa.BigInteger(), nullable=False),
        sa.Column("published_version", sa.Integer(), nullable=False),
        sa.Column("updated_at", UTCDateTime(), nullable=False),
        sa.ForeignKeyConstraint(
            ["job_id"],
            ["jobs.job_id"],
            name=op.f("fk_drafter_leases_job_id_jobs"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("job_id", name=op.f("pk_drafter_leases")),
    )
    with op.batch_alter_table("drafter_versions") as batch_op:
        batch_op.add_column(
            sa.Column("node_id", sa.String(length=128), nullable=False, server_default="")
        )
        batch_op.add_column(
            sa.Column("shared", sa.Boolean(), nullable=False, server_default=sa.false())
        )
    with op.batch_alter_table("drafter_versions") as batch_op:
        batch_op.alter_column("node_id", server_default=None)
        batch_op.alter_column("shared", server_default=None)
    with op.batch_alter_table("nodes") as batch_op:
        for name, type_, default in (
            ("cordoned", sa.Boolean(), sa.false()),
            ("drain_requested", sa.Boolean(), sa.false()),
            ("drain_reason", sa.Text(), sa.text("''")),
            ("drain_grace_seconds", sa.Float(), sa.text("0")),
        ):
            batch_op.add_column(sa.Column(name, type_, nullable=False, server_default=default))
    with op.batch_alter_table("nodes") as batch_op:
        for name in ("cordoned", "drain_requested", "drain_reason", "drain_grace_seconds"):
            batch_op.alter_column(name, server_default=None)


def downgrade() -> None:
    with op.batch_alter_table("nodes") as batch_op:
        for name in ("drain_grace_seconds", "drain_reason", "drain_requested", "cordoned"):
            batch_op.drop_column(name)
    with op.batch_alter_table("drafter_versions") as batch_op:
        batch_op.drop_column("shared")
        batch_op.drop_column("node_id")
    op.drop_table("drafter_leases")
