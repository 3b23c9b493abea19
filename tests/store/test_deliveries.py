"""The groups a bounded request's stream takes, on PostgreSQL: a unit done between
the take's read of done units and its count of what may still come is still to come (on
PostgreSQL each statement sees what committed before it), so the stream waits for it instead
of ending short of its bound. (SQLite serializes the take with every writer: nothing commits
in between.)"""

from __future__ import annotations

from dataclasses import replace

from tests.store.test_leases import LONG_LEASE, _node, _sample
from tests.store.test_store_api import JOB, SAMPLING
from tltd.domain import RolloutRequest
from tltd.store import Store
from tltd.store.deliveries import GroupDeliveries


def test_a_unit_done_after_the_read_is_still_to_come(pg_store: Store, monkeypatch) -> None:
    store = pg_store
    store.jobs.create(JOB)
    req = RolloutRequest("r", JOB.job_id, ((1, 2, 3),), SAMPLING)
    store.requests.create(replace(req, bound_groups=1))
    a = _node(store, "a")
    try:
        assert a.leases.claim_units(capacity=10, lease_seconds=LONG_LEASE)
        # Read while the unit ran: nothing done. It is done (committed) before the count.
        done_units = GroupDeliveries._done_units

        def done_meanwhile(self, s, rr, carried, limit):
            read = done_units(self, s, rr, carried, limit)
            for i in range(SAMPLING.n):
                a.samples.add(_sample("r", 0, i))
            a.leases.finish_unit("r", 0, None, "")
            return read

        monkeypatch.setattr(GroupDeliveries, "_done_units", done_meanwhile)
        took = store.deliveries.take_groups("r", 1, carried=False)
        assert took.groups == () and took.more_may_come
        monkeypatch.setattr(GroupDeliveries, "_done_units", done_units)
        took = store.deliveries.take_groups("r", 1, carried=False)
        assert [(g.request_id, g.prompt_index) for g in took.groups] == [("r", 0)]
        assert not took.more_may_come
    finally:
        a.close()
