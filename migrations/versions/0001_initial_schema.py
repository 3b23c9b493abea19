"""Initial schema: jobs, policy and drafter versions, rollout requests, samples, devices, workers, events.

Revision ID: 0001
Revises:
Create Date: 2026-11-21 07:21:33.054000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op


revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "devices",
        sa.Column("device_id", sa.String(length=64), nullable=False),
        sa.Column("kind", sa.String(length=32), nullable=False),
        sa.Column("device_index", sa.Integer(), nullable=False),
        sa.Column("uuid", sa.String(length=128), nullable=False),
        sa.Column("name", sa.String(length=256), nullable=False),
        sa.Column("memory_total_bytes", sa.BigInteger(), nullable=False),
        sa.Column("memory_used_bytes", sa.BigInteger(), nullable=False),
        sa.Column("utilization", sa.Float(), nullable=False),
        sa.Column("processes", sa.JSON(), nullable=False),
        sa.Column("foreign", sa.Boolean(), nullable=False),
        sa.Column("cordoned", sa.Boolean(), nullable=False),
        sa.Column("draining", sa.Boolean(), nullable=False),
        sa.Column("state", sa.String(length=32), nullable=False),
        sa.Column("state_reason", sa.Text(), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("device_id", name=op.f("pk_devices")),
    )
    op.create_table(
        "events",
        sa.Column(
            "id",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            autoincrement=True,
            nullable=False,
        ),
        sa.Column("entity", sa.String(length=32), nullable=False),
        sa.Column("entity_id", sa.String(length=256), nullable=False),
        sa.Column("old_status", sa.String(length=64), nullable=False),
        sa.Column("new_status", sa.String(length=64), nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_events")),
    )
    with op.batch_alter_table("events", schema=None) as batch_op:
        batch_op.create_index("ix_events_entity_entity_id", ["entity", "entity_id"], unique=False)

    op.create_table(
        "jobs",
        sa.Column("job_id", sa.String(length=128), nullable=False),
        sa.Column("name", sa.String(length=256), nullable=False),
        sa.Column("model_path", sa.Text(), nullable=False),
        sa.Column("backend", sa.String(length=32), nullable=False),
        sa.Column("priority", sa.Integer(), nullable=False),
        sa.Column("weight", sa.Float(), nullable=False),
        sa.Column("spec_mode", sa.String(length=32), nullable=False),
        sa.Column("spec_batch_threshold", sa.Integer(), nullable=False),
        sa.Column("spec_draft_lengths", sa.JSON(), nullable=False),
        sa.Column("spec_drafter", sa.String(length=32), nullable=False),
        sa.Column("spec_online_training", sa.Boolean(), nullable=False),
        sa.Column("status", sa.String(length=32), nullable=False),
        sa.Column("status_reason", sa.Text(), nullable=False),
        sa.Column("policy_version", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("job_id", name=op.f("pk_jobs")),
    )
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_jobs_created_at"), ["created_at"], unique=False)
        batch_op.create_index(batch_op.f("ix_jobs_status"), ["status"], unique=False)

    op.create_table(
        "workers",
        sa.Column("worker_id", sa.String(length=128), nullable=False),
        sa.Column("kind", sa.String(length=32), nullable=False),
        sa.Column("device_id", sa.String(length=64), nullable=False),
        sa.Column("job_id", sa.String(length=128), nullable=False),
        sa.Column("state", sa.String(length=32), nullable=False),
        sa.Column("pid", sa.Integer(), nullable=False),
        sa.Column("state_reason", sa.Text(), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("last_heartbeat", sa.DateTime(timezone=True), nullable=True),
        sa.Column("lease_token", sa.String(length=64), nullable=True),
        sa.Column("lease_owner", sa.String(length=128), nullable=True),
        sa.Column("lease_expires_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("worker_id", name=op.f("pk_workers")),
    )
    with op.batch_alter_table("workers", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_workers_device_id"), ["device_id"], unique=False)
        batch_op.create_index(batch_op.f("ix_workers_state"), ["state"], unique=False)

    op.create_table(
        "drafter_versions",
        sa.Column(
            "id",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            autoincrement=True,
            nullable=False,
        ),
        sa.Column("job_id", sa.String(length=128), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("policy_version", sa.Integer(), nullable=False),
        sa.Column("path", sa.Text(), nullable=False),
        sa.Column("train_steps", sa.Integer(), nullable=False),
        sa.Column("loss", sa.Float(), nullable=False),
        sa.Column("acceptance_length", sa.Float(), nullable=False),
        sa.Column("status", sa.String(length=32), nullable=False),
        sa.Column("status_reason", sa.Text(), nullable=False),
        sa.Column("pinned", sa.Boolean(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["job_id"],
            ["jobs.job_id"],
            name=op.f("fk_drafter_versions_job_id_jobs"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_drafter_versions")),
        sa.UniqueConstraint("job_id", "version", name=op.f("uq_drafter_versions_job_id_version")),
    )
    op.create_table(
        "policy_versions",
        sa.Column("job_id", sa.String(length=128), nullable=False),
        sa.Column("version", sa.Integer(), autoincrement=False, nullable=False),
        sa.Column("source", sa.String(length=32), nullable=False),
        sa.Column("path", sa.Text(), nullable=False),
        sa.Column("note", sa.Text(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["job_id"],
            ["jobs.job_id"],
            name=op.f("fk_policy_versions_job_id_jobs"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("job_id", "version", name=op.f("pk_policy_versions")),
    )
    op.create_table(
        "rollout_requests",
        sa.Column("request_id", sa.String(length=128), nullable=False),
        sa.Column("job_id", sa.String(length=128), nullable=False),
        sa.Column("prompts", sa.JSON(), nullable=False),
        sa.Column("n", sa.Integer(), nullable=False),
        sa.Column("temperature", sa.Float(), nullable=False),
        sa.Column("top_p", sa.Float(), nullable=False),
        sa.Column("top_k", sa.Integer(), nullable=False),
        sa.Column("max_new_tokens", sa.Integer(), nullable=False),
        sa.Column("stop_token_ids", sa.JSON(), nullable=False),
        sa.Column("seed", sa.BigInteger(), nullable=True),
        sa.Column("speculative", sa.String(length=32), nullable=False),
        sa.Column("status", sa.String(length=32), nullable=False),
        sa.Column("status_reason", sa.Text(), nullable=False),
        sa.Column("samples_done", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["job_id"],
            ["jobs.job_id"],
            name=op.f("fk_rollout_requests_job_id_jobs"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("request_id", name=op.f("pk_rollout_requests")),
    )
    with op.batch_alter_table("rollout_requests", schema=None) as batch_op:
        batch_op.create_index(
            batch_op.f("ix_rollout_requests_created_at"), ["created_at"], unique=False
        )
        batch_op.create_index(batch_op.f("ix_rollout_requests_job_id"), ["job_id"], unique=False)
        batch_op.create_index(batch_op.f("ix_rollout_requests_status"), ["status"], unique=False)

    op.create_table(
        "samples",
        sa.Column(
            "id",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            autoincrement=True,
            nullable=False,
        ),
        sa.Column("request_id", sa.String(length=128), nullable=False),
        sa.Column("prompt_index", sa.Integer(), nullable=False),
        sa.Column("sample_index", sa.Integer(), nullable=False),
        sa.Column("token_ids", sa.JSON(), nullable=False),
        sa.Column("logprobs", sa.JSON(), nullable=False),
        sa.Column("num_tokens", sa.Integer(), nullable=False),
        sa.Column("finish_reason", sa.String(length=32), nullable=False),
        sa.Column("policy_version", sa.Integer(), nullable=False),
        sa.Column("drafter_version", sa.Integer(), nullable=False),
        sa.Column("spec_draft_steps", sa.Integer(), nullable=False),
        sa.Column("spec_plain_steps", sa.Integer(), nullable=False),
        sa.Column("spec_accepted_tokens", sa.Integer(), nullable=False),
        sa.Column("spec_mean_accepted_length", sa.Float(), nullable=False),
        sa.Column("partial", sa.Boolean(), nullable=False),
        sa.Column("error", sa.Text(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["request_id"],
            ["rollout_requests.request_id"],
            name=op.f("fk_samples_request_id_rollout_requests"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_samples")),
        sa.UniqueConstraint(
            "request_id",
            "prompt_index",
            "sample_index",
            name=op.f("uq_samples_request_id_prompt_index_sample_index"),
        ),
    )


def downgrade() -> None:
    # Children before parents; dropping a table drops its indexes.
    for table in (
        "samples",
        "rollout_requests",
        "policy_versions",
        "drafter_versions",
        "workers",
        "jobs",
        "events",
        "devices",
    ):
        op.drop_table(table)
