"""The Store: short synchronous SQL transactions that speak domain dataclasses and TltErrors.

One `Database` (engine, sessions, this node's id and epoch: `tltd.store.database`) shared by
repositories named after what they hold, each in a module of its own (shared row look-ups
are in `tltd.store.lookups`):

- `jobs`: jobs and paused jobs (`jobs.JobRecords`); `policies`: their policy versions
  (`policies.PolicyVersions`)
- `requests`: rollout requests (`rollout_requests.RolloutRequests`)
- `leases`: work units under leases, and the state of their requests (`leases.WorkLeases`)
- `samples`: samples one at a time and their reads (`samples.SampleRecords`);
  `sample_batches`: a worker's samples in one transaction (`sample_batches.SampleBatches`);
  `checkpoints`: running samples' tokens so far (`sample_checkpoints.SampleCheckpoints`)
- `deliveries`: groups sent by bounded (asynchronous RL) requests (`deliveries.GroupDeliveries`)
- `drafters`: drafter versions (`drafter_versions.DrafterVersions`); `drafter_leases`:
  drafter training's lease and what it reads (`drafter_leases.DrafterLeases`)
- `nodes`, `devices`, `workers`: `nodes.NodeRegistry`, `devices.DeviceInventory`,
  `workers.WorkerRecords`
- `pushes`: unfinished policy pushes (`pushes.PushRecords`)
- `sessions`: multi-turn sessions and their turns (`sessions.SessionRecords`)
- `history`: events, retention, counters (`history.History`)
"""

from __future__ import annotations

from contextlib import AbstractContextManager

from sqlalchemy.orm import Session

from tltd.settings import default_node_id
from tltd.store.cancels import RequestCancels
from tltd.store.database import Database
from tltd.store.deliveries import GroupDeliveries
from tltd.store.devices import DeviceInventory
from tltd.store.drafter_leases import DrafterLeases
from tltd.store.drafter_versions import DrafterVersions
from tltd.store.history import History
from tltd.store.jobs import JobRecords
from tltd.store.leases import WorkLeases
from tltd.store.nodes import NodeRegistry
from tltd.store.policies import PolicyVersions
from tltd.store.pushes import PushRecords
from tltd.store.rollout_requests import RolloutRequests
from tltd.store.sample_batches import SampleBatches
from tltd.store.sample_checkpoints import SampleCheckpoints
from tltd.store.samples import SampleRecords
from tltd.store.sessions import SessionRecords
from tltd.store.workers import WorkerRecords


class Store:
    """All persistent state of the daemon, as repositories over one database; tables come
    from `tltd.store.migrate.upgrade`.

    `node_id` names the node whose devices and workers this store reads and writes (default:
    the host name); `epoch` is set when the node joins (`nodes.join`)."""

    def __init__(self, url: str, node_id: str = "") -> None:
        self.db = db = Database(url, node_id or default_node_id())
        self.jobs = JobRecords(db)
        self.policies = PolicyVersions(db)
        self.pushes = PushRecords(db)
        self.requests = RolloutRequests(db)
        self.leases = WorkLeases(db)
        self.cancels = RequestCancels(db)
        self.samples = SampleRecords(db, self.leases)
        self.sample_batches = SampleBatches(db, self.samples, self.leases)
        self.checkpoints = SampleCheckpoints(db, self.leases)
        self.deliveries = GroupDeliveries(db)
        self.drafters = DrafterVersions(db)
        self.drafter_leases = DrafterLeases(db)
        self.nodes = NodeRegistry(db)
        self.devices = DeviceInventory(db)
        self.workers = WorkerRecords(db)
        self.sessions = SessionRecords(db)
        self.history = History(db)

    @property
    def url(self) -> str:
        return self.db.url

    @property
    def node_id(self) -> str:
        return self.db.node_id

    @property
    def epoch(self) -> int:
        return self.db.epoch

    @property
    def dialect(self) -> str:
        """ "sqlite" or "postgresql"."""
        return self.db.dialect

    def close(self) -> None:
        self.db.close()

    def batch(self) -> AbstractContextManager[None]:
        """One transaction for this thread's store calls until the block ends (`Database.batch`)."""
        return self.db.batch()

    def _tx(self, write: bool = True) -> AbstractContextManager[Session]:
        return self.db.tx(write)
