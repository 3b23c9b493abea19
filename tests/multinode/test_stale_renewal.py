"""A lease renewal that returns after its units were lost and claimed again (the store was
locked past the heartbeat: the node rejoined under a new epoch and claimed them anew) must
not take the new claims for lost: it renewed the old ones. Taking them for lost cancelled
their samples on the workers while the store still had the units leased here, so those
samples were stored partial (CANCELLED) in units nobody here ran any more."""

from __future__ import annotations

import asyncio
import threading

from tests.api.support import make_settings
from tests.multinode.test_unit_records import _claimed
from tests.store.expiry import expire_unit_leases
from tests.store.test_leases import LONG_LEASE, _node, _requests
from tltd.store import Store
from tltd.supervisor.lease_keeper import LeaseKeeper
from tltd.supervisor.live_requests import LiveRequests
from tltd.supervisor.writes import OrderedWrites


def test_a_renewal_does_not_lose_units_claimed_again_while_it_ran(store: Store, tmp_path):
    _requests(store, 1, 2)  # r0000: 2 prompts
    node = _node(store, "a")
    rid = "r0000"
    in_renewal, release = threading.Event(), threading.Event()

    def stuck_renewal(units, lease_seconds):  # as one stuck behind a lock, then refused
        in_renewal.set()
        assert release.wait(10), "never released"
        return set()

    async def run() -> tuple[set, set]:
        writes = OrderedWrites()
        writes.bind()
        writer = asyncio.create_task(writes.run())
        reqs = LiveRequests(node, make_settings(tmp_path), writes, asyncio.ensure_future,
                            lambda: None)  # fmt: skip

        async def close(*_args) -> None:
            return None

        leases = LeaseKeeper(node, make_settings(tmp_path), reqs, {}, close)
        try:
            await reqs.take_claims(*_claimed(node, LONG_LEASE))
            node.leases.renew = stuck_renewal  # type: ignore[method-assign]
            renewal = asyncio.create_task(leases.renew())
            await asyncio.to_thread(in_renewal.wait, 10)
            # Meanwhile unit 1's lease is lost (rejoin) and the unit claimed again.
            reqs.lose_units({(rid, 1)})
            assert expire_unit_leases(store) == 2
            claims, state = _claimed(node, LONG_LEASE)
            assert sorted(c.prompt_index for c in claims) == [0, 1]
            await reqs.take_claims([c for c in claims if c.prompt_index == 1], state)
            release.set()
            lost = await asyncio.wait_for(renewal, 10)
            live = reqs.queue.get(rid)
            return lost, (set() if live is None else set(live.units))
        finally:
            release.set()
            writer.cancel()

    try:
        lost, live_units = asyncio.run(run())
        # Unit 0's claim was the one renewed and refused: lost. Unit 1's is a new claim: it
        # stays live (its own renewal comes next).
        assert lost == {(rid, 0)}
        assert live_units == {1}
    finally:
        node.close()
