"""Several real `tltd serve` daemons on one fresh PostgreSQL database, one CPU slot each.

Every test runs in the default suite (about 5 minutes for the directory on a 2-core machine).
The ones that kill, pause or restart a node or a drafter trainer are marked `slow`:
`-m "not slow"` leaves them out of a quick local run.
"""

from __future__ import annotations

import pytest
from sqlalchemy import text

from tltd.store.database import make_engine

long_only = pytest.mark.slow

# Short leases so that a takeover happens within seconds.
NODE_ENV = dict(
    worker_max_batch=4, worker_max_seq_len=256, drafter_training="false",
    lease_seconds=3, node_heartbeat_seconds=0.5, node_down_seconds=3,
    claim_interval_seconds=0.3, stream_poll_seconds=0.3,
)  # fmt: skip


class Cluster:
    def __init__(self, tmp_path, db_url: str) -> None:
        self.tmp_path, self.db_url = tmp_path, db_url
        self.nodes: dict[str, object] = {}
        self.engine = make_engine(db_url)

    def start(self, node_id: str, **env):
        from tests.rollout.support import ServeProcess

        (self.tmp_path / node_id).mkdir(exist_ok=True)
        d = ServeProcess(
            self.tmp_path / node_id, self.db_url, name=node_id, cpu_slots=1,
            start_timeout=240, node_id=node_id, **(NODE_ENV | env),
        )  # fmt: skip
        self.nodes[node_id] = d
        return d

    def sql(self, query: str, **params) -> list:
        with self.engine.connect() as conn:
            return list(conn.execute(text(query), params).all())

    def units_and_logs(self) -> str:
        """The work units, the requests' states and each node's log tail (a failed wait's
        message)."""
        units = self.sql(
            "SELECT request_id, prompt_index, state, owner_node FROM work_units ORDER BY 1, 2"
        )
        requests = self.sql("SELECT request_id, status, status_reason FROM rollout_requests")
        logs = "".join(
            f"\n--- {name}\n{d.log_file.read_text()[-3000:]}" for name, d in self.nodes.items()
        )
        return f"units {units}, requests {requests}{logs}"

    def close(self) -> None:
        for d in self.nodes.values():
            d.kill()
        self.engine.dispose()


@pytest.fixture
def cluster(tmp_path, migrated_pg_copy):
    c = Cluster(tmp_path, migrated_pg_copy)
    try:
        yield c
    finally:
        c.close()
