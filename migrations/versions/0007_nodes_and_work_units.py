"""Several nodes on one database: nodes with epochs, devices and workers keyed by node, work
units (one per prompt of a request) claimed under leases.

Rows written before nodes existed get the node id "" and are adopted by the first daemon that
starts (a single-node database has exactly one owner). Open requests get their work units,
queued.

Revision ID: 0007_nodes_and_work_units
Revises: 0006_drop_worker_leases
Create Date: 2026-11-25 10:30:00.000000
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import UTC, datetime

import sqlalchemy as sa
from alembic import op

from tltd.store.tables import UTCDateTime

revision: str = "0007_nodes_and_work_units"
down_revision: str | None = "0006_drop_worker_leases"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_KEYED = (("devices", "device_id", 64), ("workers", "worker_id", 128))


def upgrade() -> None:
    op.create_table(
        "nodes",
        sa.Column("node_id", sa.String(length=128), nullable=False),
        sa.Column("address", sa.String(length=256), nullable=False),
        sa.Column("state", sa.String(length=32), nullable=False),
        sa.Column("epoch", sa.BigInteger(), nullable=False),
        sa.Column("heartbeat_at", UTCDateTime(), nullable=False),
        sa.Column("started_at", UTCDateTime(), nullable=False),
        sa.PrimaryKeyConstraint("node_id", name=op.f("pk_nodes")),
    )
    op.create_table(
        "work_units",
        sa.Column("request_id", sa.String(length=128), nullable=False),
        sa.Column("prompt_index", sa.Integer(), nullable=False),
        sa.Column("samples", sa.Integer(), nullable=False),
        sa.Column("priority", sa.BigInteger(), nullable=False),
        sa.Column("state", sa.String(length=32), nullable=False),
        sa.Column("owner_node", sa.String(length=128), nullable=True),
        sa.Column("owner_epoch", sa.BigInteger(), nullable=False),
        sa.Column("lease_expires_at", UTCDateTime(), nullable=True),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("created_at", UTCDateTime(), nullable=False),
        sa.Column("updated_at", UTCDateTime(), nullable=False),
        sa.ForeignKeyConstraint(
            ["request_id"],
            ["rollout_requests.request_id"],
            name=op.f("fk_work_units_request_id_rollout_requests"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("request_id", "prompt_index", name=op.f("pk_work_units")),
    )
    op.create_index(
        "ix_work_units_state_created_at", "work_units", ["state", "created_at"], unique=False
    )
    op.create_index(
        op.f("ix_work_units_owner_node"), "work_units", ["owner_node"], unique=False
    )
    for table, key, length in _KEYED:
        with op.batch_alter_table(table, recreate="always") as batch_op:
            batch_op.add_column(
                sa.Column("node_id", sa.String(length=128), nullable=False, server_default="")
            )
        with op.batch_alter_table(table, recreate="always") as batch_op:
            batch_op.alter_column("node_id", server_default=None)
            batch_op.drop_constraint(f"pk_{table}", type_="primary")
            batch_op.create_primary_key(f"pk_{table}", ["node_id", key])
    _units_for_open_requests()


def _units_for_open_requests() -> None:
    """One queued unit per prompt of every open request (a request is queued or running)."""
    bind = op.get_bind()
    requests = sa.table(
        "rollout_requests",
        sa.column("request_id", sa.String()),
        sa.column("prompts", sa.JSON()),
        sa.column("n", sa.Integer()),
        sa.column("status", sa.String()),
        sa.column("job_id", sa.String()),
        sa.column("created_at", UTCDateTime()),
    )
    jobs = sa.table("jobs", sa.column("job_id", sa.String()), sa.column("priority", sa.BigInteger()))
    units = sa.table(
        "work_units",
        sa.column("request_id", sa.String()),
        sa.column("prompt_index", sa.Integer()),
        sa.column("samples", sa.Integer()),
        sa.column("priority", sa.BigInteger()),
        sa.column("state", sa.String()),
        sa.column("owner_epoch", sa.BigInteger()),
        sa.column("attempts", sa.Integer()),
        sa.column("reason", sa.Text()),
        sa.column("created_at", UTCDateTime()),
        sa.column("updated_at", UTCDateTime()),
    )
    now = datetime.now(UTC)
    rows = bind.execute(
        sa.select(requests, jobs.c.priority)
        .join(jobs, jobs.c.job_id == requests.c.job_id)
        .where(requests.c.status.in_(["queued", "running"]))
    ).all()
    values = []
    for r in rows:
        prompts = json.loads(r.prompts) if isinstance(r.prompts, str) else r.prompts
        for p in range(len(prompts)):
            values.append(
                dict(
                    request_id=r.request_id, prompt_index=p, samples=r.n,
                    priority=r.priority, state="queued",
                    owner_epoch=0, attempts=0, reason="", created_at=r.created_at or now,
                    updated_at=now,
                )
            )  # fmt: skip
    if values:
        bind.execute(units.insert(), values)


def downgrade() -> None:
    # One node's rows per device and worker id survive (the old key has no node).
    for table, key, _ in _KEYED:
        op.execute(
            f"DELETE FROM {table} WHERE node_id <> (SELECT MIN(node_id) FROM {table})"  # noqa: S608
        )
        with op.batch_alter_table(table, recreate="always") as batch_op:
            batch_op.drop_constraint(f"pk_{table}", type_="primary")
            batch_op.create_primary_key(f"pk_{table}", [key])
        with op.batch_alter_table(table) as batch_op:
            batch_op.drop_column("node_id")
    op.drop_index(op.f("ix_work_units_owner_node"), table_name="work_units")
    op.drop_index("ix_work_units_state_created_at", table_name="work_units")
    op.drop_table("work_units")
    op.drop_table("nodes")
