"""This node's workers as the supervisor records them: registered, restarted, heartbeating,
moved through their states."""

from __future__ import annotations

from dataclasses import replace

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from tltd.domain import Worker, WorkerState
from tltd.errors import NotFound
from tltd.store import convert
from tltd.store.database import Database
from tltd.store.status import check_transition, record_event, switch_status
from tltd.store.tables import WorkerRow, utcnow

_FINAL_WORKER_STATES = (WorkerState.STOPPED, WorkerState.FAILED)


class WorkerRecords:
    """Worker processes' records."""

    def __init__(self, db: Database) -> None:
        self.db = db

    def upsert(self, worker: Worker) -> Worker:
        """Register a worker or update its process facts (pid, device, job, heartbeat).

        A state change goes through the transition map; a stopped/failed worker may come back
        as STARTING (a restart of the same slot). Every state change records an event.
        """
        with self.db.tx() as s:
            return self._upsert_worker(s, worker)

    def record(self, worker: Worker) -> Worker:
        """The supervisor's record of one of its workers, in one transaction: the same state
        again keeps its started_at; a STARTING over a process not stopped or failed records
        that one FAILED first ("replaced by a new process"); then as `upsert`."""
        with self.db.tx() as s:
            row = s.get(WorkerRow, (self.db.node_id, worker.worker_id))
            if row is not None and row.state == worker.state:
                worker = replace(worker, started_at=row.started_at)
            elif (
                row is not None
                and worker.state is WorkerState.STARTING
                and row.state not in _FINAL_WORKER_STATES
            ):
                why = "replaced by a new process"
                switch_status(s, "worker", worker.worker_id, row, WorkerState.FAILED, why)
            return self._upsert_worker(s, worker)

    def _upsert_worker(self, s: Session, worker: Worker) -> Worker:
        now = utcnow()
        row = s.get(WorkerRow, (self.db.node_id, worker.worker_id))
        if row is None:
            row = WorkerRow(
                node_id=self.db.node_id, worker_id=worker.worker_id, state=str(worker.state)
            )
            s.add(row)
            record_event(
                s,
                "worker",
                worker.worker_id,
                "",
                worker.state,
                worker.state_reason or "registered",
                at=now,
            )
        elif row.state != worker.state:
            restart = row.state in _FINAL_WORKER_STATES and worker.state == WorkerState.STARTING
            if not restart:
                check_transition("worker", worker.worker_id, row.state, worker.state)
            record_event(
                s,
                "worker",
                worker.worker_id,
                row.state,
                worker.state,
                worker.state_reason or ("restarted" if restart else ""),
                at=now,
            )
            row.state = str(worker.state)
        row.kind, row.device_id, row.job_id = str(worker.kind), worker.device_id, worker.job_id
        row.pid, row.state_reason = worker.pid, worker.state_reason
        row.started_at = worker.started_at or row.started_at or now
        row.last_heartbeat = worker.last_heartbeat or row.last_heartbeat
        row.updated_at = now
        s.flush()
        return convert.worker_from_row(row)

    def _worker_row(self, s: Session, worker_id: str) -> WorkerRow:
        row = s.get(WorkerRow, (self.db.node_id, worker_id))
        if row is None:
            raise NotFound(f"worker {worker_id!r} not found", field="worker_id")
        return row

    def get(self, worker_id: str) -> Worker:
        with self.db.tx(write=False) as s:
            return convert.worker_from_row(self._worker_row(s, worker_id))

    def list(self, device_id: str | None = None) -> list[Worker]:
        with self.db.tx(write=False) as s:
            q = (
                select(WorkerRow)
                .where(WorkerRow.node_id == self.db.node_id)
                .order_by(WorkerRow.worker_id)
            )
            if device_id is not None:
                q = q.where(WorkerRow.device_id == device_id)
            return [convert.worker_from_row(r) for r in s.scalars(q).all()]

    def set_state(self, worker_id: str, new: WorkerState, reason: str) -> Worker:
        with self.db.tx() as s:
            row = self._worker_row(s, worker_id)
            switch_status(s, "worker", worker_id, row, new, reason)
            return convert.worker_from_row(row)

    def heartbeat(self, worker_id: str) -> Worker:
        """Stamp last_heartbeat = now (the supervisor's liveness record)."""
        with self.db.tx() as s:
            now = utcnow()
            result = s.execute(
                update(WorkerRow)
                .where(WorkerRow.node_id == self.db.node_id, WorkerRow.worker_id == worker_id)
                .values(last_heartbeat=now, updated_at=now)
            )
            if result.rowcount == 0:  # type: ignore[attr-defined]
                raise NotFound(f"worker {worker_id!r} not found", field="worker_id")
            return convert.worker_from_row(self._worker_row(s, worker_id))
