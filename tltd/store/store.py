"""The Store: short synchronous SQL transactions that speak domain dataclasses and TltErrors.

One class over one engine, assembled from one part per aggregate (each part is a mixin that
uses the Store's `_tx`, `node_id`, `epoch` and `dialect`; shared row look-ups are in
`tltd.store.lookups`):

- jobs, policy versions, paused jobs: `jobs.JobRecords`
- rollout requests: `rollout_requests.RolloutRequests`
- samples, one at a time / a worker's batch: `samples.SampleRecords`, `sample_batches.SampleBatches`
- work units under leases: `leases.WorkLeases`
- groups sent by bounded (asynchronous RL) requests: `deliveries.GroupDeliveries`
- drafter versions / drafter training's lease: `drafter_versions.DrafterVersions`,
  `drafter_leases.DrafterLeases`
- nodes, devices, workers: `nodes.NodeRegistry`, `devices.DeviceInventory`, `workers.WorkerRecords`
- unfinished policy pushes: `pushes.PushRecords`
- multi-turn sessions and their turns: `sessions.SessionRecords`
- events, retention, counters: `history.History`
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext

from sqlalchemy.orm import Session, sessionmaker

from tltd.settings import default_node_id
from tltd.store import notifications
from tltd.store.database import WRITE_OPTION, WriteTurn, make_engine
from tltd.store.deliveries import GroupDeliveries
from tltd.store.devices import DeviceInventory
from tltd.store.drafter_leases import DrafterLeases
from tltd.store.drafter_versions import DrafterVersions
from tltd.store.history import History
from tltd.store.jobs import JobRecords
from tltd.store.leases import WorkLeases
from tltd.store.nodes import NodeRegistry
from tltd.store.pushes import PushRecords
from tltd.store.rollout_requests import RolloutRequests
from tltd.store.sample_batches import SampleBatches
from tltd.store.samples import SampleRecords
from tltd.store.sessions import SessionRecords
from tltd.store.workers import WorkerRecords
from tltd.store.write_watch import WriteWatch

# What a scheduler tick reads (`devices_and_jobs`): jobs, their active drafters, devices.
# ("job_pauses": a job paused keep freezes its workers on every node's next tick)
SCHEDULING_TABLES = ("jobs", "drafter_versions", "devices", "job_pauses")


class Store(
    JobRecords,
    PushRecords,
    RolloutRequests,
    SampleRecords,
    SampleBatches,
    WorkLeases,
    GroupDeliveries,
    DrafterVersions,
    DrafterLeases,
    NodeRegistry,
    DeviceInventory,
    WorkerRecords,
    SessionRecords,
    History,
):
    """All persistent state of the daemon; tables come from `tltd.store.migrate.upgrade`.

    `node_id` names the node whose devices and workers this store reads and writes (default:
    the host name); `epoch` is set when the node joins (`join_node`)."""

    def __init__(self, url: str, node_id: str = "") -> None:
        self.url = url
        self.node_id = node_id or default_node_id()
        self.epoch = 0
        self.engine = make_engine(url)
        self.own_backends = notifications.OwnBackends(self.engine)  # PostgreSQL sessions
        self._reader = sessionmaker(self.engine, expire_on_commit=False)
        # Writers announce themselves so that SQLite takes its write lock at BEGIN.
        writer_engine = self.engine.execution_options(**{WRITE_OPTION: True})
        self._writer = sessionmaker(writer_engine, expire_on_commit=False)
        # PostgreSQL locks rows; SQLite's writers take turns (WriteTurn).
        self._write_turn = WriteTurn() if self.dialect == "sqlite" else nullcontext
        # Moves after each commit that changed what a tick reads (see write_watch).
        self.scheduling_writes = WriteWatch(SCHEDULING_TABLES, notifications.STATE)
        self.scheduling_writes.watch(self._writer)
        self.scheduling_writes.watch(self._reader)
        self._batch = threading.local()  # .session: the open `batch` of this thread

    @property
    def dialect(self) -> str:
        """ "sqlite" or "postgresql"."""
        return self.engine.dialect.name

    def close(self) -> None:
        self.engine.dispose()

    @contextmanager
    def batch(self) -> Iterator[None]:
        """Make the store calls of this thread, until the block ends, one transaction (one
        commit, one write turn), each call in a savepoint of its own: a call that raises undoes
        only its own writes. Nothing is committed unless the block ends without an error; then
        nothing of it is, and the caller may run the calls again one by one."""
        with self._write_turn(), self._writer.begin() as session:
            self._batch.session = session
            try:
                yield
            finally:
                self._batch.session = None

    @contextmanager
    def _tx(self, write: bool = True) -> Iterator[Session]:
        batch: Session | None = getattr(self._batch, "session", None)
        if batch is not None:
            # Each call reads afresh, as it would in a transaction of its own (a row an earlier
            # call loaded may have changed since; a lock taken now must see it as it is).
            batch.expire_all()
            with batch.begin_nested() if write else nullcontext():
                yield batch
            return
        if not write:
            with self._reader.begin() as session:
                yield session
            return
        with self._write_turn(), self._writer.begin() as session:
            yield session
