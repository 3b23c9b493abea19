"""SD statistics: logprob mode and provenance flag per request; drafted, bonus and residual
token counts and per-token provenance per sample.

Existing requests returned processed logprobs without provenance, which the defaults say.
Existing samples get 0 for the new counts (not recorded then) and no provenance.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-26 09:00:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_SAMPLE_COUNTS = ("spec_drafted_tokens", "spec_bonus_tokens", "spec_residual_tokens")


def upgrade() -> None:
    # As in 0002: server defaults fill existing rows, then go (the models have none).
    with op.batch_alter_table("rollout_requests") as batch_op:
        batch_op.add_column(
            sa.Column(
                "logprob_mode", sa.String(length=32), nullable=False, server_default="processed"
            )
        )
        batch_op.add_column(
            sa.Column(
                "return_provenance", sa.Boolean(), nullable=False, server_default=sa.false()
            )
        )
    with op.batch_alter_table("rollout_requests") as batch_op:
        batch_op.alter_column("logprob_mode", server_default=None)
        batch_op.alter_column("return_provenance", server_default=None)
    with op.batch_alter_table("samples") as batch_op:
        for name in _SAMPLE_COUNTS:
            batch_op.add_column(sa.Column(name, sa.Integer(), nullable=False, server_default="0"))
        batch_op.add_column(sa.Column("provenance", sa.JSON(), nullable=True))
    with op.batch_alter_table("samples") as batch_op:
        for name in _SAMPLE_COUNTS:
            batch_op.alter_column(name, server_default=None)


def downgrade() -> None:
    with op.batch_alter_table("samples") as batch_op:
        batch_op.drop_column("provenance")
        for name in reversed(_SAMPLE_COUNTS):
            batch_op.drop_column(name)
    with op.batch_alter_table("rollout_requests") as batch_op:
        batch_op.drop_column("return_provenance")
        batch_op.drop_column("logprob_mode")
