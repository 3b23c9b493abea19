"""Samples: token ids and logprobs packed in binary columns (token_ids_bin: little-endian
int32, logprobs_bin: little-endian float64) instead of JSON arrays; the JSON columns stay,
nullable, for the rows stored before (read as they are) and for token ids beyond int32.

Downgrade writes the packed rows back as JSON before dropping the packed columns.

Revision ID: 0011_packed_sample_payloads
Revises: 0010_prompt_keys
Create Date: 2026-11-28 09:40:00.000000
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0013_packed_sample_payloads"
down_revision: str | None = "0012_job_pauses"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_BATCH = 500


def upgrade() -> None:
    with op.batch_alter_table("samples") as batch_op:
        batch_op.add_column(sa.Column("token_ids_bin", sa.LargeBinary(), nullable=True))
        batch_op.add_column(sa.Column("logprobs_bin", sa.LargeBinary(), nullable=True))
        batch_op.alter_column("token_ids", existing_type=sa.JSON(), nullable=True)
        batch_op.alter_column("logprobs", existing_type=sa.JSON(), nullable=True)


def _unpack(typecode: str, blob: bytes | None) -> list:
    a = array(typecode)
    a.frombytes(blob or b"")
    if sys.byteorder != "little":
        a.byteswap()
    return a.tolist()


def downgrade() -> None:
    conn = op.get_bind()
    samples = sa.table(
        "samples",
        sa.column("id", sa.BigInteger()),
        sa.column("token_ids", sa.JSON()),
        sa.column("logprobs", sa.JSON()),
        sa.column("token_ids_bin", sa.LargeBinary()),
        sa.column("logprobs_bin", sa.LargeBinary()),
    )
    last = 0
    while True:
        rows = conn.execute(
            sa.select(samples.c.id, samples.c.token_ids_bin, samples.c.logprobs_bin)
            .where(samples.c.id > last, samples.c.token_ids_bin.is_not(None))
            .order_by(samples.c.id)
            .limit(_BATCH)
        ).all()
        if not rows:
            break
        for sample_id, ids, logprobs in rows:
            conn.execute(
                sa.update(samples)
                .where(samples.c.id == sample_id)
                .values(token_ids=_unpack("i", ids), logprobs=_unpack("d", logprobs))
            )
        last = rows[-1][0]
    with op.batch_alter_table("samples") as batch_op:
        batch_op.alter_column("token_ids", existing_type=sa.JSON(), nullable=False)
        batch_op.alter_column("logprobs", existing_type=sa.JSON(), nullable=False)
        batch_op.drop_column("logprobs_bin")
        batch_op.drop_column("token_ids_bin")
