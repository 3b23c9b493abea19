"""The worker pipe's reader thread stores samples before the loop streams them."""

from __future__ import annotations

import asyncio
import multiprocessing
from dataclasses import replace

from tests.store.test_store_api import JOB, _request, _sample
from tltd.contract import rollout_messages as msg
from tltd.store import Store
from tltd.supervisor.worker_pipe import HeartbeatStamp, serve_pipe
from tltd.supervisor.worker_process import store_reported


def test_a_sample_that_ran_twice_streams_the_stored_copy(store: Store) -> None:
    """A retry may produce other tokens (SD vs plain, another worker); the trainer must see
    the copy the store holds, not the new one."""
    store.create_job(JOB)
    store.create_request(_request())
    first = _sample(0, 1, tokens=(7, 8, 9))
    assert store.add_sample(first)
    rerun = replace(first, token_ids=(5, 5), logprobs=(-1.0, -2.0))
    fresh = _sample(1, 0, tokens=(4,))

    got: list[tuple] = []
    parent, child = multiprocessing.Pipe()
    stamp = HeartbeatStamp(store, "w0")

    async def serve() -> None:
        closed = asyncio.Event()
        serve_pipe(
            "w0",
            parent,
            asyncio.get_running_loop(),
            receive=lambda m: store_reported(store, stamp, m),
            deliver=got.append,
            closed=closed.set,
        )
        child.send(msg.Finished(rerun))
        child.send(msg.Finished(fresh))
        child.close()
        await asyncio.wait_for(closed.wait(), 30)

    asyncio.run(serve())

    (dup, dup_stored, _), (new, new_stored, _) = got[:2]
    assert dup_stored is False and dup.sample == first  # the stored copy, not the rerun
    assert new_stored is True and new.sample == fresh
    assert [s.token_ids for s in store.list_samples(first.request_id)] == [(7, 8, 9), (4,)]
