"""Rollout requests: queued with one work unit per prompt, idempotent on request id, moved
through their statuses."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from tltd.domain import JobStatus, RequestStatus, RolloutRequest
from tltd.errors import AlreadyExists, FailedPrecondition
from tltd.store import convert
from tltd.store.lookups import changed_fields, job_row, request_row
from tltd.store.notifications import REQUEST, WORK, notify
from tltd.store.status import record_event, switch_status, switch_status_from
from tltd.store.tables import JobPauseRow, RolloutRequestRow, WorkUnitRow, utcnow

_REQUEST_PARAMS = ("job_id", "prompts", "sampling", "speculative")


def prompt_key(prompt: Sequence[int]) -> str:
    """A prompt's token ids as a fixed-width key (sha256 hex): the history drafter's look-up
    of a prompt's earlier answers across requests."""
    return hashlib.sha256(",".join(map(str, prompt)).encode()).hexdigest()


class JobPaused(Exception):
    """create_request(unless_paused=True) stored nothing: the request's job is paused."""


class RolloutRequests:
    """Mixed into the Store (uses its `_tx`)."""

    _tx: Callable[..., AbstractContextManager[Session]]

    def create_request(
        self, req: RolloutRequest, unless_paused: bool = False
    ) -> tuple[RolloutRequest, bool]:
        """Queue a rollout request; idempotent on request_id (see create_job): a retry gets
        the stored request (False), whatever its job's state. Otherwise the job must exist
        (NotFound) and be active (FailedPrecondition), and with `unless_paused` not be paused
        (JobPaused: nothing stored)."""
        try:
            with self._tx() as s:
                # FOR SHARE until commit: a concurrent cancel of the job (FOR UPDATE) waits for
                # this request and then sees it, and a new policy version waits too, so the
                # version recorded is the job's current one at acceptance.
                job = job_row(s, req.job_id, share=True)
                refused: Exception | None = None
                if job.status != JobStatus.ACTIVE:
                    refused = FailedPrecondition(
                        f"job {req.job_id!r} is {job.status}", field="job_id"
                    )
                elif unless_paused and s.get(JobPauseRow, req.job_id) is not None:
                    refused = JobPaused(req.job_id)
                if refused is not None:  # a retry attaches all the same
                    existing = s.get(RolloutRequestRow, req.request_id)
                    if existing is not None:
                        return self._same_request(existing, req), False
                    raise refused
                # A retry of a stored request fails the insert below (its primary key): it
                # is read then, so a new request needs no read first.
                now = utcnow()
                row = convert.request_to_row(req)
                row.status, row.status_reason, row.samples_done = RequestStatus.QUEUED.value, "", 0
                row.policy_version = job.policy_version
                row.created_at = row.updated_at = now
                s.add(row)
                # One work unit per prompt: what nodes claim (tltd.store.leases).
                s.add_all(
                    WorkUnitRow(
                        request_id=req.request_id,
                        prompt_index=p,
                        samples=req.sampling.n,
                        prompt_key=prompt_key(req.prompts[p]),
                        priority=job.priority,
                        state="queued",
                        owner_epoch=0,
                        attempts=0,
                        reason="",
                        created_at=now,
                        updated_at=now,
                    )  # fmt: skip
                    for p in range(len(req.prompts))
                )
                record_event(
                    s, "request", req.request_id, "", RequestStatus.QUEUED, "submitted", at=now
                )
                notify(s, WORK, req.request_id)
                s.flush()
                return convert.request_from_row(row), True
        except IntegrityError:  # the request_id is stored: a retry (or a concurrent one)
            with self._tx(write=False) as s:
                existing = s.get(RolloutRequestRow, req.request_id)
                if existing is None:
                    raise
                return self._same_request(existing, req), False

    @staticmethod
    def _same_request(existing: RolloutRequestRow, req: RolloutRequest) -> RolloutRequest:
        current = convert.request_from_row(existing)
        diff = changed_fields(current, req, _REQUEST_PARAMS)
        if diff:
            raise AlreadyExists(
                f"rollout request {req.request_id!r} already exists with different "
                f"{', '.join(diff)}",
                field="request_id",
            )
        return current

    def get_request(self, request_id: str) -> RolloutRequest:
        with self._tx(write=False) as s:
            return convert.request_from_row(request_row(s, request_id))

    def list_requests(
        self,
        statuses: Sequence[RequestStatus] | None = None,
        job_id: str | None = None,
        limit: int | None = 1000,
    ) -> list[RolloutRequest]:
        """Requests, oldest first (queue order); limit None = all of them."""
        with self._tx(write=False) as s:
            q = select(RolloutRequestRow)
            if statuses:
                q = q.where(RolloutRequestRow.status.in_([str(x) for x in statuses]))
            if job_id is not None:
                q = q.where(RolloutRequestRow.job_id == job_id)
            q = q.order_by(RolloutRequestRow.created_at, RolloutRequestRow.request_id)
            return [convert.request_from_row(r) for r in s.scalars(q.limit(limit)).all()]

    def mark_running(self, request_id: str, reason: str) -> bool:
        """QUEUED -> RUNNING with its event, as `set_request_status` records it; True when it
        moved. Any other status stands (RUNNING already, or ended meanwhile). Two statements,
        nothing read back: a node calls it once per request it starts. Other nodes are not
        notified: a request starting changes nothing their streams send or their units do."""
        with self._tx() as s:
            return switch_status_from(
                s, "request", RolloutRequestRow, request_id,
                RequestStatus.QUEUED, RequestStatus.RUNNING, reason,
            )  # fmt: skip

    def set_request_status(
        self, request_id: str, new: RequestStatus, reason: str
    ) -> RolloutRequest:
        with self._tx() as s:
            row = request_row(s, request_id, lock=True)
            if switch_status(s, "request", request_id, row, new, reason):
                notify(s, REQUEST, request_id)  # streams and the nodes running it look now
            return convert.request_from_row(row)
