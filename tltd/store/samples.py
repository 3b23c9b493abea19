"""Samples: stored one at a time (idempotent on their key, fenced by the unit's lease), read
back per request, and a prompt's earlier answers for the history drafter. The checks a sample
passes before it is stored are here too (`tltd.store.sample_batches` applies them to a batch).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from sqlalchemy import func, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from tltd.domain import ENDED_STATUSES, FinishReason, RequestStatus, Sample
from tltd.errors import InvalidArgument
from tltd.store import convert
from tltd.store.database import BINARY_RESULTS, Database
from tltd.store.leases import WorkLeases
from tltd.store.lookups import request_row
from tltd.store.notifications import SAMPLE, notify
from tltd.store.rollout_requests import prompt_key
from tltd.store.tables import RolloutRequestRow, SampleRow, WorkUnitRow, utcnow


class SampleRecords:
    """Samples one at a time, and their reads."""

    def __init__(self, db: Database, leases: WorkLeases) -> None:
        self.db = db
        self.leases = leases

    def add(self, sample: Sample) -> bool:
        """Store a finished (or partial) sample; idempotent on (request_id, prompt_index,
        sample_index).

        Returns True when stored: a new sample, or one replacing a partial one (`replaces`:
        the complete sample of a drained request that was resumed, or a sample's FAILED
        verdict). Returns False for a duplicate, and for a replacement once the request has
        ended: what its streams were given stays what is stored (a late sample from a worker
        already given up on changes nothing). samples_done counts complete (non-partial)
        samples only, so it reaches samples_total exactly when every sample is done.

        Non-finite logprobs are refused (InvalidArgument) on every database: JSON has no
        NaN/Infinity, PostgreSQL rejects them and SQLite would store them as-is.
        """
        bad = not_finite_error(sample)
        if bad is not None:
            raise bad
        try:
            with self.db.tx() as s:
                req = request_row(s, sample.request_id, lock=True)
                bad = out_of_range_error(sample, len(req.prompts), req.n)
                if bad is not None:
                    raise bad
                if self.db.epoch:  # a joined node writes only into units it holds
                    self.leases.check_held(s, sample.request_id, sample.prompt_index)
                existing = s.scalar(
                    select(SampleRow).where(
                        SampleRow.request_id == sample.request_id,
                        SampleRow.prompt_index == sample.prompt_index,
                        SampleRow.sample_index == sample.sample_index,
                    )
                )
                if existing is not None and not replaces(
                    existing.partial, existing.finish_reason, sample, existing.num_tokens
                ):
                    return False
                # A sample not stored yet is still recorded on an ended request: a cancel
                # closes the request in the store before its remaining samples are stored.
                if existing is not None and RequestStatus(req.status) in ENDED_STATUSES:
                    return False
                now = utcnow()
                row = convert.sample_to_row(sample)
                row.created_at = now
                if existing is not None:
                    self._drop_replaced(s, existing, row)
                s.add(row)
                if not sample.partial:
                    req.samples_done += 1
                req.updated_at = now
                notify(s, SAMPLE, sample.request_id)
                return True
        except IntegrityError:
            # Only a concurrent insert of the same key gets here (PostgreSQL locks the
            # request row above, SQLite serializes writers): the other one stored it.
            return False

    def _drop_replaced(self, s: Session, existing: SampleRow, row: SampleRow) -> None:
        """Delete the partial sample `row` replaces. `row` takes a new, larger row id: a
        stream reads its request's samples past the last row id it saw, and must see the
        complete sample that replaced a partial one (the request row's lock keeps one
        request's ids in commit order; SQLite would give the id freed by the delete again)."""
        if self.db.dialect == "sqlite":
            row.id = int(s.scalar(select(func.max(SampleRow.id))) or 0) + 1
        s.delete(existing)
        s.flush()

    def list(self, request_id: str) -> list[Sample]:
        """Samples of a request ordered by (prompt_index, sample_index)."""
        with self.db.tx(write=False) as s:
            request_row(s, request_id)
            rows = s.execute(
                select(SampleRow.__table__)  # rows, not ORM objects: read once, never changed
                .where(SampleRow.request_id == request_id)
                .order_by(SampleRow.prompt_index, SampleRow.sample_index),
                execution_options={BINARY_RESULTS: True},
            ).all()
            return [convert.sample_from_row(r) for r in rows]

    def resumable(self, request_id: str, prompt_indices: Sequence[int]) -> list[Sample]:
        """The unfinished samples stored of these prompts with tokens to go on from: partial,
        ABORTED (a drained node's tokens so far), at least one token."""
        sr = SampleRow
        with self.db.tx(write=False) as s:
            rows = s.execute(
                select(SampleRow.__table__)
                .where(
                    sr.request_id == request_id,
                    sr.prompt_index.in_(sorted(set(prompt_indices))),
                    sr.partial.is_(True),
                    sr.finish_reason == FinishReason.ABORTED.value,
                    sr.num_tokens > 0,
                )
                .order_by(sr.prompt_index, sr.sample_index),
                execution_options={BINARY_RESULTS: True},
            ).all()
            return [convert.sample_from_row(r) for r in rows]

    def prompt_history(
        self, job_id: str, prompt: Sequence[int], limit: int
    ) -> list[tuple[tuple[str, int, int], tuple[int, ...]]]:
        """The job's `limit` most recent whole samples of this prompt, from any request and
        node, oldest first: ((request id, prompt index, sample index), token ids) each. What
        the history drafter starts from when the prompt is admitted again."""
        with self.db.tx(write=False) as s:
            rows = s.execute(
                select(SampleRow.request_id, SampleRow.prompt_index, SampleRow.sample_index,
                       SampleRow.token_ids_bin, SampleRow.token_ids)
                .join(WorkUnitRow, (WorkUnitRow.request_id == SampleRow.request_id)
                      & (WorkUnitRow.prompt_index == SampleRow.prompt_index))
                .join(RolloutRequestRow, RolloutRequestRow.request_id == SampleRow.request_id)
                .where(RolloutRequestRow.job_id == job_id,
                       WorkUnitRow.prompt_key == prompt_key(prompt),
                       SampleRow.partial.is_(False))
                .order_by(SampleRow.id.desc())
                .limit(limit)
            ).all()  # fmt: skip
        return [
            ((r[0], r[1], r[2]), convert.token_ids_from_columns(r[3], r[4])) for r in reversed(rows)
        ]


def replaces(
    stored_partial: bool, stored_reason: str, sample: Sample, stored_tokens: int = 0
) -> bool:
    """Whether `sample` replaces the stored sample of its key (while the request is open). A
    partial one is replaced by the complete sample of a later run, and by a FAILED one: a
    sample that ran out of attempts fails, and the request's final status counts that verdict,
    not the tokens so far of a run that was lost (cancelled when its lease was). A paused
    sample (ABORTED) is replaced by a longer paused one: it went on from those tokens."""
    if not stored_partial:
        return False
    if not sample.partial:
        return True
    aborted = FinishReason.ABORTED
    if sample.finish_reason is aborted and stored_reason == aborted.value:
        return len(sample.token_ids) > stored_tokens
    return sample.finish_reason is FinishReason.FAILED and stored_reason != FinishReason.FAILED


def not_finite_error(sample: Sample) -> InvalidArgument | None:
    """The error for the sample's first non-finite logprob, or None."""
    i = first_not_finite(sample.logprobs)
    if i is None:
        return None
    lp = sample.logprobs[i]
    return InvalidArgument(f"logprob {lp} is not finite", field=f"logprobs[{i}]")


def first_not_finite(values: Sequence[float]) -> int | None:
    """The index of the first NaN or infinity in `values`, or None. A NaN or infinity makes
    the sum non-finite, so the sum (one C loop) clears the usual case; only a non-finite sum
    (or one that overflowed) is searched element by element."""
    if math.isfinite(sum(values)):
        return None
    for i, v in enumerate(values):
        if not math.isfinite(v):
            return i
    return None


def out_of_range_error(sample: Sample, prompts: int, n: int) -> InvalidArgument | None:
    """The error for a sample key outside a request of `prompts` prompts x `n`, or None."""
    if not 0 <= sample.prompt_index < prompts:
        return InvalidArgument(
            f"{sample.prompt_index} out of range for {prompts} prompts", field="prompt_index"
        )
    if not 0 <= sample.sample_index < n:
        return InvalidArgument(
            f"{sample.sample_index} out of range for n={n}", field="sample_index"
        )
    return None
