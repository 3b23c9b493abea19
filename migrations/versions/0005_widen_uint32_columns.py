"""Job priority and SD batch threshold as BIGINT: the API declares them uint32, beyond SQL INTEGER.

Revision ID: 0005_widen_uint32
Revises: 0004
Create Date: 2026-11-25 05:00:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005_widen_uint32"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_COLUMNS = ("priority", "spec_batch_threshold")
_INT32_MAX = 2**31 - 1


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch_op:
        for name in _COLUMNS:
            batch_op.alter_column(name, existing_type=sa.Integer(), type_=sa.BigInteger())


def downgrade() -> None:
    # INTEGER cannot hold what BIGINT may: the largest INTEGER is the nearest value (both
    # columns only order or bound things, so the clamp keeps their meaning for old code).
    for name in _COLUMNS:
        op.execute(f"UPDATE jobs SET {name} = {_INT32_MAX} WHERE {name} > {_INT32_MAX}")
    with op.batch_alter_table("jobs") as batch_op:
        for name in _COLUMNS:
            batch_op.alter_column(name, existing_type=sa.BigInteger(), type_=sa.Integer())
